"""The GGUF export checked by llama.cpp itself (xllamacpp's llama.cpp and its own server, tests/fixtures/llamacpp.py):
the tests' tiny Llamas (Llama 3's tokenizer and chat template; tied embeddings with Llama 3 RoPE scaling in fp32, and
GQA with an untied output in bf16), their tiny Mixtral (4 experts, top-2), a tiny Qwen3 (tied, bf16, head_dim 32 != 64 /
4 heads) and Qwen3-MoE (8 experts, top-2 renormalized, in every layer), both with a Qwen2Tokenizer (Qwen2's split) and
ChatML, and an llm_tiny run exported by scripts/export.py --format gguf (its byte-level BPE with GPT-2's split).
llama.cpp's server gives log-probabilities, not raw logits: in F16 its prompt log-probabilities (the whole vocabulary at
each position) are within BOUNDS['f16'] of transformers' (float32, on the Hugging Face folder), its greedy answers are
transformers' token for token, it tokenizes text and the chat template's prompt into transformers' ids, and the greedy
answer to that chat prompt is transformers'. BF16 and Q8_0 move the log-probabilities further (within their BOUNDS;
tokens and chat prompt still equal): the drifts are printed. The Qwens are checked in F16 only (BF16 and Q8_0 quantize
as for the Llamas; CI's time). Without llama.cpp's environment (make llamacpp-env) those checks skip, and fail under
CI=true; the export itself (scripts/export.py --format gguf) is checked either way."""

from __future__ import annotations

import json

import pytest
import torch

from recipes.llm.gguf_export import write_gguf
from tests.conftest import load_script
from tests.fixtures.llamacpp import llamacpp_python, probe, reference
from tests.fixtures.llm import EOT, write_llama_folder, write_moe_folder, write_qwen3_folder
from tests.fixtures.runs import LLM_10_STEPS

pytestmark = pytest.mark.integration

# max |llama.cpp - transformers| over the prompt's log-probabilities (whole vocabulary, every position), measured
# with xllamacpp 2026.10.11549 (CPU): 0.0038 to 0.0086 in F16, 0.020 to 0.036 in BF16, 0.106 to 0.130 in Q8_0 (the
# log-softmax of llama-cpp-python 0.3.36's raw logits: 0.0033 to 0.0059, 0.020 to 0.058, 0.088 to 0.146). F16's bound
# is 2e-2: the newer llama.cpp's 0.0086 is near the 1e-2 that held for the older one. The Qwens share F16's bound.
BOUNDS = {"f16": 2e-2, "bf16": 1e-1, "q8_0": 0.25}
QWENS = ("qwen3", "qwen3_moe")  # checked in F16 only
FTYPE = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}  # the file's type as llama.cpp reads it
NEW_TOKENS = 12
TEXTS = [
    "What is the opposite of hot? The opposite of hot is cold.",
    "  two spaces, tabs\tand\nnew lines\n\n, digits 12345 and 3.14, 'quotes' don't",
    "Unicode: café, naïve, 東京, emoji 🙂 and <|eot_id|> as plain text",
]
CHAT = [
    {"role": "system", "content": "You answer with one word."},
    {"role": "user", "content": "What is the opposite of up?"},
]


@pytest.fixture(scope="module")
def llamacpp():
    return llamacpp_python()  # skips without make llamacpp-env, fails under CI=true


def request_for(folder) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The opposite of hot is")["input_ids"]
    stop = [tokenizer.eos_token_id, *([tokenizer.convert_tokens_to_ids(EOT)] if EOT in tokenizer.get_vocab() else [])]
    return {"prompt": prompt, "new_tokens": NEW_TOKENS, "stop": stop, "texts": TEXTS, "chat": CHAT, "chat_tokens": 8}


def compare(theirs: dict, ours: dict, bound: float, exact: bool = True) -> float:
    """The max log-probability difference (asserted within `bound`); with `exact`, the greedy tokens and the chat
    answer too. The tokenizer and the chat prompt always match: they do not depend on the weights' type."""
    drift = (torch.tensor(ours["logprobs"]) - theirs["logprobs"]).abs().max().item()
    assert drift <= bound, drift
    assert ours["tokens"] == theirs["tokens"]
    assert ours["chat_prompt"] == theirs["chat_prompt"]
    if exact:
        assert ours["greedy"] == theirs["greedy"]
        assert ours["chat_answer"] == theirs["chat_answer"]
    return drift


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_llamacpp")
    folders = {v: write_llama_folder(root / v, v) for v in ("tied", "gqa")}
    folders["mixtral"] = write_moe_folder(root / "mixtral", "mixtral")
    folders["qwen3"] = write_qwen3_folder(root / "qwen3")
    # llama.cpp's qwen3moe: experts in every layer, top-k renormalized (the fixture's default has neither)
    moe = dict(tokenizer="qwen", mlp_only_layers=[], norm_topk_prob=True)
    folders["qwen3_moe"] = write_moe_folder(root / "qwen3_moe", "qwen3_moe", **moe)
    return root, folders, {v: reference(f, request_for(f)) for v, f in folders.items()}


