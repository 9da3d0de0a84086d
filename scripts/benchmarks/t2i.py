"""Text-to-image (t2i_tiny on a tiny random StableDiffusion3Pipeline, built offline): training on the cache of the
frozen encoders' outputs vs running the text encoders and the VAE on the fly, and aspect-ratio buckets vs
square center crops on images of mixed aspect ratios.

Each variant is scripts/train.py in a subprocess (harness.train_run, the launch path of every run) and its numbers
are its own metrics.jsonl (trainer.log_every=1): step_time_s and samples_per_s of the steps after WARMUP. The
variants' runs alternate (A B, then B A, ...), so load from other jobs on a shared machine falls on both alike.

cache: the same captioned digits, the same steps and seed, (a) data.root = the caption shards (the two CLIPs, the
T5 and the VAE encoder run every step, frozen) and (b) data.latents = python -m data.cache_latents' cache of them
(the VAE posterior's moments and the prompt embeddings, read). Both draw the same latents and noise, so their
losses agree (printed as a check).

buckets: one folder of images of 1:2, 1:1 and 2:1 (width:height), converted twice by python -m data.prepare_captions
at the same --image-size: square (resized and center-cropped to image_size^2) and --buckets (each image to cover
its nearest-ratio bucket of about image_size^2 pixels, data.buckets=true: every batch one bucket's). Throughput is
training images/s; the share of each source image's pixels that the crop keeps is computed from the image sizes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, quiet, train_run
from scripts.benchmarks.report import Section, md_table, median, ms, say

IMAGE_SIZE = 16  # t2i_tiny's data.image_size
WARMUP = 5  # steps left out of the medians: the first step's allocations, the loader worker's start
# The buckets' source images, (width, height): portrait 1:2, square, landscape 2:1, larger than the buckets.
SOURCE_SIZES = ((32, 64), (48, 48), (64, 32))


def pick_run(opts) -> dict:
    return {"steps": opts.pick(80, 20), "rounds": opts.pick(3, 1)}


def alternate(
    opts, common: list[str], variants: dict[str, list[str]], run_dir: Path, rounds: int, recipe: str = "t2i_tiny"
) -> dict[str, list]:
    """Each variant's runs of `recipe` (common + its overrides), alternating which goes first each round: name -> one
    metrics.jsonl's records per round."""
    names, out = list(variants), {name: [] for name in variants}
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            slug = name.split(" ")[0]
            out[name].append(train_run(opts, recipe, [*common, *variants[name]], run_dir / f"{slug}_{r}"))
    return out


def steady(run: list[dict], key: str) -> list[float]:
    """`key` of a run's logged steps after WARMUP."""
    return [r[key] for r in run if r["step"] > WARMUP and key in r]


def compare(records: dict[str, list], key: str, *, fast: str) -> dict:
    """Per variant the median of `key` over all its runs' steady steps, and the first variant's over the second's as
    the median of per-round ratios (the two runs of a round ran next to each other in time), with every round's.
    `quiet`: per variant the decile of the steps least slowed by other jobs (fast="low": the 10th percentile, a
    step time; "high": the 90th, a rate), and its ratio: on a shared machine the median moves with the load."""
    runs_a, runs_b = records.values()
    pooled = {name: [v for run in runs for v in steady(run, key)] for name, runs in records.items()}
    rounds = [median(steady(x, key)) / median(steady(y, key)) for x, y in zip(runs_a, runs_b, strict=True)]
    quiet = {name: statistics.quantiles(v, n=10)[0 if fast == "low" else -1] for name, v in pooled.items()}
    a, b = quiet.values()
    return {
        "median": {name: median(v) for name, v in pooled.items()},
        "ratio": median(rounds),
        "rounds": rounds,
        "quiet": quiet,
        "quiet_ratio": a / b,
    }


def data_wait(runs: list[list[dict]]) -> float:
    """The share of step time spent waiting for the loader, over a variant's steady steps."""
    steps = [r for run in runs for r in run if r["step"] > WARMUP]
    return sum(r["data_wait_s"] for r in steps) / sum(r["step_time_s"] for r in steps)


