"""LLaVA's weights in: a LLaVA assembled from a vision-tower folder and a language-model folder (where LLaVA's
stage 1 starts), or loaded whole from a LLaVA folder (an align run's export, a llava-hf release); the processor
each comes with, the check that processor and tower agree on the image tokens, and the LLaVA state dict out
(`llava_hf_state_dict`).

The folders are checked from their json, and which of these a run uses is chosen, by recipes/vlm/weights.py's
`weight_source` (while the config is validated, nothing written yet); weights are read by the trainer. Assembling
keeps the parts' modules as loaded: the tower's and the language model's weights are the folders' tensors (fp32),
so after `align` they are bit for bit the source weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from common.errors import ConfigError
from recipes.vlm.attention import attn_implementation, register_varlen_attention
from recipes.vlm.model import assemble_config, build_model, feature_choice, tower_image_tokens, tower_kind
from recipes.vlm.schema import VLMModelConfig

IMAGE_TOKEN = "<image>"

# LLaVA-1.5's conversation format (its `vicuna_v1` template: system prompt, "USER: ... ASSISTANT: ...",
# each answer closed by eos), for a language model whose tokenizer has no chat template of its own.
# Content is a string (with <image> where the image goes) or OpenAI-style parts (an image part -> "<image>\n").
LLAVA_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the human's questions."
)
LLAVA_CHAT_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system = "LLAVA_SYSTEM" -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{{- bos_token + system + ' ' -}}
{%- for message in loop_messages -%}
{%- if message['role'] == 'user' -%}
{{- 'USER: ' -}}
{%- elif message['role'] == 'assistant' -%}
{{- 'ASSISTANT: ' -}}
{%- else -%}
{{- raise_exception('unsupported role ' + message['role'] + ': use system (first), user or assistant') -}}
{%- endif -%}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}
{{- '<image>\n' -}}
{%- elif part['type'] == 'text' -%}
{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}
{{- eos_token -}}
{%- else -%}
{{- ' ' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- 'ASSISTANT:' -}}
{%- endif -%}""".replace("LLAVA_SYSTEM", LLAVA_SYSTEM)


# --- configs and processors --------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_loading():
    """transformers prints a table of every checkpoint key a model does not use; loading a vision model
    from a dual encoder (CLIPModel) lists the whole text tower. Kiln says what it loaded instead."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def vision_config(path: str):
    """The tower's config from a vision model or a dual encoder folder. SigLIP's attention-pooling head is
    left out: LLaVA's features are hidden states, the head would be dead weight."""
    from transformers import AutoConfig, SiglipVisionConfig

    config = AutoConfig.from_pretrained(Path(path).expanduser(), local_files_only=True)
    config = getattr(config, "vision_config", None) or config
    if isinstance(config, SiglipVisionConfig):
        config.vision_use_head = False
    return config


def parts_processor(vision_from: str, language_from: str, m: VLMModelConfig):
    """LlavaProcessor of the parts: the vision folder's image processor, the language model's tokenizer
    with `<image>` added (and a pad token: eos or unk when it has none), its chat template or LLaVA-1.5's."""
    from tokenizers import AddedToken
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(Path(language_from).expanduser(), local_files_only=True)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token  # LLaVA-1.5: unk
    with quiet_loading():
        image_processor = AutoImageProcessor.from_pretrained(Path(vision_from).expanduser(), local_files_only=True)
    tower = vision_config(vision_from)
    kind = tower_kind(tower)
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=tower.patch_size,
        vision_feature_select_strategy=feature_choice(m, kind)[1],
        num_additional_image_tokens=1 if kind == "clip" else 0,  # CLIP's CLS token
        chat_template=tokenizer.chat_template or LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def parts_config(vision_from: str, language_from: str, m: VLMModelConfig, tokenizer):
    """LlavaConfig of the parts (nothing loaded but json): their configs, the vocabulary grown to hold
    `<image>` (only if the embedding has no spare row for it), LLaVA's feature choice for the tower."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(Path(language_from).expanduser(), local_files_only=True)
    text.vocab_size = max(text.vocab_size, len(tokenizer))
    text.pad_token_id = tokenizer.pad_token_id
    return assemble_config(
        m, vision_config(vision_from), text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )


def llava_processor(folder: Path):
    """A LLaVA folder's own processor (tokenizer with `<image>`, image processor, chat template)."""
    from transformers import AutoProcessor, LlavaProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    if not isinstance(processor, LlavaProcessor):
        raise ConfigError(
            f"model.init_from={folder}: its processor is a {type(processor).__name__}, not a LlavaProcessor"
        )
    return processor


