"""Where a VLM's weights come from: one of four sources, picked once from the config by `weight_source`.

- FreshWeights: fresh weights shaped by `model.*`, with the dataset's own processor (the digits demo);
- PartWeights: a vision-tower folder + a language-model folder (`vlm.vision_from` + `vlm.language_from`),
  joined by a fresh projector (where LLaVA's stage 1 starts);
- LlavaWeights: a LLaVA folder (`model.init_from`: an align run or a llava-hf release);
- QwenWeights: a Qwen2.5-VL or Qwen3-VL folder (`model.init_from`: a release or a Qwen run), native resolution
  within `data.min_pixels` / `data.max_pixels`; what differs between the two is one row of QWEN_ARCHS.

Each gives its config (LlavaConfig, Qwen2_5_VLConfig or Qwen3VLConfig: json and the tokenizer only, no weights), its
processor, the model in fp32 on the CPU for an attention backend, and what the log says about it. `weight_source`
reads json only: config validation calls it, before anything is written. So this module imports nothing heavy at
its top; the methods that read tokenizers and weights import recipes/vlm's torch/transformers modules (pretrained,
model, data, qwen) where they run, and composing a config stays free of both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config import TrainConfig
from common.errors import ConfigError, DataError
from common.weights import check_folder
from recipes.vlm.schema import VLMModelConfig, check_pixel_budget

VISION_TYPES = ("clip", "clip_vision_model", "siglip", "siglip_vision_model")


# --- the folders, checked from their json (config validation) -------------------------------------------


def _folder_config(path: str, key: str) -> tuple[Path, dict]:
    """(the folder, its config.json) after checking its safetensors files' headers (one line for a file cut short)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={path}: no such folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"{key}={path}: no readable config.json there (a Hugging Face model folder is expected)"
        ) from None
    check_folder(folder, f"{key}={path}")
    return folder.resolve(), config


@dataclass(frozen=True)
class QwenArch:
    """What differs between the Qwen-VL generations that train through one code path (recipes/vlm/qwen.py): the
    rest (native-resolution image processor, <|image_pad|> expansion, the tower over one patch sequence with per-image
    cu_seqlens, 3-row mRoPE positions from get_rope_index, the packed language rows) is the same."""

    name: str  # in words
    model: str  # transformers' class of the folder (weights, forward, generate; the export loads as it)
    base: str  # its inner model, whose get_rope_index lays out a sample's mRoPE positions
    tower: str  # vision_config.model_type
    patch: int  # px side of a patch; an image token merges 2x2 of them (`unit`)
    # The tower also merges intermediate blocks' features and adds them to the first language layers' hidden states
    # at the image tokens (DeepStack): those mergers are projectors too (recipes/vlm/parallelize.py's vlm_parts).
    deepstack: bool

    @property
    def unit(self) -> int:
        """px side of one image token: the image processor resizes to multiples of it (2x2 merge, both releases)."""
        return 2 * self.patch


# model_type of a Qwen-VL folder -> its architecture; the model_type is also its model.vision (its own tower, set
# from the folder by recipes/vlm/config.py). Qwen3-VL's language model is Qwen3 (q/k norms) with interleaved mRoPE
# sections: transformers' classes carry that, and the positions' layout ([3, R, L], or [4, 1, R*L] packed) is shared.
QWEN_ARCHS = {
    "qwen2_5_vl": QwenArch(
        "Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel", "qwen2_5_vl_vision", 14, False
    ),
    "qwen3_vl": QwenArch("Qwen3-VL", "Qwen3VLForConditionalGeneration", "Qwen3VLModel", "qwen3_vl_vision", 16, True),
}
QWEN_NAMES = " or ".join(a.name for a in QWEN_ARCHS.values())
# model_type of the folders model.init_from may name -> what they are, in words
INIT_TYPES = {"llava": "LLaVA", **{t: a.name for t, a in QWEN_ARCHS.items()}}


def qwen_arch(folder) -> QwenArch:
    """The QwenArch of a Qwen-VL folder, from its config.json's model_type."""
    return QWEN_ARCHS[json.loads((Path(folder) / "config.json").read_text())["model_type"]]


def init_folder(init_from: str) -> tuple[Path, str]:
    """(the folder `model.init_from` names, its model_type): a run (its export/) or a model folder whose
    model_type is one of INIT_TYPES, with safetensors weights."""
    path = Path(init_from).expanduser()
    candidate = path / "export" if (path / "export" / "config.json").exists() else path
    folder, config = _folder_config(str(candidate), "model.init_from")
    model_type = config.get("model_type")
    if model_type not in INIT_TYPES:
        raise ConfigError(
            f"model.init_from={init_from}: model_type {model_type!r} is not a LLaVA "
            f"(a LlavaForConditionalGeneration folder or an align run is expected) nor a {QWEN_NAMES}"
        )
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"model.init_from={init_from}: no *.safetensors weights in {folder}")
    return folder, model_type