def prepare(argv: list[str], module) -> None:
    """A data CLI's main(argv) in this process (as the DiT section runs them); its output goes to the bench log."""
    if module.main(argv):
        raise RuntimeError(f"python -m {module.__name__} {' '.join(argv)} failed (its output is in the bench log)")


def caption_shards(opts, folder: Path, out: Path, extra: list[str] = ()) -> Path:
    from data import prepare_captions

    argv = ["--input", str(folder), "--out", str(out), "--image-size", str(IMAGE_SIZE), "--train-shards", "2"]
    argv += ["--val-shards", "1", "--val-fraction", "0.1", "--force", *extra]
    with quiet(opts.log):
        prepare(argv, prepare_captions)
    return out


def write_shaped_folder(root: Path, per_size: int) -> Path:
    """`per_size` captioned images of each SOURCE_SIZES shape: smooth random colour fields (PNGs of plain noise
    would make decoding, not training, what the loader spends its time on)."""
    import numpy as np
    from PIL import Image

    fresh_dir(root)
    rng = np.random.default_rng(0)
    for i in range(per_size):
        for w, h in SOURCE_SIZES:
            corners = rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)
            image = Image.fromarray(corners).resize((w, h), Image.BILINEAR)
            name = f"{w}x{h}_{i:04d}"
            image.save(root / f"{name}.png")
            (root / f"{name}.txt").write_text(f"a colour field {i}, {w} by {h}")
    return root


# ---- cached vs on-the-fly text embeddings and latents ----------------------------------------------------------
FLY, CACHED = "on-the-fly encoders + VAE", "cached embeddings + latents"


def cache(opts, s: Section, pipeline: Path) -> None:
    from data import cache_latents
    from data.tiny_bases import make_caption_folder
    from scripts.kiln.launch import compose

    work, run = opts.work / "t2i_cache", pick_run(opts)
    say(f"t2i: cache, captioned digits at {IMAGE_SIZE}px, building shards and the encoders' cache")
    folder = make_caption_folder(fresh_dir(work) / "captioned", per_digit=opts.pick(16, 8), size=8, bad=False)
    shards, latents = caption_shards(opts, folder, work / "shards"), work / "latents"
    data = [f"model.init_from={pipeline}", f"data.root={shards}", "data.build=[]"]
    with quiet(opts.log):
        prepare(["recipe=t2i_tiny", *data, "--out", str(latents), "--batch-size", "16", "--force"], cache_latents)
    common = [*data, f"trainer.max_steps={run['steps']}", "trainer.log_every=1", "profile.count_flops=false"]
    say(f"t2i: cache, {run['rounds']} x {run['steps']} steps each, runs alternating")
    records = alternate(opts, common, {FLY: [], CACHED: [f"data.latents={latents}"]}, work, run["rounds"])
    cfg = compose(["recipe=t2i_tiny"])
    where = f"{cfg.trainer.micro_batch_size} images a step, one process, {opts.threads} torch thread(s)"
    cache_report(s, records, max_sequence_length=cfg.model.max_sequence_length, where=where)


