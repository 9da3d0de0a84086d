"""Offline stand-ins for what a DiT or text-to-image user brings, built in seconds: a diffusers VAE folder, an
ImageFolder of images, a Stable Diffusion 3 pipeline folder and a folder of captioned images.

    make_vae(dir)              # ~/models/sd-vae-ft-mse: a small random AutoencoderKL (save_pretrained)
    make_image_folder(dir)     # ~/data/my_images: digits upscaled to RGB PNGs, one folder per class, one corrupt file
    make_sd3_pipeline(dir)     # ~/models/stable-diffusion-3.5-medium: a tiny StableDiffusion3Pipeline, pretrained parts
    make_flux_pipeline(dir)    # ~/models/FLUX.1-dev: a tiny FluxPipeline (the same pretrained VAE and text encoders)
    make_wan_pipeline(dir)     # ~/models/Wan2.1-T2V-1.3B-Diffusers: a tiny WanPipeline (pretrained=True: VAE, UMT5)
    make_caption_folder(dir)   # ~/data/captioned: digit PNGs with a caption each (name.txt), in several phrasings

The pipelines' VAE and text encoders are pretrained on the digits (data/tiny_pretrain.py: cached, built once), so
that a text-to-image run on them can follow its prompts as on a release; their transformers are random.
Each writes into the folder it is given and returns it. scripts/gpu_check.py builds dit_2b's inputs with them
(a GPU node has no VAE or images either); the tests use them through tests/fixtures/dit.py.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from common.data import moving_digits
from common.data.digit_captions import CAPTION_TEMPLATES, HELD_OUT_TEMPLATES, digit_caption
from common.known_warnings import silence_known_warnings
from data.tiny_pretrain import MOTION_PRETRAIN_TEMPLATES

# A user runs these builders as `python -c "from data.tiny_bases import ..."` (README): an entrypoint of its
# own, silenced like the CLIs before any builder imports transformers/diffusers (and torchao, DeepSpeed with them).
silence_known_warnings()

CLASS_NAMES = tuple(f"digit_{c}" for c in range(10))  # sorted like the digits they hold


@contextlib.contextmanager
def _no_progress_bars():
    """Without transformers' "Writing model shards" bar: a stand-in of a few kilobytes writes in no time, and the
    bar would be all a builder prints."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def make_vae(
    out: str | Path,
    *,
    block_out_channels: tuple[int, ...] = (16, 16, 32, 32),
    latent_channels: int = 4,
    shift_factor: float | None = None,
    seed: int = 0,
) -> Path:
    """A random AutoencoderKL saved with save_pretrained, shaped like sd-vae-ft-mse by default (4 latent
    channels, 1/8 size: it downsamples by 2^(len(block_out_channels)-1)) but with a few thousand
    times fewer weights. `scaling_factor` is SD's 0.18215; `shift_factor` gives an SD3/Flux-style config."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    n = len(block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        shift_factor=shift_factor,
    )
    out = Path(out)
    vae.save_pretrained(out)
    return out


def make_image_folder(
    out: str | Path, *, classes: int = 3, per_class: int = 64, size: int = 24, corrupt: bool = True
) -> Path:
    """An ImageFolder of sklearn digits: `classes` folders digit_0, digit_1, ... with `per_class` RGB PNGs
    each (digits upscaled to `size`, tinted per class so the three channels differ), plus one file
    `broken.png` that is not an image (prepare_images skips and counts it)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    out = Path(out)
    tint = np.array([[1.0, 0.6, 0.3], [0.3, 1.0, 0.6], [0.6, 0.3, 1.0]])
    for c in range(classes):
        folder = out / CLASS_NAMES[c]
        folder.mkdir(parents=True, exist_ok=True)
        rows = np.flatnonzero(digits.target == c)[:per_class]
        for i, row in enumerate(rows):
            gray = Image.fromarray(np.rint(digits.images[row] * 255 / 16).astype(np.uint8)).resize(
                (size, size), Image.BILINEAR
            )
            rgb = (np.asarray(gray, dtype=np.float64)[..., None] * tint[c % len(tint)]).round().astype(np.uint8)
            Image.fromarray(rgb).save(folder / f"{i:04d}.png")
    if corrupt:
        (out / CLASS_NAMES[0] / "broken.png").write_bytes(b"this is not a PNG file")
    return out


