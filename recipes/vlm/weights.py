"""Where a VLM's weights come from: one of four sources, picked once from the config by `weight_source`.

- FreshWeights: fresh weights shaped by `model.*`, with the dataset's own processor (the digits demo);
- PartWeights: a vision-tower folder + a language-model folder (`vlm.vision_from` + `vlm.language_from`),
  joined by a fresh projector (where LLaVA's stage 1 starts);
- LlavaWeights: a LLaVA folder (`model.init_from`: an align run or a llava-hf release);
- QwenWeights: a Qwen2.5-VL or Qwen3-VL folder (`model.init_from`: a release or a Qwen run), native resolution
  within `data.min_pixels` / `data.max_pixels`; what differs between the two is one row of QWEN_ARCHS
  (recipes/vlm/archs.py).

Each gives its config (LlavaConfig, Qwen2_5_VLConfig or Qwen3VLConfig: json and the tokenizer only, no weights), its
processor, the model in fp32 on the CPU for an attention backend, and what the log says about it. `weight_source`
reads json only: config validation calls it, before anything is written. So this module imports nothing heavy at
its top; the methods that read tokenizers and weights import recipes/vlm's torch/transformers modules (llava,
model, data, qwen) where they run, and composing a config stays free of both.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.config import TrainConfig
from common.errors import ConfigError, DataError
from common.weights import check_folder
from recipes.vlm.archs import QWEN_ARCHS, QWEN_NAMES, VIDEO_NAMES
from recipes.vlm.schema import VLMModelConfig, check_pixel_budget, check_video_sampling

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


# model_type of the folders model.init_from may name -> what they are, in words
INIT_TYPES = {"llava": "LLaVA", **{t: a.name for t, a in QWEN_ARCHS.items()}}


# Released Qwen-VL folders, for sizing without them (run.dry_run, scripts/plan.py before the download; a download
# keeps the repository's name, as recipes/t2i/sizing.py's RELEASED): their config.json's architecture keys and their
# preprocessor_config.json's pixel budget (what data.max_pixels = 0 keeps). Training still reads the folder.
# - Qwen/Qwen2.5-VL-7B-Instruct: a 32-block tower of 1280 (16 heads, SwiGLU 3420, 112-px windows but in blocks 7, 15,
#   23 and 31), a 2x2 merger into Qwen2.5-7B (28 layers of 3584, 28 heads, 4 key/value heads, SwiGLU 18944,
#   152,064-token vocabulary, untied head): 8,292,166,656 parameters (transformers' class on the meta device).
# - Qwen/Qwen3-VL-8B-Instruct: a 27-block tower of 1152 (16 heads, GELU MLP 4304, full attention in every block, a
#   48x48 table of learned position embeddings), 16-px patches, a 2x2 merger and 3 DeepStack mergers (after blocks 8,
#   16, 24) into Qwen3-8B (36 layers of 4096, 32 heads of 128, 8 key/value heads, q/k norms, SwiGLU 12288,
#   151,936-token vocabulary, untied head): 8,767,123,696 parameters (transformers' class on the meta device). Its
#   text_config's rope_scaling + rope_theta written as transformers 5's rope_parameters, as above.
RELEASED = {
    "Qwen2.5-VL-7B-Instruct": {
        "config": {
            "model_type": "qwen2_5_vl",
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
            "vision_token_id": 151654,
            "image_token_id": 151655,
            "video_token_id": 151656,
            "tie_word_embeddings": False,
            "text_config": {
                "hidden_act": "silu",
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "max_position_embeddings": 128000,
                "max_window_layers": 28,
                "num_attention_heads": 28,
                "num_hidden_layers": 28,
                "num_key_value_heads": 4,
                "rms_norm_eps": 1e-06,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                "sliding_window": 32768,
                "use_sliding_window": False,
                "vocab_size": 152064,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
            "vision_config": {
                "depth": 32,
                "hidden_act": "silu",
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "in_channels": 3,
                "out_hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 2,
            },
        },
        "min_pixels": 3136,
        "max_pixels": 12845056,
    },
    "Qwen3-VL-8B-Instruct": {
        "config": {
            "model_type": "qwen3_vl",
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "image_token_id": 151655,
            "video_token_id": 151656,
            "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
            "tie_word_embeddings": False,
            "text_config": {
                "attention_bias": False,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
                "head_dim": 128,
                "hidden_act": "silu",
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "max_position_embeddings": 262144,
                "num_attention_heads": 32,
                "num_hidden_layers": 36,
                "num_key_value_heads": 8,
                "rms_norm_eps": 1e-06,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5000000,
                    "mrope_section": [24, 20, 20],
                    "mrope_interleaved": True,
                },
                "vocab_size": 151936,
            },
            "vision_config": {
                "deepstack_visual_indexes": [8, 16, 24],
                "depth": 27,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": 1152,
                "in_channels": 3,
                "intermediate_size": 4304,
                "num_heads": 16,
                "num_position_embeddings": 2304,
                "out_hidden_size": 4096,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
        },
        # preprocessor_config.json's size: shortest_edge 65536 (64 tokens of 32 x 32 px), longest_edge 16777216
        "min_pixels": 65536,
        "max_pixels": 16777216,
    },
}


def released(init_from: str) -> dict | None:
    """RELEASED's entry for a model.init_from that is not on this machine but names a release Kiln knows the shape
    of; None otherwise (a folder that exists is read, a missing one of no known name is refused)."""
    path = Path(init_from).expanduser()
    return None if path.exists() else RELEASED.get(path.name)


def released_config(init_from: str):
    """transformers' config (Qwen2_5_VLConfig, ...: its model_type's) of a RELEASED model.init_from (no folder read)."""
    from transformers import CONFIG_MAPPING

    config = released(init_from)["config"]
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def init_model_type(init_from: str) -> str:
    """model.init_from's model_type: a RELEASED name's without its folder (sizing), else its folder's (checked)."""
    entry = released(init_from)
    return entry["config"]["model_type"] if entry else init_folder(init_from)[1]


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
            from recipes.vlm.llava import parts_processor

            self._processor = parts_processor(self.vision_from, self.language_from, self.model)
        return self._processor

    def config(self):
        from recipes.vlm.llava import parts_config

        return parts_config(self.vision_from, self.language_from, self.model, self.processor().tokenizer)

    def load(self, attention: str):
        from recipes.vlm.llava import load_parts

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
        from recipes.vlm.llava import llava_processor

        return llava_processor(self.folder)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder, local_files_only=True)

    def load(self, attention: str):
        from recipes.vlm.llava import load_llava

        return load_llava(self.folder, attention)

    def describe(self, model) -> str:
        return f"kiln: {self.label}: loaded all {_params(model):,} weights (vision tower, projector, language model)"