def cache_report(s: Section, records: dict[str, list[list[dict]]], *, max_sequence_length: int, where: str) -> None:
    """The cache table and notes from each variant's metrics.jsonl records per round ({FLY: [...], CACHED: [...]})."""
    step, rate = compare(records, "step_time_s", fast="low"), compare(records, "samples_per_s", fast="high")
    # Same seed, same samples: the first round's losses step by step (the cache stores what the encoders gave).
    loss_diff = max(
        abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records[FLY][0], records[CACHED][0], strict=True)
    )
    rows = [
        [
            name,
            ms(step["median"][name]),
            ms(step["quiet"][name]),
            f"{rate['median'][name]:.0f}",
            f"{data_wait(records[name]):.1%}",
            f"{step['ratio']:.2f}x / {step['quiet_ratio']:.2f}x" if name == FLY else "1.00x",
        ]
        for name in records
    ]
    headers = ["t2i_tiny inputs", "step_time_s median (ms)", "p10 (ms)", "images/s median", "data wait"]
    s.tables.append(md_table([*headers, "step time vs cached (median / p10)"], rows))
    s.notes += [
        f"cache: on-the-fly / cached step time {step['ratio']:.2f}x (median of the rounds' ratios: "
        f"{', '.join(f'{x:.2f}x' for x in step['rounds'])}), {step['quiet_ratio']:.2f}x at the 10th percentile (the "
        f"steps other jobs slowed least); {len(step['rounds'])} round(s) of one run each, steps after {WARMUP}; "
        f"{where}. The on-the-fly run encodes each batch's captions with both CLIPs and the T5 "
        f"(model.max_sequence_length={max_sequence_length}) and its images with the VAE; the cached one reads their "
        f"outputs. Per-step losses of the two agree to {loss_diff:.1e} (relative).",
    ]
    s.data["cache"] = {
        "step_time_ratio": step["ratio"],
        "round_ratios": step["rounds"],
        "p10_step_s": step["quiet"],
        "p10_step_time_ratio": step["quiet_ratio"],
        "median_step_s": step["median"],
        "median_images_per_s": rate["median"],
        "max_loss_rel_diff": loss_diff,
    }


# ---- aspect-ratio buckets vs square center crops --------------------------------------------------------------
BUCKETED, SQUARE = "bucketed", "square (center crop)"


def kept_share(width: int, height: int, shape: tuple[int, int]) -> float:
    """The share of a width x height image's pixels that survive resizing it to cover `shape` and center-cropping:
    the crop keeps the narrower of the two aspect ratios' extents, so min(r, R) / max(r, R) of the image."""
    r, target = width / height, shape[0] / shape[1]
    return min(r, target) / max(r, target)


def buckets(opts, s: Section, pipeline: Path) -> None:
    from recipes.t2i.weights import transformer_config, vae_factor
    from scripts.kiln.launch import compose

    work, run = opts.work / "t2i_buckets", pick_run(opts)
    multiple = vae_factor(pipeline) * transformer_config(pipeline)["patch_size"]  # the bucket sides the model takes
    per_size = opts.pick(48, 24)
    say(f"t2i: buckets, {per_size} images each of {', '.join(f'{w}x{h}' for w, h in SOURCE_SIZES)}: building shards")
    folder = write_shaped_folder(work / "images", per_size)
    square = caption_shards(opts, folder, work / "square")
    bucketed = caption_shards(opts, folder, work / "bucketed", ["--buckets", "--bucket-multiple", str(multiple)])
    common = [f"model.init_from={pipeline}", "data.build=[]", f"trainer.max_steps={run['steps']}"]
    common += ["trainer.log_every=1", "profile.count_flops=false"]
    # bucketed first: compare() divides the first variant's numbers by the second's
    variants = {BUCKETED: [f"data.root={bucketed}", "data.buckets=true"], SQUARE: [f"data.root={square}"]}
    say(f"t2i: buckets, {run['rounds']} x {run['steps']} steps each, runs alternating")
    records = alternate(opts, common, variants, work, run["rounds"])
    meta = json.loads((bucketed / "meta.json").read_text())["buckets"]
    where = (
        f"--image-size {IMAGE_SIZE}, --bucket-multiple {multiple} (the pipeline's VAE factor x patch); "
        f"{compose(['recipe=t2i_tiny']).trainer.micro_batch_size} images a step, one process, {opts.threads} torch "
        "thread(s)"
    )
    buckets_report(s, records, meta, where=where)