def llava_folder(init_from: str) -> Path:
    """The LLaVA folder `model.init_from` names: an align run (its export/) or a LlavaForConditionalGeneration
    folder."""
    folder, model_type = init_folder(init_from)
    if model_type != "llava":
        raise ConfigError(
            f"model.init_from={init_from}: model_type {model_type!r} is not a LLaVA "
            "(a LlavaForConditionalGeneration folder or an align run is expected)"
        )
    return folder


def check_vision_folder(vision_from: str) -> None:
    """One line, before anything is written, for a `vlm.vision_from` that is no CLIP / SigLIP tower."""
    _, config = _folder_config(vision_from, "vlm.vision_from")
    if config.get("model_type") not in VISION_TYPES:
        raise ConfigError(
            f"vlm.vision_from={vision_from}: model_type {config.get('model_type')!r} is not a CLIP or "
            "SigLIP vision tower (CLIPVisionModel, CLIPModel, SiglipVisionModel or SiglipModel)"
        )


def check_language_folder(language_from: str) -> None:
    """One line, before anything is written, for a `vlm.language_from` that is no causal LM with a tokenizer."""
    folder, config = _folder_config(language_from, "vlm.language_from")
    if not any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or []):
        raise ConfigError(
            f"vlm.language_from={language_from}: architectures {config.get('architectures')} name no "
            "*ForCausalLM (a Llama-family causal language model is expected)"
        )
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        raise ConfigError(
            f"vlm.language_from={language_from}: no tokenizer there (tokenizer.json / tokenizer_config.json)"
        )


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


class FreshWeights:
    """Fresh weights shaped by `model.*`, with the processor of the dataset (`meta`: its meta.json, once it
    is prepared). Without `meta` (run.dry_run, the memory model) no tokenizer is read: the config assumes a
    vocabulary when model.vocab_size is 0."""

    def __init__(self, model: VLMModelConfig, data_root: str, meta: dict | None = None):
        self.model, self.data_root, self.meta = model, data_root, meta
        self.label = f"the processor of data.root={data_root}"
        self._processor = None

    def check(self) -> None:
        """The dataset must come with the processor `model.*` fit: digits built for the model's image sizes."""
        if self.meta is None:
            return
        from recipes.vlm.data import is_conversations

        if is_conversations(self.meta):
            raise ConfigError(
                f"data.root={self.data_root} holds LLaVA conversations, which the model's own processor "
                "tokenizes: give vlm.vision_from + vlm.language_from (pretrained parts) or model.init_from "
                "(a LLaVA)"
            )
        # The dataset's processor decides how many image tokens a prompt holds; the vision tower must agree.
        built = {"image_size": self.meta["image_size"], "patch_size": self.meta["patch_size"]}
        wanted = {"image_size": self.model.image_size, "patch_size": self.model.vision_patch_size}
        if built != wanted:
            raise DataError(
                f"data.root={self.data_root} was built for {built}, the model has {wanted}: "
                "rebuild it with those sizes (see data.build) or point data.root elsewhere"
            )

    def processor(self):
        if self.meta is None:
            raise RuntimeError(
                "fresh weights take the dataset's processor: weight_source(cfg, meta) after prepare_data"
            )
        if self._processor is None:
            from recipes.vlm.data import load_processor

            self._processor = load_processor(self.meta["processor_dir"])
        return self._processor

    def config(self):
        from recipes.vlm.model import llava_config

        if self.meta is None:
            vocab = self.model.vocab_size or 1024
            return llava_config(
                self.model, vocab_size=vocab, image_token_id=vocab - 1, pad_token_id=0, bos_token_id=1, eos_token_id=2
            )
        tokenizer = self.processor().tokenizer
        return llava_config(
            self.model,
            vocab_size=self.model.vocab_size or len(tokenizer),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )

    def load(self, attention: str):
        from recipes.vlm.model import build_model

        return build_model(self.config(), attention)

    def describe(self, model) -> str | None:
        return None  # the digits demo: `model.*` say it all


class PartWeights:
    """A LLaVA assembled from a vision-tower folder and a language-model folder, with a fresh projector."""

    label = "vlm.vision_from + vlm.language_from"

    def __init__(self, vision_from: str, language_from: str, model: VLMModelConfig):
        self.vision_from, self.language_from, self.model = vision_from, language_from, model
        self._processor = None

    def check(self) -> None:
        check_vision_folder(self.vision_from)
        check_language_folder(self.language_from)

    def processor(self):
        if self._processor is None:
            from recipes.vlm.pretrained import parts_processor

            self._processor = parts_processor(self.vision_from, self.language_from, self.model)
        return self._processor

    def config(self):
        from recipes.vlm.pretrained import parts_config

        return parts_config(self.vision_from, self.language_from, self.model, self.processor().tokenizer)

    def load(self, attention: str):
        from recipes.vlm.pretrained import load_parts

        return load_parts(self.config(), self.vision_from, self.language_from, attention)

    def describe(self, model) -> str:
        from recipes.vlm.model import tower_image_tokens, tower_kind

        c = model.config
        tower = f"{tower_kind(c.vision_config)} vision tower ({_params(model.model.vision_tower):,})"
        return (
            f"kiln: LLaVA from {self.label}: {tower}, projector ({_params(model.model.multi_modal_projector):,}, "
            f"fresh), language model ({_params(model.model.language_model) + _params(model.lm_head):,}, vocabulary "
            f"{c.text_config.vocab_size:,} with <image> = {c.image_token_id}); image features: layer "
            f"{c.vision_feature_layer}, strategy {c.vision_feature_select_strategy}, {tower_image_tokens(c)} tokens "
            "per image"
        )


