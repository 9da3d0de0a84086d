"""Text-to-video (video_tiny on a tiny random WanPipeline, data/tiny_bases.py make_wan_pipeline, and moving-digit
shards, python -m data.prepare_videos --moving-digits): the latent cache against the frozen encoders on the fly, and
Ulysses context parallelism (parallel.cp=2) against one rank.

cache: scripts/train.py in a subprocess per variant (harness.train_run, the launch path of every run), runs
alternating as t2i's (scripts/benchmarks/t2i.py: alternate, compare), the same clips, steps and seed: (a) data.root =
the clip shards (the AutoencoderKLWan encoder and UMT5 run every step, frozen) and (b) data.latents = python -m
data.cache_latents' cache of them (the posterior's moments and the prompt embeddings, read). Step time from each run's
metrics.jsonl, and the on-the-fly runs' data wait (data_wait_s / step_time_s: the loader decoding clips).

cp: video_tiny's trainer built in-process on 1 and on 2 gloo ranks (scripts/kiln/processes.py spawn_ranks, as the cp
section does for the LLM), on the cache, the same batches: video tokens/s (clips per step x the clip's tokens over
the step time; cp=2: the slower rank's) and the bytes one forward + loss keeps for backward on each rank (measured:
common/activations.py, as the ac and cp sections), beside the memory model's (common/memory.py) activation bytes per
rank at cp=2 over cp=1 for the Wan 2.1 presets' clips, where the prompt's tokens and what sits outside the blocks are
a vanishing share. On CPU the exchange is a gloo copy between two processes on shared cores: tokens/s is an
accounting check there, not what cp buys on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scripts.benchmarks.harness import fresh_dir, quiet
from scripts.benchmarks.report import Section, Target, md_table, median, mib, ms, say
from scripts.benchmarks.t2i import WARMUP, alternate, compare, data_wait, prepare

TARGET_CACHE = 1.5  # on-the-fly step time over the cached one, at least
TARGET_ACTIVATIONS = 0.6  # cp=2 keeps at most this share of cp=1's activation bytes per rank
TARGET_DATA_WAIT = 0.02  # data wait / step time on the fly, at most
CP = 2
FLY, CACHED = "on-the-fly VAE + UMT5", "cached latents + embeddings"
PRESETS = ("wan2_1_1_3b", "wan2_1_14b")


@dataclass(frozen=True)
class Config:
    clips: int = 96  # moving-digit clips built (train + val)
    size: int = 64  # their sides: 9 frames of size x size, (9-1)/4+1 x (size/4/2)^2 video tokens on the tiny VAE
    micro_batch_size: int = 4  # clips a step (video_tiny's own 32 would make the on-the-fly runs take minutes)
    steps: int = 24  # per cache run (the first WARMUP left out)
    rounds: int = 2  # cache runs per variant, alternating
    cp_steps: int = 8  # timed in-process steps per cp layout
    cp_warmup: int = 1


QUICK = Config(clips=48, size=32, micro_batch_size=4, steps=10, rounds=1, cp_steps=3)


def build_data(opts, cfg: Config, work: Path, pipeline: Path) -> tuple[list[str], Path]:
    """(the data overrides of the clip shards, the folder of their latent cache), both built here."""
    from data import cache_latents, prepare_videos

    shards, latents = work / "shards", work / "latents"
    size = str(cfg.size)
    argv = ["--moving-digits", "--clips", str(cfg.clips), "--num-frames", "9", "--height", size, "--width", size]
    data = [f"model.init_from={pipeline}", f"data.root={shards}", "data.build=[]", f"data.height={size}"]
    data.append(f"data.width={size}")
    with quiet(opts.log):
        prepare([*argv, "--out", str(shards), "--force"], prepare_videos)
        prepare(["recipe=video_tiny", *data, "--out", str(latents), "--batch-size", "8", "--force"], cache_latents)
    return data, latents


def cache(opts, s: Section, cfg: Config, data: list[str], latents: Path) -> None:
    work = opts.work / "video_cache"
    common = [*data, f"trainer.micro_batch_size={cfg.micro_batch_size}", f"trainer.max_steps={cfg.steps}"]
    common += ["trainer.log_every=1", "profile.count_flops=false"]
    say(f"video: cache, {cfg.rounds} x {cfg.steps} steps each, runs alternating")
    variants = {FLY: [], CACHED: [f"data.latents={latents}"]}
    records = alternate(opts, common, variants, work, cfg.rounds, recipe="video_tiny")
    where = f"{cfg.micro_batch_size} clips of 9 x {cfg.size}x{cfg.size} a step, one process, {opts.threads} thread(s)"
    cache_report(s, records, where=where)


def cache_report(s: Section, records: dict[str, list[list[dict]]], *, where: str) -> None:
    """The cache table, targets and notes from each variant's metrics.jsonl records per round."""
    step = compare(records, "step_time_s", fast="low")
    wait = {name: data_wait(runs) for name, runs in records.items()}
    rows = [
        [
            name,
            ms(step["median"][name]),
            ms(step["quiet"][name]),
            f"{wait[name]:.2%}",
            f"{step['ratio']:.2f}x / {step['quiet_ratio']:.2f}x" if name == FLY else "1.00x",
        ]
        for name in records
    ]
    headers = ["video_tiny inputs", "step_time_s median (ms)", "p10 (ms)", "data wait", "step time vs cached"]
    s.tables.append(md_table([*headers[:-1], f"{headers[-1]} (median / p10)"], rows))
    s.targets.append(
        Target(
            f"cache: on-the-fly / cached step time >= {TARGET_CACHE}x",
            f"{step['ratio']:.2f}x",
            step["ratio"] >= TARGET_CACHE,
        )
    )
    s.targets.append(
        Target(f"data wait on the fly <= {TARGET_DATA_WAIT:.0%}", f"{wait[FLY]:.2%}", wait[FLY] <= TARGET_DATA_WAIT)
    )
    s.notes.append(
        f"cache: on-the-fly / cached step time {step['ratio']:.2f}x (median of the rounds' ratios: "
        f"{', '.join(f'{x:.2f}x' for x in step['rounds'])}), {step['quiet_ratio']:.2f}x at the 10th percentile; "
        f"{len(step['rounds'])} round(s) of one run each, steps after {WARMUP}; {where}. The on-the-fly run encodes "
        "each batch's clips with the VAE and its captions with UMT5; the cached one reads their outputs. data wait: "
        "data_wait_s / step_time_s over the steady steps (the loader decoding the clips)."
    )
    s.data["cache"] = {
        "step_time_ratio": step["ratio"],
        "round_ratios": step["rounds"],
        "median_step_s": step["median"],
        "p10_step_s": step["quiet"],
        "data_wait": wait,
    }


