"""The tiny Llama 3 tokenizer the LLM demos and tests use, built offline in seconds: a byte-level BPE trained with
``tokenizers`` on Python's help topics (they ship with CPython) and the opposites the chat data asks about, with
Llama 3's special tokens, pre-tokenizer split and chat template (without its date/tools preamble).

    write_llama_tokenizer(folder)   # tokenizer files only: what data.prepare_chat / prepare_preference --tokenizer read
"""

from __future__ import annotations

from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, HEADER_START, HEADER_END, EOT)
# Llama 3's pre-tokenizer split (tokenizer.json of Meta-Llama-3.x), then byte-level BPE.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3.x's chat template without its date/tools preamble: bos, then per message a header, the trimmed
# content and <|eot_id|>; roles other than system/user/assistant are refused.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Word pairs the chat fixture asks about: a model learns the answers in a few dozen steps.
OPPOSITES = [
    ("hot", "cold"),
    ("up", "down"),
    ("big", "small"),
    ("fast", "slow"),
    ("old", "new"),
    ("left", "right"),
    ("open", "closed"),
    ("early", "late"),
    ("light", "dark"),
    ("full", "empty"),
    ("wet", "dry"),
    ("high", "low"),
]
VOCAB_SIZE = 384


def texts(limit: int | None = None) -> list[str]:
    """Python's help topics (they ship with CPython), in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)][:limit]


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A fast tokenizer shaped like Llama 3.2's: byte-level BPE with Llama 3's split, ``<|begin_of_text|>``
    added by the post-processor, eos ``<|end_of_text|>``, no pad token, Llama 3's chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from data.tiny_bases import train_byte_level_bpe

    texts_ = [*texts(30), *(f"What is the opposite of {a}? The opposite of {a} is {b}." for a, b in OPPOSITES)]
    tok = train_byte_level_bpe(texts_, split=LLAMA3_SPLIT, specials=SPECIAL_TOKENS, vocab_size=vocab_size)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),  # character offsets of the raw text (chat label spans use them)
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=[HEADER_START, HEADER_END, EOT],
        chat_template=CHAT_TEMPLATE,
    )


def write_llama_tokenizer(folder: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """:func:`train_tokenizer` saved in ``folder`` (tokenizer files only)."""
    folder = Path(folder).expanduser()
    train_tokenizer(vocab_size).save_pretrained(folder)
    return folder