class QwenWeights:
    """A Qwen2.5-VL or Qwen3-VL folder, whole: its config, tokenizer (chat template), image processor and video
    processor's values, the image processor's pixel budget replaced by data.min_pixels / data.max_pixels and the
    video rate and frame cap by data.video_fps / data.max_frames where they are set (native resolution:
    recipes/vlm/qwen.py, recipes/vlm/video.py)."""

    def __init__(
        self,
        init_from: str,
        min_pixels: int = 0,
        max_pixels: int = 0,
        video_fps: float | None = None,
        max_frames: int | None = None,
    ):
        self.init_from, self.min_pixels, self.max_pixels = init_from, min_pixels, max_pixels
        self.video_fps, self.max_frames = video_fps, max_frames
        self.label = f"model.init_from={init_from}"
        self.folder = self.arch = None
        self._processing = None

    def check(self) -> None:
        entry = released(self.init_from)
        if entry is None:  # a RELEASED name is sized without its folder, refused when loading
            self.folder, model_type = init_folder(self.init_from)
        else:
            model_type = entry["config"]["model_type"]
        self.arch = QWEN_ARCHS[model_type]
        check_pixel_budget(self.min_pixels, self.max_pixels, self.arch.unit)
        check_video_sampling(self.video_fps, self.max_frames)

    def _folder(self) -> Path:
        """The folder, for what reads weights, tokenizer or image processor: one line where only its name is known."""
        if self.folder is None:
            raise ConfigError(
                f"{self.label}: no such folder (its shape is known by name, so run.dry_run and scripts/plan.py size "
                "it; training reads the downloaded folder)"
            )
        return self.folder

    def pixel_budget(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) the images are resized within: data.min_pixels / data.max_pixels where set, else
        the folder's image processor's (a RELEASED name's published ones)."""
        entry = released(self.init_from)
        if entry is not None:
            folder = (entry["min_pixels"], entry["max_pixels"])
        else:
            preprocessor = json.loads((self.folder / "preprocessor_config.json").read_text())
            size = preprocessor.get("size") or {}
            folder = (
                size.get("shortest_edge", preprocessor.get("min_pixels", 0)),
                size.get("longest_edge", preprocessor.get("max_pixels", 0)),
            )
        return self.min_pixels or folder[0], self.max_pixels or folder[1]

    def processor(self):
        """The folder's (tokenizer, image processor) as a QwenProcessing (recipes/vlm/qwen.py)."""
        if self._processing is None:
            from recipes.vlm.qwen import load_processing

            self._processing = load_processing(
                self._folder(),
                self.config().image_token_id,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
                video_fps=self.video_fps,
                max_frames=self.max_frames,
            )
        return self._processing

    def config(self):
        from transformers import AutoConfig

        if self.folder is None:
            return released_config(self.init_from)
        return AutoConfig.from_pretrained(self.folder, local_files_only=True)

    def load(self, attention: str):
        from recipes.vlm.qwen import load_qwen

        return load_qwen(self._folder(), attention)

    def describe(self, model) -> str:
        from recipes.vlm.parallelize import vlm_parts

        tower, merger, language = vlm_parts(model)
        processing = self.processor()
        budget, video = processing.image_processor.size, processing.video
        mergers = "mergers (DeepStack's included)" if self.arch.deepstack else "merger"
        # the video values too: the folder's video processor's, not the images' (recipes/vlm/video.py)
        videos = (
            f"; videos within {video.min_pixels:,}..{video.max_pixels:,} pixels "
            f"{'a clip' if video.rule.clip_budget else 'a frame'}, {video.fps:g} frames per second, "
            f"{video.min_frames}..{video.max_frames} frames"
            if video
            else ""
        )
        return (
            f"kiln: {self.label}: loaded all {_params(model):,} weights ({self.arch.name}): vision tower "
            f"({_params(tower) - _params(merger):,}), {mergers} ({_params(merger):,}), language model "
            f"({_params(language) + _params(model.lm_head):,}); images at native resolution within "
            f"{budget['shortest_edge']:,}..{budget['longest_edge']:,} pixels{videos}"
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
    model_type = init_model_type(m.init_from) if m.init_from else ""
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
    video = getattr(d, "video_fps", None), getattr(d, "max_frames", None)
    arch = QWEN_ARCHS.get(model_type)
    if not (arch and arch.video) and video != (None, None):
        raise ConfigError(
            "data.video_fps / data.max_frames sample the videos of a native-resolution model "
            f"(model.init_from=<a {VIDEO_NAMES} folder>); {arch.name if arch else 'a LLaVA'} takes images only"
        )
    if model_type in QWEN_ARCHS:
        source = QwenWeights(m.init_from, *budget, *video)
    elif m.init_from:
        source = LlavaWeights(m.init_from)
    elif v.vision_from:
        source = PartWeights(v.vision_from, v.language_from, m)
    else:
        source = FreshWeights(m, cfg.data.root, meta)
    source.check()
    return source


def load_model(cfg: TrainConfig, meta: dict):
    """(model, processor, source) from the weights' source (module docstring); the model in fp32 on the CPU."""
    source = weight_source(cfg, meta)
    return source.load(cfg.toggles.attention), source.processor(), source