def _cp_layout(opts, cp: int, overrides: list[str], cfg: Config) -> dict:
    """One rank of video_tiny at parallel.cp=cp on the cache: the bytes one forward + loss keeps for backward, the
    timed steps after the warm-up, the clips each step trained (global) and the tokens of a clip."""
    import torch.distributed as tdist

    from recipes.registry import recipe_spec
    from scripts.benchmarks.ac import saved_bytes
    from scripts.benchmarks.harness import build_trainer, step_timer, take, timed_step

    rank = tdist.get_rank()
    trainer = build_trainer(opts, "video_tiny", [f"parallel.cp={cp}", *overrides], opts.work / f"video_cp{cp}_{rank}")
    tokens = recipe_spec("video").sizing().memory_spec(trainer.cfg).seq
    batches, timer = take(trainer, cfg.cp_warmup + cfg.cp_steps), step_timer()
    kept = saved_bytes(trainer, batches[0])
    times, clips = [], []
    for i, batch in enumerate(batches):
        seconds, stats, _ = timed_step(trainer, batch, timer)
        if i >= cfg.cp_warmup:
            times.append(seconds)
            clips.append(int(stats.samples))
    return {"rank": rank, "saved_bytes": kept, "step_s": times, "clips": clips, "tokens_per_clip": tokens}


def modelled_cp_share(preset: str) -> float:
    """The memory model's activation bytes per rank at cp=2 over cp=1 for a preset's clip, at its AC, one clip."""
    from common.memory import Layout, estimate
    from recipes.registry import recipe_spec
    from scripts.kiln.launch import compose

    cfg = compose([f"recipe={preset}", "run.dry_run=true"])
    spec = recipe_spec("video").sizing().memory_spec(cfg)
    ac = cfg.toggles.activation_checkpointing
    one, two = (estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac=ac, cp=cp))["activations"] for cp in (1, CP))
    return two / one