def buckets_report(s: Section, records: dict[str, list[list[dict]]], meta: dict, *, where: str) -> None:
    """The buckets table and notes from each variant's metrics.jsonl records per round ({BUCKETED: [...], SQUARE:
    [...]}) and the bucketed shards' meta.json "buckets" (their shapes and training images per bucket)."""
    from data.prepare_captions import nearest_bucket

    rate, step = compare(records, "samples_per_s", fast="high"), compare(records, "step_time_s", fast="low")
    shapes = [tuple(x) for x in meta["shapes"]]
    # Pixels a training image carries: image_size^2 square; under buckets its bucket's, averaged over the training
    # images (meta.json's samples per bucket; a step's batch is one bucket's, which metrics.jsonl does not name).
    counts = {tuple(int(x) for x in k.split("x")): n for k, n in meta["samples"]["train"].items() if n}
    pixels = {
        BUCKETED: sum(w * h * n for (w, h), n in counts.items()) / sum(counts.values()),
        SQUARE: IMAGE_SIZE**2,
    }
    # Of each source image, the share the crop keeps: all SOURCE_SIZES come in equal numbers.
    kept = {
        BUCKETED: [kept_share(w, h, nearest_bucket(w, h, shapes)) for w, h in SOURCE_SIZES],
        SQUARE: [kept_share(w, h, (1, 1)) for w, h in SOURCE_SIZES],
    }
    mean_kept = {name: sum(k) / len(k) for name, k in kept.items()}
    rows = [
        [
            name,
            f"{rate['median'][name]:.0f}",
            f"{rate['quiet'][name]:.0f}",
            f"{rate['ratio']:.2f}x / {rate['quiet_ratio']:.2f}x" if name == BUCKETED else "1.00x",
            ms(step["median"][name]),
            f"{data_wait(records[name]):.1%}",
            f"{pixels[name]:.0f}",
            f"{rate['median'][name] * pixels[name] / 1e3:.1f}",
            f"{mean_kept[name]:.1%}",
            " / ".join(f"{k:.0%}" for k in kept[name]),
        ]
        for name in records
    ]
    s.tables.append(
        md_table(
            [
                "shards",
                "images/s median",
                "p90",
                "vs square (median / p90)",
                "step_time_s median (ms)",
                "data wait",
                "pixels per training image",
                "kpixels/s",
                "source pixels kept",
                f"kept of {' / '.join(f'{w}x{h}' for w, h in SOURCE_SIZES)}",
            ],
            rows,
        )
    )
    s.notes += [
        f"buckets: bucketed / square training images/s {rate['ratio']:.2f}x (metrics.jsonl samples_per_s; median of "
        f"the rounds' ratios: {', '.join(f'{x:.2f}x' for x in rate['rounds'])}), {rate['quiet_ratio']:.2f}x at the "
        f"90th percentile (the steps other jobs slowed least); {len(rate['rounds'])} round(s) of one run each, steps "
        f"after {WARMUP}; {where}. kpixels/s = images/s x the mean pixels per training image "
        f"(training images per bucket: {', '.join(f'{w}x{h} {n}' for (w, h), n in counts.items())}).",
        "source pixels kept: the share of each source image inside the crop (a w x h image resized to cover a bucket "
        "of aspect R and center-cropped keeps min(w/h, R) / max(w/h, R) of itself; the square crop is R = 1), mean "
        "over the source images.",
    ]
    s.data["buckets"] = {
        "images_per_s_ratio": rate["ratio"],
        "round_ratios": rate["rounds"],
        "p90_images_per_s": rate["quiet"],
        "p90_images_per_s_ratio": rate["quiet_ratio"],
        "median_images_per_s": rate["median"],
        "median_step_s": step["median"],
        "pixels_per_image": pixels,
        "kept_share": kept,
        "mean_kept_share": mean_kept,
        "train_per_bucket": meta["samples"]["train"],
    }


def run(opts) -> Section:
    from data.tiny_bases import make_sd3_pipeline

    s = Section("t2i", "Text-to-image: cached vs on-the-fly embeddings and latents; bucketed vs square-cropped")
    with quiet(opts.log):
        # The transformer at the tests' shape (2 layers x 16 wide), the one this section's recorded figures measured;
        # the demo's default is 4 x 64 (docs/text-to-image.md).
        pipeline = make_sd3_pipeline(
            fresh_dir(opts.work / "t2i_sd3"), num_layers=2, attention_head_dim=8, num_attention_heads=2
        )
    cache(opts, s, pipeline)
    buckets(opts, s, pipeline)
    return s