@pytest.mark.parametrize("variant", ["tied", "gqa", "mixtral", *QWENS])
def test_llamacpp_answers_as_transformers(tiny, variant, llamacpp, capsys):
    root, folders, references = tiny
    drifts = {}
    for gguf_type, bound in BOUNDS.items():
        if variant in QWENS and gguf_type != "f16":
            continue
        path = write_gguf(folders[variant], root / f"{variant}-{gguf_type}", gguf_type)
        ours = probe(llamacpp, path, request_for(folders[variant]))
        drifts[gguf_type] = round(compare(references[variant], ours, bound, exact=gguf_type == "f16"), 4)
        assert ours["metadata"] == {"ftype": FTYPE[gguf_type], "n_vocab": references[variant]["logprobs"].shape[-1]}
    with capsys.disabled():
        print(f"\nllama.cpp vs transformers, {variant}: max prompt log-probability difference {drifts}")


@pytest.fixture(scope="module")
def run_export(trained, tmp_path_factory):
    """The 1-rank llm_tiny run of the layout tests (tests/distributed/test_llm_layouts.py), exported from its last
    checkpoint by scripts/export.py --format gguf."""
    out = tmp_path_factory.mktemp("gguf_run") / "export"
    assert load_script("export").main([str(layout_run(trained)), "--out", str(out), "--format", "gguf"]) == 0
    return out


def layout_run(trained):
    return trained([*LLM_10_STEPS, "trainer.micro_batch_size=8"], 1)


def test_scripts_export_writes_the_gguf_and_modelfile(run_export):
    import gguf

    assert sorted(p.name for p in (run_export / "gguf").iterdir()) == ["Modelfile", "model-f16.gguf"]
    reader = gguf.GGUFReader(run_export / "gguf" / "model-f16.gguf")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"  # the run's own byte-level BPE
    modelfile = (run_export / "gguf" / "Modelfile").read_text().splitlines()
    assert modelfile[:2] == ["FROM ./model-f16.gguf", 'TEMPLATE """{{ .Prompt }}"""']  # no chat template: the prompt


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gguf-type", "q8_0"], "--gguf-type is for a GGUF export: add --format gguf"),
        (["--format", "onnx"], "export.formats: the LLM recipes do not write 'onnx' (they write: gguf)"),
        (["--format", "gguf", "--gguf-type", "q4_k_m"], "export.gguf_type='q4_k_m' is not written here (K-quants"),
    ],
)
def test_scripts_export_refuses_what_it_does_not_write(trained, args, message, tmp_path, capsys):
    out = tmp_path / "export"
    assert load_script("export").main([str(layout_run(trained)), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"export: error: {message}"), err
    assert not out.exists() and not any(tmp_path.iterdir())  # nothing left behind


def test_llamacpp_answers_as_transformers_on_a_run(run_export, llamacpp, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_export)
    request = {
        "prompt": tokenizer("The with statement is used to wrap")["input_ids"],
        "new_tokens": NEW_TOKENS,
        "stop": [tokenizer.eos_token_id],
        "texts": TEXTS[:2],
        "chat": [],
        "chat_tokens": 0,
    }
    ours = probe(llamacpp, run_export / "gguf" / "model-f16.gguf", request)
    drift = compare(reference(run_export, request), ours, BOUNDS["f16"])
    with capsys.disabled():
        print(f"\nllama.cpp vs transformers, llm_tiny run: max prompt log-probability difference {drift}")


def test_serve_llamacpp_answers_as_transformers_and_checks_the_key(run_export, llamacpp, tmp_path):
    """scripts/serve.py serve.engine=llamacpp on the llm_tiny run's GGUF (export/gguf) with $KILN_API_KEY set, through
    the official openai client: the chat completion is transformers' greedy answer on the Hugging Face export to the
    same prompt (the run is a base LM: both get the plain chat template that joins the messages' text), and a request
    without the key gets 401."""
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.kiln.serving import BASE_LM_CHAT_TEMPLATE, http, running_server

    chat = [{"role": "user", "content": "The with statement is used to wrap"}]
    tokenizer = AutoTokenizer.from_pretrained(run_export)
    model = AutoModelForCausalLM.from_pretrained(run_export, dtype=torch.float32).eval()
    prompt = tokenizer(tokenizer.apply_chat_template(chat, chat_template=BASE_LM_CHAT_TEMPLATE, tokenize=False))
    prompt = torch.tensor([prompt["input_ids"]])
    with torch.no_grad():
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tokenizer.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True)
    body = json.dumps({"model": "tiny", "messages": chat, "max_tokens": NEW_TOKENS}).encode()
    overrides = ("serve.engine=llamacpp", "serve.threads=1", "serve.served_model_name=tiny")
    env = {"KILN_API_KEY": "test-key"}
    with running_server(run_export / "gguf", *overrides, log_path=tmp_path / "server.log", env=env) as base:
        refused = http(f"{base}/v1/chat/completions", body)
        client = OpenAI(base_url=f"{base}/v1", api_key="test-key")
        answer = client.chat.completions.create(model="tiny", messages=chat, max_tokens=NEW_TOKENS, temperature=0)
    assert refused[0] == 401, refused
    assert answer.usage.prompt_tokens == prompt.shape[1]
    assert answer.choices[0].message.content == expected, (answer.choices[0].message.content, expected)