# Every phrasing a tokenizer learns: the training captions' and the held-out ones (a released tokenizer knows the
# words of any prompt; which phrasings train is the caption folder's choice, make_caption_folder).
TOKENIZER_TEXT = tuple(
    digit_caption(d, p, templates)
    for templates in (CAPTION_TEMPLATES, HELD_OUT_TEMPLATES)
    for d in range(10)
    for p in range(len(templates))
)


# The moving digits' (the video demo's): every pair in the training phrasings, the held-out ones and the pretraining's.
MOTION_TOKENIZER_TEXT = tuple(
    moving_digits.motion_caption(d, way, p, templates)
    for templates in (moving_digits.CAPTION_TEMPLATES, moving_digits.HELD_OUT_TEMPLATES, MOTION_PRETRAIN_TEMPLATES)
    for d, way in moving_digits.PAIRS
    for p in range(len(templates))
)


def make_clip_tokenizer(out: str | Path, *, max_length: int = 16, vocab_size: int = 300):
    """A CLIPTokenizer on a byte-level BPE trained offline (the `tokenizers` library) on the digit captions:
    CLIP's end-of-word suffix and special tokens, `model_max_length` = `max_length`. Saved to `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        end_of_word_suffix="</w>",
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789,.!?'-"),
        show_progress=False,  # its progress prints blank lines off a terminal
    )
    bpe.train_from_iterator(TOKENIZER_TEXT, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # The trainer learns the same merges in the same order in every process, but numbers the tokens in the order of a
    # hash map it iterates, which Rust seeds per process: the ids are renumbered here, the special tokens, then the
    # tokens no merge makes (sorted), then each merge's token in merge order, so every clone builds one vocabulary.
    made = ["".join(m) for m in merges]
    first = sorted(set(model["vocab"]) - set(specials) - set(made))
    vocab = {token: i for i, token in enumerate([*specials, *first, *made])}
    assert len(vocab) == len(model["vocab"])
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    tokenizer.save_pretrained(out)
    return tokenizer


def make_t5_tokenizer(out: str | Path, *, vocab_size: int = 120, text: tuple[str, ...] = TOKENIZER_TEXT):
    """A T5Tokenizer (SentencePiece-style Unigram, T5's <pad>/</s>/<unk> at ids 0-2, no extra ids) on a Unigram
    model trained offline (the `tokenizers` library) on `text` (the digit captions). Saved to `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    unigram.train_from_iterator(text, trainer)
    # The trainer keeps the same pieces in every process, but their scores carry its threads' rounding (last digits)
    # and the pieces it must keep get scores stepped in a per-process hash order (1e-4 apart): the scores are rounded
    # to 3 decimals and the pieces ordered by score, then name, so every clone builds one vocabulary.
    pieces = [(piece, round(score, 3)) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]
    vocab = [p for p in pieces if p[0] in specials] + sorted(
        (p for p in pieces if p[0] not in specials), key=lambda p: (-p[1], p[0])
    )
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(out)
    return tokenizer


def make_sd3_pipeline(
    out: str | Path,
    *,
    sample_size: int = 8,
    patch_size: int = 2,
    num_layers: int = 4,
    attention_head_dim: int = 16,
    num_attention_heads: int = 4,
    joint_attention_dim: int = 32,
    clip_hidden: int = 16,
    text_length: int = 16,
    block_out_channels: tuple[int, ...] = (16, 32),
    shift: float = 3.0,
    seed: int = 0,
) -> Path:
    """A tiny StableDiffusion3Pipeline folder (`save_pretrained`, diffusers' and transformers' real classes), shaped
    like SD3 but about 3 MB, whose parts have learned something as a release's have: an SD3Transformer2DModel on
    `sample_size`^2 latents (random: the part the recipe trains; by default 4 layers 64 wide, which reads a 2x2
    patch of 16 latent channels -- 64 numbers -- without folding it into fewer), an SD3-style AutoencoderKL (16
    latent channels; it downsamples by 2^(len(block_out_channels)-1)) pretrained to reconstruct the digits, two
    CLIPTextModelWithProjection + CLIPTokenizer pairs (CLIP-L/G's roles) and a T5EncoderModel + T5Tokenizer
    (T5-XXL's role, width the transformer's joint_attention_dim, as in SD3) pretrained to tell the digits' words
    apart across phrasings, and a FlowMatchEulerDiscreteScheduler with SD3's shift. The pretrained parts come from
    data/tiny_pretrain.py (built in a minute or two the first time, then cached under data/cache/tiny_bases)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    out = Path(out)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=sample_size,
        patch_size=patch_size,
        in_channels=16,
        out_channels=16,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=joint_attention_dim,
        caption_projection_dim=attention_head_dim * num_attention_heads,
        pooled_projection_dim=2 * clip_hidden,
        pos_embed_max_size=sample_size // patch_size * 2,
    )
    vae = _latent_vae(block_out_channels)
    clips = [_clip_text(CLIPTextModelWithProjection, out, clip_hidden, text_length, seed + 1 + i) for i in range(2)]
    t5, t5_tokenizer = _t5_text(out, joint_attention_dim, seed + 3)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=vae,
        text_encoder=clips[0][0],
        tokenizer=clips[0][1],
        text_encoder_2=clips[1][0],
        tokenizer_2=clips[1][1],
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
    )
    with _no_progress_bars():
        pipe.save_pretrained(out)
    return out


def make_flux_pipeline(
    out: str | Path,
    *,
    num_layers: int = 1,
    num_single_layers: int = 1,
    attention_head_dim: int = 8,
    num_attention_heads: int = 2,
    joint_attention_dim: int = 32,
    clip_hidden: int = 16,
    text_length: int = 16,
    block_out_channels: tuple[int, ...] = (16, 32),
    guidance_embeds: bool = True,
    seed: int = 0,
) -> Path:
    """A tiny FluxPipeline folder (`save_pretrained`), shaped like FLUX.1 but about a megabyte: a random
    FluxTransformer2DModel on 2x2-packed latents (in_channels 64 = 16 latent channels x 4; `guidance_embeds`:
    FLUX.1-dev's guidance-distilled embedding, False: schnell's), the pretrained AutoencoderKL of
    make_sd3_pipeline (16 latent channels), a CLIPTextModel + CLIPTokenizer (CLIP-L's role: the pooled output), a
    T5EncoderModel + T5Tokenizer (T5-XXL's: the sequence, width joint_attention_dim), both pretrained as
    make_sd3_pipeline's, and FLUX.1-dev's
    FlowMatchEulerDiscreteScheduler (dynamic shifting; schnell's shift=1 without it when not `guidance_embeds`)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    out = Path(out)
    torch.manual_seed(seed)
    rope = attention_head_dim // 4  # RoPE's (text, row, column) axes: sum(axes_dims_rope) == attention_head_dim
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=joint_attention_dim,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(rope, rope, attention_head_dim - 2 * rope),
    )
    vae = _latent_vae(block_out_channels)
    clip, clip_tokenizer = _clip_text(CLIPTextModel, out, clip_hidden, text_length, seed + 1)
    t5, t5_tokenizer = _t5_text(out, joint_attention_dim, seed + 3)
    if guidance_embeds:  # black-forest-labs/FLUX.1-dev's scheduler_config.json
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    else:  # FLUX.1-schnell's
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
    )
    with _no_progress_bars():
        pipe.save_pretrained(out)
    return out


def make_wan_pipeline(
    out: str | Path,
    *,
    num_layers: int = 4,
    attention_head_dim: int = 32,
    num_attention_heads: int = 4,
    text_dim: int = 32,
    base_dim: int = 16,
    z_dim: int = 16,
    flow_shift: float = 3.0,
    pretrained: bool = False,
    seed: int = 0,
) -> Path:
    """A tiny WanPipeline folder (`save_pretrained`, diffusers' and transformers' real classes), shaped like Wan 2.1
    T2V but a few megabytes: a random WanTransformer3DModel (patch 1x2x2, `z_dim` latent channels), an
    AutoencoderKLWan that compresses time by 4 and space by 4 (Wan's compresses space by 8: two spatial stages
    rather than three keep 32-pixel frames at 8x8 latents), a UMT5EncoderModel + T5Tokenizer (umt5-xxl's role,
    `text_dim` wide) and Wan 2.1's UniPCMultistepScheduler (flow prediction, flow_shift 3.0, as the 480p release).
    `pretrained=True`: the VAE pretrained to reconstruct moving-digit clips and UMT5 to tell their digits and
    directions apart across phrasings (data/tiny_pretrain.py: several minutes once, then cached under
    data/cache/tiny_bases); by default both random, in seconds (the pretrained parts take minutes, too long for every
    README check; the demo learns on them: docs/video.md)."""
    import torch
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    out = Path(out)
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=z_dim,
        out_channels=z_dim,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=2 * attention_head_dim * num_attention_heads,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    if pretrained:
        vae = _wan_vae(base_dim, z_dim)
        text_encoder, tokenizer = _umt5_text(text_dim, seed + 3)
    else:
        vae = _wan_vae_model(base_dim, z_dim)
        tokenizer = make_t5_tokenizer(out / "tokenizer")
        text_encoder = _umt5_model(tokenizer, text_dim).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift
    )
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    with _no_progress_bars():
        pipe.save_pretrained(out)
    return out


def _wan_vae_config(base_dim: int, z_dim: int) -> dict:
    return dict(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
        scale_factor_spatial=4,
    )


def _wan_vae_model(base_dim: int, z_dim: int):
    """A random AutoencoderKLWan of make_wan_pipeline's shape."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**_wan_vae_config(base_dim, z_dim))


def _wan_vae(base_dim: int, z_dim: int):
    """make_wan_pipeline's AutoencoderKLWan pretrained to reconstruct moving-digit clips, with the latents_mean and
    latents_std its latents call for (data/tiny_pretrain.py; cached)."""
    from diffusers import AutoencoderKLWan

    from data import tiny_pretrain

    def build(folder: Path) -> None:
        import torch

        torch.manual_seed(0)
        vae = _wan_vae_model(base_dim, z_dim)
        report = tiny_pretrain.pretrain_wan_vae(vae)
        vae.save_pretrained(folder)
        (folder / "pretraining.json").write_text(json.dumps(report, indent=2))

    # The key holds the digits' size too: a VAE pretrained on other clips is not this one.
    settings = {**_wan_vae_config(base_dim, z_dim), "sprite_fraction": moving_digits.SPRITE_FRACTION}
    return AutoencoderKLWan.from_pretrained(tiny_pretrain.cached("wan-vae", settings, build))


def _umt5_model(tokenizer, width: int):
    """A random UMT5EncoderModel `width` wide (umt5-xxl's layout: gated-GELU, relative position buckets) on
    `tokenizer`'s vocabulary."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=8,
        d_ff=2 * width,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return UMT5EncoderModel(config)


def _umt5_text(width: int, seed: int, length: int = 32):
    """(a UMT5EncoderModel `width` wide pretrained to tell the moving digits' digits and directions apart across
    phrasings (data/tiny_pretrain.py; cached), its T5Tokenizer trained offline on the moving digits' captions),
    `length`: video_tiny's model.max_sequence_length."""
    from transformers import UMT5EncoderModel

    from data import tiny_pretrain

    def parts(folder: Path):
        tokenizer = make_t5_tokenizer(folder, text=MOTION_TOKENIZER_TEXT, vocab_size=160)
        return tokenizer, _umt5_model(tokenizer, width).config

    captions, labels = tiny_pretrain.motion_pretrain_captions()
    settings = {"width": width, "length": length, "seed": seed, "motion": MOTION_TOKENIZER_TEXT}
    texts = {"captions": captions, "labels": labels, "steps": 80}  # 80 full batches: every head right on every caption
    return _pretrained_text(UMT5EncoderModel, parts, settings, length, seed, "umt5", texts=texts)


def _latent_vae(block_out_channels: tuple[int, ...], latent_channels: int = 16):
    """An SD3/Flux-style AutoencoderKL (no quant convs) pretrained to reconstruct the digits, with the
    scaling_factor and shift_factor its latents call for (data/tiny_pretrain.py; cached)."""
    from diffusers import AutoencoderKL

    from data import tiny_pretrain

    n = len(block_out_channels)
    config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=tiny_pretrain.VAE_IMAGE_SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

    def build(folder: Path) -> None:
        import torch

        torch.manual_seed(0)
        vae = AutoencoderKL(**config)
        report = tiny_pretrain.pretrain_vae(vae)
        vae.save_pretrained(folder)
        (folder / "pretraining.json").write_text(json.dumps(report, indent=2))

    return AutoencoderKL.from_pretrained(tiny_pretrain.cached("vae", config, build))


def _clip_text(cls, out: Path, hidden: int, length: int, seed: int):
    """(a CLIP text encoder of class `cls` -- CLIPTextModel, CLIPTextModelWithProjection -- `hidden` wide, pretrained
    to tell the digits' words apart across phrasings (data/tiny_pretrain.py; cached), its CLIPTokenizer of `length`
    tokens) trained offline on the digit captions (make_clip_tokenizer)."""

    def parts(folder: Path):
        from transformers import CLIPTextConfig

        tokenizer = make_clip_tokenizer(folder, max_length=length)
        config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=length,
            projection_dim=hidden,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return tokenizer, config

    settings = {"class": cls.__name__, "hidden": hidden, "length": length, "seed": seed}
    return _pretrained_text(cls, parts, settings, length, seed, f"clip-{cls.__name__}")


def _pretrained_text(cls, parts, settings: dict, length: int, seed: int, part: str, texts: dict | None = None):
    """(a text encoder of class `cls`, random from `seed`, pretrained on the digits' words (data/tiny_pretrain.py
    pretrain_text), in eval mode; its tokenizer), both cached together: `parts(folder)` trains and saves the tokenizer
    there and returns it with the encoder's config. The tokenizer is cached with its encoder: an encoder is only right
    for the vocabulary it pretrained with (make_clip_tokenizer and make_t5_tokenizer number theirs alike in every
    process, where the `tokenizers` trainers alone gave three vocabularies in three processes). The cache
    key holds `settings`, the words the tokenizers learn (TOKENIZER_TEXT) and this module's builders' source."""
    import inspect

    import torch

    from data import tiny_pretrain

    def build(folder: Path) -> None:
        tokenizer, config = parts(folder / "tokenizer")
        torch.manual_seed(seed)
        encoder = cls(config)
        accuracy = tiny_pretrain.pretrain_text(encoder, tokenizer, length, seed=seed, **(texts or {}))
        with _no_progress_bars():
            encoder.save_pretrained(folder / "encoder")
        (folder / "pretraining.json").write_text(json.dumps({"accuracy": accuracy}))

    code = [inspect.getsource(f) for f in (parts, make_clip_tokenizer, make_t5_tokenizer, _umt5_model)]
    folder = tiny_pretrain.cached(part, {**settings, "text": TOKENIZER_TEXT, "code": code}, build)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    with _no_progress_bars():
        return cls.from_pretrained(folder / "encoder").eval(), tokenizer


def _t5_text(out: Path, width: int, seed: int, length: int = 32):
    """(a T5EncoderModel `width` wide pretrained to tell the digits' words apart across phrasings
    (data/tiny_pretrain.py; cached), its T5Tokenizer) trained offline on the digit captions."""
    from transformers import T5EncoderModel

    def parts(folder: Path):
        from transformers import T5Config

        tokenizer = make_t5_tokenizer(folder)
        config = T5Config(
            vocab_size=len(tokenizer),
            d_model=width,
            d_kv=8,
            d_ff=2 * width,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",  # T5 v1.1's, as in T5-XXL
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return tokenizer, config

    settings = {"width": width, "length": length, "seed": seed}
    return _pretrained_text(T5EncoderModel, parts, settings, length, seed, "t5")


def make_caption_folder(
    out: str | Path,
    *,
    per_digit: int = 16,
    digits: int = 10,
    size: int = 16,
    metadata: bool = False,
    bad: bool = True,
) -> Path:
    """A folder of captioned images, diffusers' ImageFolder layout: sklearn digits as `size`^2 RGB PNGs, each
    captioned in one of the training phrasings (common/data/digit_captions.py: "a handwritten seven", "the digit 7",
    ...; never a held-out one), in `name.txt` beside
    `name.png` or (`metadata`) one metadata.jsonl of {"file_name", "text"}. With `bad`: one file that is not an
    image, one image without a caption and one with an empty caption (prepare_captions skips and counts them)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    data = load_digits()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for d in range(digits):
        for i, row in enumerate(np.flatnonzero(data.target == d)[:per_digit]):
            name = f"{d}_{i:04d}.png"
            gray = Image.fromarray(np.rint(data.images[row] * 255 / 16).astype(np.uint8))
            gray.resize((size, size), Image.BILINEAR).convert("RGB").save(out / name)
            rows.append({"file_name": name, "text": digit_caption(d, i)})
    if bad:
        (out / "broken.png").write_bytes(b"this is not a PNG file")
        rows.append({"file_name": "broken.png", "text": "a broken file"})
        Image.new("RGB", (size, size)).save(out / "uncaptioned.png")
        Image.new("RGB", (size, size)).save(out / "empty_caption.png")
        rows.append({"file_name": "empty_caption.png", "text": "  "})
    if metadata:
        (out / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        for r in rows:
            (out / r["file_name"]).with_suffix(".txt").write_text(r["text"])
    return out


# Qwen2-VL / Qwen2.5-VL's released chat template (string content as is; OpenAI-style parts: an image or a video
# becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to one pad per merged patch).
# Qwen3-VL's release renders turns and images the same way but adds no default system turn (its tool-calling and
# thinking branches are left out here: the recipe's conversations use neither).
QWEN_VL_DEFAULT_SYSTEM = (
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
)
QWEN3_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_TEMPLATE = QWEN3_VL_TEMPLATE.replace(
    "{% for message in messages %}", "{% for message in messages %}" + QWEN_VL_DEFAULT_SYSTEM, 1
)
# Qwen2.5-VL's special tokens, in its order (<|endoftext|> is pad, <|im_end|> ends a turn).
QWEN_VL_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_VL_TEXT = (
    "You are a helpful assistant.",
    "system user assistant",
    "Describe the image.",
    "What digit is this?",
    "Compare the two pictures.",
    "What is two plus three?",
    "Five.",
    "A handwritten digit on a dark background.",
    "The first is wider than the second.",
    "zero one two three four five six seven eight nine 0123456789",
)


def train_byte_level_bpe(texts, *, split: str, specials, vocab_size: int):
    """A byte-level BPE (the `tokenizers` library) trained offline on `texts`: the `split` regex first (Llama 3's,
    Qwen2's), then bytes, as the released tokenizers pre-tokenize; `specials` first in the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def qwen_vl_tokenizer(vocab_size: int, chat_template: str):
    """A Qwen2Tokenizer (the Qwen-VL releases' class) with byte-level BPE trained offline on QWEN_VL_TEXT (the
    `tokenizers` library, Qwen2's own pre-tokenizer: its regex split, then bytes, so the trained merges are ones
    Qwen2Tokenizer applies), Qwen's special tokens and `chat_template`; and {special token: id}."""
    from tokenizers import normalizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = train_byte_level_bpe(QWEN_VL_TEXT, split=PRETOKENIZE_REGEX, specials=QWEN_VL_SPECIALS, vocab_size=vocab_size)
    bpe.normalizer = normalizers.NFC()
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_VL_SPECIALS[1:]),
        chat_template=chat_template,
    )
    return tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}


def _make_qwen_vl(
    out: str | Path,
    *,
    model: str,
    template: str,
    image_processor: dict,
    video_processor: dict | None,
    text_config: dict,
    vision_config: dict,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    seed: int,
) -> Path:
    """A random Qwen-VL release folder of transformers' ``model`` class (Qwen2_5_VL / Qwen3VL ForConditionalGeneration
    and its Config): a `qwen_vl_tokenizer` with ``template``, a Qwen2VLImageProcessor (PIL backend) of
    ``image_processor``'s keys, a video_preprocessor_config.json of ``video_processor``'s (None: none, as
    Qwen2.5-VL releases ship none) and a language model of 4 heads (2 key/value heads) unless ``text_config`` says
    otherwise: its keys add to (or replace) those, over ``vision_config``."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = qwen_vl_tokenizer(vocab_size, template)
    config = getattr(transformers, model.replace("ForConditionalGeneration", "Config"))(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        )
        | text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    with _no_progress_bars():
        getattr(transformers, model)(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(**image_processor).save_pretrained(out)
    if video_processor is not None:
        (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor, indent=2) + "\n")
    return out


def make_qwen2_5_vl(
    out: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 64,
    vocab_size: int = 400,
    seed: int = 0,
) -> Path:
    """A random Qwen2.5-VL release folder (~/models/Qwen2.5-VL-7B-Instruct's layout, `save_pretrained`): a tiny
    Qwen2_5_VLForConditionalGeneration (a `vision_depth`-block tower, patch 14, 2x2 spatial merge, window attention
    in all but its last block as the release has it; a `num_layers` Qwen2 language model with mRoPE), its
    Qwen2VLImageProcessor (PIL backend: smart_resize within `min_pixels`..`max_pixels`) and a Qwen2Tokenizer with
    byte-level BPE trained offline (`qwen_vl_tokenizer`) carrying Qwen's special tokens and chat template.

    No video processor config is saved, as the release ships none: transformers' Qwen2VLVideoProcessor then reads
    preprocessor_config.json (the image budget). It needs torchvision, which does not import under the training
    env's CPU torch (PyPI's is built on CUDA torch), so AutoProcessor loads the folder only in .venv-serve; in the
    training env the image processor and tokenizer load on their own (AutoImageProcessor, AutoTokenizer)."""
    half = hidden_size // 4 // 2  # rotary frequencies per head, split by mRoPE over (temporal, height, width) ...
    quarter = half // 4  # ... as the release's 16:24:24 of 64
    return _make_qwen_vl(
        out,
        model="Qwen2_5_VLForConditionalGeneration",
        template=QWEN_VL_TEMPLATE,
        image_processor=dict(min_pixels=min_pixels, max_pixels=max_pixels),
        video_processor=None,
        text_config=dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [quarter, (half - quarter) // 2, half - quarter - (half - quarter) // 2],
            },
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,  # the release's: 112 px = 4x4 merged patches per window
            out_hidden_size=hidden_size,
            fullatt_block_indexes=[vision_depth - 1],
        ),
        hidden_size=hidden_size,
        num_layers=num_layers,
        vocab_size=vocab_size,
        seed=seed,
    )


def make_qwen3_vl(
    out: str | Path,
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_layers: int = 3,
    vision_hidden: int = 32,
    vision_depth: int = 3,
    min_pixels: int = 32 * 32 * 4,
    max_pixels: int = 32 * 32 * 64,
    video_min_pixels: int = 32 * 32 * 4,
    video_max_pixels: int = 32 * 32 * 128,
    vocab_size: int = 400,
    seed: int = 0,
) -> Path:
    """A random Qwen3-VL release folder (~/models/Qwen3-VL-8B-Instruct's layout, `save_pretrained`): a tiny
    Qwen3VLForConditionalGeneration (a `vision_depth`-block tower, patch 16, 2x2 spatial merge, learned position
    embeddings resampled to each image's grid, DeepStack: the features of blocks 0 .. depth-2 merged and added after
    the first language layers at the image tokens; a `num_layers` Qwen3 language model of `num_heads` heads (2 of
    them key/value heads) with interleaved mRoPE), its Qwen2VLImageProcessor (the release's class: PIL backend, 32 px
    units within `min_pixels`..`max_pixels`, mean/std 0.5), `qwen_vl_tokenizer` with Qwen3-VL's chat template (no
    default system turn), and the release's video_preprocessor_config.json (Qwen3VLVideoProcessor, 2 fps, 4..768 frames)
    with its own budget over the clip, `video_min_pixels`..`video_max_pixels`: not the images' (the release's
    4096..25165824 against 65536..16777216)."""
    half = hidden_size // num_heads // 2  # rotary frequencies per head, interleaved over (t, h, w) ...
    hw = half // 4  # ... as the release's 24:20:20 of 64
    pixels = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return _make_qwen_vl(
        out,
        model="Qwen3VLForConditionalGeneration",
        template=QWEN3_VL_TEMPLATE,
        image_processor=dict(min_pixels=min_pixels, max_pixels=max_pixels, **pixels),
        video_processor=dict(
            video_processor_type="Qwen3VLVideoProcessor",
            processor_class="Qwen3VLProcessor",
            size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels},
            fps=2,
            min_frames=4,
            max_frames=768,
            do_sample_frames=True,
            resample=3,
            rescale_factor=1 / 255,
            **pixels,
        ),
        text_config=dict(
            num_attention_heads=num_heads,
            head_dim=hidden_size // num_heads,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [half - 2 * hw, hw, hw],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=hidden_size,
            num_position_embeddings=64,  # an 8x8 learned grid (the release's: 48x48)
            # Fewer than the language layers, as released (3 of 36): a feature added after the last layer would
            # reach no label (causal attention), and ZeRO expects a gradient for every trainable parameter.
            deepstack_visual_indexes=list(range(min(vision_depth, num_layers) - 1)),
        ),
        hidden_size=hidden_size,
        num_layers=num_layers,
        vocab_size=vocab_size,
        seed=seed,
    )


def _write_mp4(path: Path, frames, fps: int) -> None:
    """uint8 [F, H, W, 3] frames as an H.264 MP4 in yuv420p, as a camera or a download gives them (lossy)."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


def make_clip_folder(
    out: str | Path,
    n: int = 24,
    num_frames: int = 9,
    size: int = 32,
    seed: int = 0,
    *,
    metadata: str | None = None,
    bad: bool = True,
) -> Path:
    """A folder of captioned clips, as a user brings for data.prepare_videos (~/data/clips): `n` moving digits
    (common/data/moving_digits.py, captioned in its training phrasings) as H.264 MP4s (yuv420p), half of them in a
    subfolder; every fourth (from the second) 3:2 landscape, every fourth (from the third) at 32 fps with 2F-1 frames,
    the others size x size at 16 fps with F = `num_frames`; and one frame folder (PNG frames at 32 fps, its fps.txt,
    and its caption beside it). Captions in `name.txt` beside each clip, or (`metadata` "jsonl" or "csv") one
    metadata.jsonl / metadata.csv of file_name,text rows. With `bad`: a corrupt .mp4, a clip without a caption and
    one too short for `num_frames` at 16 fps (prepare_videos skips and counts them)."""
    import csv
    import io

    from PIL import Image

    from common.data.moving_digits import moving_digit_clip

    out = Path(out)
    (out / "more").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        fast, wide = i % 4 == 2, i % 4 == 1
        frames = 2 * num_frames - 1 if fast else num_frames
        clip, caption, _, _ = moving_digit_clip(i, frames, size, size * 3 // 2 if wide else size, seed)
        name = f"{'more/' if i >= n // 2 else ''}clip_{i:03d}.mp4"
        _write_mp4(out / name, clip, 32 if fast else 16)
        rows.append({"file_name": name, "text": caption})
    clip, caption, _, _ = moving_digit_clip(n, 2 * num_frames - 1, size, size, seed)
    (out / "frames_0").mkdir(exist_ok=True)
    for f, frame in enumerate(clip):
        Image.fromarray(frame).save(out / "frames_0" / f"{f:04d}.png")
    (out / "frames_0" / "fps.txt").write_text("32\n")
    rows.append({"file_name": "frames_0", "text": caption})
    if bad:
        (out / "broken.mp4").write_bytes(b"this is not a video file")
        rows.append({"file_name": "broken.mp4", "text": "a broken file"})
        _write_mp4(out / "uncaptioned.mp4", moving_digit_clip(n + 1, num_frames, size, size, seed)[0], 16)
        short, caption, _, _ = moving_digit_clip(n + 2, max(2, num_frames // 2), size, size, seed)
        _write_mp4(out / "short.mp4", short, 16)
        rows.append({"file_name": "short.mp4", "text": caption})
    if metadata == "jsonl":
        (out / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif metadata == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=["file_name", "text"])
        writer.writeheader()
        writer.writerows(rows)
        (out / "metadata.csv").write_text(buf.getvalue())
    else:
        for r in rows:
            (out / r["file_name"]).with_suffix(".txt").write_text(r["text"])
    return out
