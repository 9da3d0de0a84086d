"""scripts/bench.py's sections are modules of scripts/benchmarks/ whose `run(opts)` returns a report.Section of
structured data: targets with `met` booleans and raw numbers, no printed text to parse. The cheap ones run here
on tiny settings; tests/integration/test_bench.py runs overhead and ac in their quick mode."""

from __future__ import annotations

import inspect

import pytest

from scripts.bench import SECTIONS
from scripts.benchmarks import checkpoint, loading, lora, packing, pipeline
from scripts.benchmarks.harness import Options
from scripts.benchmarks.report import Section


def check(section: Section, name: str) -> None:
    assert isinstance(section, Section) and section.name == name and not section.error
    assert section.tables and all(table.startswith("| ") for table in section.tables)
    assert all(isinstance(t.met, bool) for t in section.targets)
    assert section.data


def test_every_section_is_a_benchmarks_module_run():
    for name, run in SECTIONS.items():
        assert run.__name__ == "run" and run.__module__.startswith("scripts.benchmarks."), name
        assert list(inspect.signature(run).parameters)[0] == "opts", name


def test_packing_section(tmp_path):
    cfg = packing.Config(steps=1, warmup=1, max_seq_len=64, samples_per_step=8, median_len=16, hidden=32, vocab=64)
    s = packing.run(Options(quick=True, threads=1, out=tmp_path), cfg)
    check(s, "packing")
    assert len(s.targets) == 2 * len(packing.DISTRIBUTIONS)
    for distribution in packing.DISTRIBUTIONS:
        data = s.data[distribution]
        assert data["step0_loss_rel_diff"] <= packing.LOSS_TOLERANCE  # same samples, same loss in both layouts
        assert 0 < data["utilization"]["padded"] <= data["utilization"]["packed"] <= 1


def test_pipeline_section_from_its_stage_processes(tmp_path):
    cfg = pipeline.Config(schedules=("gpipe",), microbatches=(2,), rows=4, seq=16, dim=32, warmup=0, iters=1)
    s = pipeline.run(Options(quick=True, threads=1, out=tmp_path), cfg)
    check(s, "pipeline")
    stages = s.data["stages"]
    assert sorted(r["rank"] for r in stages) == list(range(pipeline.STAGES))
    assert all(r["step_s"] > 0 and 0 <= r["idle"] <= 1 for r in stages)