class LlavaWeights:
    """A LLaVA folder, whole: its own config, processor and chat template (the recipe's `model.*` do not apply)."""

    def __init__(self, init_from: str):
        self.init_from = init_from
        self.label = f"model.init_from={init_from}"
        self.folder = None

    def check(self) -> None:
        self.folder = llava_folder(self.init_from)

    def processor(self):
        from recipes.vlm.pretrained import llava_processor

        return llava_processor(self.folder)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder, local_files_only=True)

    def load(self, attention: str):
        from recipes.vlm.pretrained import load_llava

        return load_llava(self.folder, attention)

    def describe(self, model) -> str:
        return f"kiln: {self.label}: loaded all {_params(model):,} weights (vision tower, projector, language model)"


class QwenWeights:
    """A Qwen2.5-VL or Qwen3-VL folder, whole: its config, tokenizer (chat template) and image processor, the
    processor's pixel budget replaced by data.min_pixels / data.max_pixels where they are set (native resolution:
    recipes/vlm/qwen.py)."""

    def __init__(self, init_from: str, min_pixels: int = 0, max_pixels: int = 0):
        self.init_from, self.min_pixels, self.max_pixels = init_from, min_pixels, max_pixels
        self.label = f"model.init_from={init_from}"
        self.folder = self.arch = None
        self._processing = None

    def check(self) -> None:
        self.folder, model_type = init_folder(self.init_from)
        self.arch = QWEN_ARCHS[model_type]
        check_pixel_budget(self.min_pixels, self.max_pixels, self.arch.unit)

    def processor(self):
        """The folder's (tokenizer, image processor) as a QwenProcessing (recipes/vlm/qwen.py)."""
        if self._processing is None:
            from recipes.vlm.qwen import load_processing

            self._processing = load_processing(
                self.folder,
                self.config().image_token_id,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
        return self._processing

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder, local_files_only=True)

    def load(self, attention: str):
        from recipes.vlm.qwen import load_qwen

        return load_qwen(self.folder, attention)

    def describe(self, model) -> str:
        from recipes.vlm.parallelize import vlm_parts

        tower, merger, language = vlm_parts(model)
        budget = self.processor().image_processor.size
        mergers = "mergers (DeepStack's included)" if self.arch.deepstack else "merger"
        return (
            f"kiln: {self.label}: loaded all {_params(model):,} weights ({self.arch.name}): vision tower "
            f"({_params(tower) - _params(merger):,}), {mergers} ({_params(merger):,}), language model "
            f"({_params(language) + _params(model.lm_head):,}); images at native resolution within "
            f"{budget['shortest_edge']:,}..{budget['longest_edge']:,} pixels"
        )


WeightSource = FreshWeights | PartWeights | LlavaWeights | QwenWeights


def weight_source(cfg: TrainConfig, meta: dict | None = None) -> WeightSource:
    """The one source of weights `cfg` names, checked (one line for keys that contradict each other or a folder
    that cannot be what its key asks for). `meta`: the dataset's meta.json once prepared (FreshWeights'
    processor)."""
    m, v = cfg.model, cfg.vlm
    if bool(v.vision_from) != bool(v.language_from):
        raise ConfigError("vlm.vision_from and vlm.language_from go together: a LLaVA is built from both parts")
    if m.init_from and v.vision_from:
        raise ConfigError(
            "model.init_from and vlm.vision_from/language_from exclude each other: continue from a LLaVA, "
            "or build one from pretrained parts"
        )
    model_type = init_folder(m.init_from)[1] if m.init_from else ""
    if model_type == "llava" and v.stage == "align":
        raise ConfigError(
            "model.init_from is for vlm.stage=finetune (align starts from vlm.vision_from + "
            "vlm.language_from, or from fresh weights)"
        )
    d = cfg.data
    budget = getattr(d, "min_pixels", 0), getattr(d, "max_pixels", 0)
    if model_type not in QWEN_ARCHS and any(budget):
        raise ConfigError(
            "data.min_pixels / data.max_pixels are the pixel budget of a native-resolution model "
            f"(model.init_from=<a {QWEN_NAMES} folder>); a LLaVA resizes every image to its tower's image size"
        )
    if model_type in QWEN_ARCHS:
        source = QwenWeights(m.init_from, *budget)
    elif m.init_from:
        source = LlavaWeights(m.init_from)
    elif v.vision_from:
        source = PartWeights(v.vision_from, v.language_from, m)
    else:
        source = FreshWeights(m, cfg.data.root, meta)
    source.check()
    return source