def context_parallel(opts, s: Section, cfg: Config, data: list[str], latents: Path) -> None:
    from scripts.kiln.processes import spawn_ranks

    overrides = [*data, f"data.latents={latents}", f"trainer.micro_batch_size={cfg.micro_batch_size}"]
    results = {}
    for cp in (1, CP):
        say(f"video: cp={cp} on {cp} rank(s), {cfg.cp_warmup}+{cfg.cp_steps} steps on the cache")
        work = fresh_dir(opts.work / f"video_cp{cp}_results")
        results[cp] = spawn_ranks(_cp_layout, (opts, cp, overrides, cfg), cp, work, opts.threads)
    cp_report(s, results, where=f"{cfg.micro_batch_size} clips of 9 x {cfg.size}x{cfg.size} a step")


def cp_report(s: Section, results: dict[int, list[dict]], *, where: str) -> None:
    """The cp table, target and notes from each layout's ranks (cp -> _cp_layout's results)."""
    one = results[1][0]
    rows, worst, rates = [], 0.0, {}
    for cp, ranks in results.items():
        step = [max(per_rank) for per_rank in zip(*(r["step_s"] for r in ranks))]  # the slower rank's
        rates[cp] = median(n * one["tokens_per_clip"] / dt for n, dt in zip(ranks[0]["clips"], step))
        for r in ranks:
            share = r["saved_bytes"] / one["saved_bytes"]
            worst = max(worst, share) if cp > 1 else worst
            rows.append(
                [f"cp={cp}", r["rank"], ms(median(step)), f"{rates[cp]:,.0f}", f"{rates[cp] / rates[1]:.2f}x"]
                + [mib(r["saved_bytes"]), f"{share:.2f}"]
            )
    headers = ["layout", "rank", "step ms (median)", "video tokens/s", "vs cp=1", "kept for backward", "vs cp=1"]
    s.tables.append(md_table(headers, rows))
    modelled = {preset: modelled_cp_share(preset) for preset in PRESETS}
    s.tables.append(
        md_table(
            ["preset (memory model)", f"activations per rank, cp={CP} / cp=1"],
            [[preset, f"{share:.3f}"] for preset, share in modelled.items()],
        )
    )
    s.targets.append(
        Target(
            f"cp={CP} keeps <= {TARGET_ACTIVATIONS:.0%} of cp=1's activation bytes per rank",
            f"{worst:.2f} measured on video_tiny (worst rank); "
            + ", ".join(f"{p} {x:.2f} modelled" for p, x in modelled.items()),
            worst <= TARGET_ACTIVATIONS,
        )
    )
    s.notes.append(
        f"cp: video_tiny's trainer in-process on the cache, {where}, {len(one['step_s'])} timed steps after the "
        f"warm-up; video tokens/s = clips a step x {one['tokens_per_clip']} tokens a clip over the step time (cp={CP}: "
        "the slower rank's; the cp ranks train the same clips). kept for backward: the storages one forward + loss "
        "creates and keeps (weights and batch excluded; the prompt embeddings, the patch embedding and the gathered "
        "output are whole on every cp rank). Presets: common/memory.py's activations at cp=1 and cp=2, one clip, the "
        "preset's AC (its prompt's 512 tokens stay whole; it leaves out what sits outside the blocks)."
    )
    s.data["cp"] = {"ranks": results, "tokens_per_s": rates, "worst_share": worst, "modelled_share": modelled}


def run(opts, cfg: Config | None = None) -> Section:
    from data.tiny_bases import make_wan_pipeline

    cfg = cfg or opts.pick(Config(), QUICK)
    s = Section("video", "Text-to-video: cached vs on-the-fly VAE and UMT5; Ulysses cp=2 vs one rank")
    work = fresh_dir(opts.work / "video")
    say(f"video: a tiny WanPipeline, {cfg.clips} moving-digit clips of 9 x {cfg.size}x{cfg.size} and their cache")
    with quiet(opts.log):
        pipeline = make_wan_pipeline(work / "wan")
    data, latents = build_data(opts, cfg, work, pipeline)
    cache(opts, s, cfg, data, latents)
    context_parallel(opts, s, cfg, data, latents)
    return s