def test_loading_targets_are_per_two_rank_layout():
    gib = 2**30
    rows = {
        "transformers from_pretrained, 1 process": [{"peak": gib, "seconds": 1.0}],
        "kiln, tp=2": [{"peak": gib // 2, "seconds": 1.0}, {"peak": gib // 2, "seconds": 1.0}],
        "kiln, pp=2": [{"peak": gib // 2, "seconds": 1.0}, {"peak": gib, "seconds": 1.0}],
    }
    s = loading.section(rows, checkpoint_bytes=gib, n_params=gib // 4)
    check(s, "loading")
    assert [(t.what.split(":")[0], t.met) for t in s.targets] == [("kiln, tp=2", True), ("kiln, pp=2", False)]


def test_checkpoint_section_times_both_modes_on_real_saves(tmp_path):
    s = checkpoint.run(Options(quick=True, threads=1, out=tmp_path), model=["model.dim=64", "model.ffn_dim=172"])
    check(s, "checkpoint")
    data = s.data
    assert len(data["sync_saves_s"]) == len(data["async_saves_s"]) == 2  # steps 3 and 6 of 7
    assert data["stall_s"]["sync"] > 0 and data["stall_s"]["async"] > 0 and data["checkpoint_bytes"] > 0
    assert data["ratio"] == data["stall_s"]["async"] / data["stall_s"]["sync"]
    assert "crc32 (zlib)" in data["checksum_s_per_100mb"]


def test_export_target_is_kilns_peak_over_zero_to_fp32s():
    from scripts.benchmarks import export

    mib = 2**20
    rows = {
        "kiln": {"peak": 10 * mib, "seconds": 1.0, "written": 20 * mib},
        "zero_to_fp32": {"peak": 60 * mib, "seconds": 1.0, "written": 20 * mib},
    }
    s = export.section(rows, checkpoint_bytes=80 * mib)
    check(s, "export")
    assert [t.met for t in s.targets] == [True] and s.data["peak_ratio_kiln_over_zero_to_fp32"] == 10 / 60
    rows["kiln"]["peak"] = 40 * mib
    assert [t.met for t in export.section(rows, checkpoint_bytes=80 * mib).targets] == [False]


def test_lora_section_against_full_fine_tuning(tmp_path):
    """llm_tiny full vs LoRA from one base: the adapter is rank 8 on the seven projections of 4 layers (peft's
    r * (in + out) per linear), and only it and its Adam state reach the checkpoint."""
    s = lora.run(Options(quick=True, threads=1, out=tmp_path))
    check(s, "lora")
    dim, kv, ffn = 128, 64, 344  # configs/model/llm_tiny.yaml: 4 heads of 32, 2 kv heads
    per_layer = 8 * ((dim + dim) * 2 + (dim + kv) * 2 + (dim + ffn) * 3)
    assert s.data["trainable"] == {"full": s.data["params"]["full"], "lora": 4 * per_layer}
    assert s.data["params"]["lora"] == s.data["params"]["full"] + 4 * per_layer
    assert s.data["ratios"]["checkpoint_bytes"] < 0.25 and s.data["ratios"]["model_state_bytes"] < 0.5
    assert all(v > 0 for v in s.data["peak_rss_bytes"].values())


def test_bare_step_is_token_mean_cross_entropy_per_document():
    """The bare step that overhead and scripts/gpu_check.py time Kiln against: its loss on packed rows is the mean
    over labelled tokens of each document run alone through the model (the same weights, before the step), under
    bf16 autocast as gpu_check runs it, and it moves the weights."""
    import torch
    import torch.nn.functional as F

    from common.data.packing import pack_samples
    from recipes.llm.model import LlamaArgs, Transformer
    from scripts.benchmarks.overhead import bare_step

    model = Transformer(
        LlamaArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64, max_seq_len=32)
    )
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=gen) for n in (9, 14, 20, 5)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        per_doc = [F.cross_entropy(model(d[None])[0, :-1].float(), d[1:], reduction="sum") for d in docs]
    want = float(sum(per_doc) / sum(len(d) - 1 for d in docs))
    before = model.output.weight.detach().clone()
    step = bare_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), grad_clip=1.0, autocast=torch.bfloat16)
    inputs = pack_samples([{"input_ids": d, "labels": d} for d in docs], 32, pad_id=0).model_inputs("sdpa")
    got = float(step(inputs))
    assert abs(got - want) / want < 2e-2  # bf16 matmuls in both, summed in a different order
    assert not torch.equal(model.output.weight, before)


def t2i_run(step_s: float, images: int = 16, steps: int = 9) -> list[dict]:
    """A t2i run's metrics.jsonl records: the warm-up steps 10x slower (they must not count), then `step_s`."""
    from scripts.benchmarks.t2i import WARMUP

    times = [step_s * (10 if i <= WARMUP else 1) for i in range(1, steps + 1)]
    return [
        {"step": i, "loss": 1.0 + i, "step_time_s": t, "samples_per_s": images / t, "data_wait_s": t / 100}
        for i, t in enumerate(times, 1)
    ]


def test_t2i_cache_ratio_is_the_median_of_each_rounds_steady_medians():
    from scripts.benchmarks import t2i

    s = Section("t2i", "t2i")
    records = {t2i.FLY: [t2i_run(0.2), t2i_run(0.3), t2i_run(0.5)], t2i.CACHED: [t2i_run(0.1)] * 3}
    t2i.cache_report(s, records, max_sequence_length=32, where="test")
    check(s, "t2i")
    data = s.data["cache"]
    assert data["round_ratios"] == pytest.approx([2.0, 3.0, 5.0]) and data["step_time_ratio"] == pytest.approx(3.0)
    assert data["median_step_s"][t2i.FLY] == pytest.approx(0.3) and data["max_loss_rel_diff"] == 0
    assert data["p10_step_time_ratio"] == pytest.approx(2.0)  # the least slowed steps: 0.2 s against 0.1 s


def test_t2i_buckets_pixels_kept_and_throughput():
    """Source pixels kept against the crop's geometry (cover-resize by max(bw/w, bh/h), the bucket's rectangle mapped
    back onto the source image), pixels per training image from the bucket counts, images/s ratio per round."""
    from scripts.benchmarks import t2i

    for (w, h), (bw, bh) in [((32, 64), (12, 24)), ((64, 32), (16, 16)), ((36, 30), (16, 16)), ((50, 24), (24, 12))]:
        scale = max(bw / w, bh / h)
        assert t2i.kept_share(w, h, (bw, bh)) == pytest.approx((bw / scale) * (bh / scale) / (w * h))
    meta = {
        "shapes": [[12, 24], [12, 20], [16, 16], [20, 12], [24, 12]],
        "samples": {"train": {"12x24": 40, "12x20": 0, "16x16": 44, "20x12": 0, "24x12": 42}},
    }
    s = Section("t2i", "t2i")
    records = {t2i.BUCKETED: [t2i_run(0.11), t2i_run(0.1)], t2i.SQUARE: [t2i_run(0.1), t2i_run(0.1)]}
    t2i.buckets_report(s, records, meta, where="test")
    check(s, "t2i")
    data = s.data["buckets"]
    assert data["round_ratios"] == pytest.approx([1 / 1.1, 1.0])
    assert data["p90_images_per_s_ratio"] == pytest.approx(1.0)  # the fastest steps: 16 images in 0.1 s in both
    assert data["mean_kept_share"] == pytest.approx({t2i.BUCKETED: 1.0, t2i.SQUARE: (0.5 + 1 + 0.5) / 3})
    assert data["pixels_per_image"][t2i.BUCKETED] == pytest.approx((12 * 24 * 82 + 16 * 16 * 44) / 126)


def test_video_cache_and_cp_reports():
    """The video section's tables from made-up records: the cache ratio as t2i's (the median of each round's steady
    medians) with the on-the-fly runs' data wait; tokens/s from the slower cp rank's step and the clip's tokens; the
    kept-bytes share against cp=1's (the presets' modelled shares come from the memory model)."""
    from scripts.benchmarks import video

    s = Section("video", "video")
    records = {video.FLY: [t2i_run(0.2, images=4), t2i_run(0.4, images=4)], video.CACHED: [t2i_run(0.1, images=4)] * 2}
    video.cache_report(s, records, where="test")
    layout = lambda rank, kept, step_s: {  # noqa: E731
        "rank": rank,
        "saved_bytes": kept,
        "step_s": step_s,
        "clips": [4, 4],
        "tokens_per_clip": 192,
    }
    results = {1: [layout(0, 1000, [0.1, 0.1])], 2: [layout(0, 520, [0.2, 0.1]), layout(1, 540, [0.1, 0.2])]}
    video.cp_report(s, results, where="test")
    check(s, "video")
    assert s.data["cache"]["step_time_ratio"] == pytest.approx(3.0)
    assert s.data["cache"]["data_wait"][video.FLY] == pytest.approx(0.01)  # t2i_run waits 1% of every step
    assert s.data["cp"]["tokens_per_s"] == pytest.approx({1: 4 * 192 / 0.1, 2: 4 * 192 / 0.2})
    assert s.data["cp"]["worst_share"] == pytest.approx(0.54)
    assert [t.met for t in s.targets] == [True, True, True]
    assert all(0.45 < x < 0.6 for x in s.data["cp"]["modelled_share"].values())