def check_image_tokens(processor, config, source: str) -> torch.Tensor:
    """One line when processor and tower disagree (instead of a shape error in the first forward):
    image size, `<image>` id, and how many tokens one image expands to vs the tower's features.
    Returns the pixel values of one blank image (see recipes/vlm/data.py: blank_sample)."""
    from PIL import Image

    side = config.vision_config.image_size
    enc = processor(text=processor.image_token, images=[Image.new("RGB", (side, side))], return_tensors="pt")
    pixels, ids = enc["pixel_values"], enc["input_ids"][0]
    if tuple(pixels.shape[-2:]) != (side, side):
        raise ConfigError(
            f"{source}: the image processor makes {pixels.shape[-2]}x{pixels.shape[-1]} images, the vision "
            f"tower takes {side}x{side}"
        )
    if processor.image_token_id != config.image_token_id:
        raise ConfigError(
            f"{source}: the processor's {processor.image_token} is token {processor.image_token_id}, the "
            f"model's image_token_index is {config.image_token_id}"
        )
    have, want = int((ids == config.image_token_id).sum()), tower_image_tokens(config)
    if have != want:
        raise ConfigError(
            f"{source}: the processor expands {processor.image_token} to {have} tokens but the vision tower "
            f"gives {want} features per image (patch_size {config.vision_config.patch_size}, "
            f"vision_feature_select_strategy {config.vision_feature_select_strategy}); they must agree"
        )
    return pixels


# --- weights -----------------------------------------------------------------------------------------------


def grow_vocab(lm, vocab_size: int) -> None:
    """Resize the language model's embeddings (and untied output layer) to `vocab_size` rows; every new
    row is the mean of the old ones (a new token starts as an average token, not a random one)."""
    old = lm.get_input_embeddings().weight.shape[0]
    if vocab_size <= old:
        return
    lm.resize_token_embeddings(vocab_size, mean_resizing=False)
    weights = {id(w): w for w in (lm.get_input_embeddings().weight, lm.get_output_embeddings().weight)}
    with torch.no_grad():
        for w in weights.values():
            w[old:] = w[:old].mean(0)


def load_parts(config, vision_from: str, language_from: str, attention: str):
    """The LLaVA of `parts_config`: the tower and the language model as loaded from their folders (fp32),
    the vocabulary grown for `<image>`, a fresh projector (torch's default Linear init, as LLaVA's; drawn
    from the caller's seed)."""
    from transformers import AutoModelForCausalLM, CLIPVisionModel, SiglipVisionModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    impl = attn_implementation(attention)
    tower_cls = CLIPVisionModel if tower_kind(config.vision_config) == "clip" else SiglipVisionModel
    with quiet_loading():
        tower = tower_cls.from_pretrained(
            Path(vision_from).expanduser(),
            config=config.vision_config,
            dtype=torch.float32,
            attn_implementation=impl["vision_config"],
            local_files_only=True,
        )
        lm = AutoModelForCausalLM.from_pretrained(
            Path(language_from).expanduser(),
            dtype=torch.float32,
            attn_implementation=impl["text_config"],
            local_files_only=True,
        )
    grow_vocab(lm, config.text_config.vocab_size)
    with torch.device("meta"):  # the shell: its parts are replaced by the loaded ones below
        model = build_model(config, attention)
    model.model.vision_tower = tower
    model.model.language_model = lm.model
    model.lm_head = lm.lm_head
    model.model.multi_modal_projector = LlavaMultiModalProjector(config)
    # The parts' own config objects become the model's sub-configs: transformers matches sub-models to
    # sub-configs by identity (set_attn_implementation), and save_pretrained writes them.
    model.config.vision_config, model.config.text_config = tower.config, lm.config
    model.generation_config = lm.generation_config
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"assembled LLaVA has unloaded tensors: {meta[:3]}")
    return model


def load_llava(folder: Path, attention: str):
    """A LlavaForConditionalGeneration folder, in fp32 (its own config: the recipe's `model.*` do not apply)."""
    from transformers import LlavaForConditionalGeneration

    if attention == "flash":
        register_varlen_attention()
    with quiet_loading():
        return LlavaForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, attn_implementation=attn_implementation(attention)
        )


# --- weights out ----------------------------------------------------------------------------------------------


def llava_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors with the vision tower under llava-hf's names (`vision_tower.vision_model.*` once saved).
    transformers >= 5.20 holds CLIP and SigLIP towers without their `vision_model` level and saves them so
    (`vision_tower.embeddings.*`); it reads both layouts, but vLLM (0.32, the CPU build included) reads only
    llava-hf's and refuses the other ("no module or parameter named 'vision_tower.embeddings'")."""
    flat, nested = "model.vision_tower.", "model.vision_tower.vision_model."
    return {
        (nested + k[len(flat) :] if k.startswith(flat) and not k.startswith(nested) else k): v
        for k, v in model.state_dict().items()
    }
