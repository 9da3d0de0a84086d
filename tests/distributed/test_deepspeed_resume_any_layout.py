"""A DeepSpeed recipe's checkpoint resumes under another number of ranks and ZeRO stage: the per-step losses of
steps 5-8 after the resume equal those of an uninterrupted run on the new layout with the same global batch (fp32,
1e-5 relative: only the reduction order differs), and a checkpoint that cannot resume is refused in one line.

End to end, each family from a ZeRO-3 source (its universal form differs: bare flat tensors, no step.pt) and from
others; in process, every source stage 0-3 (fp32, and bf16 from ZeRO-3 and ZeRO-0) into every other stage on another
number of ranks, with the state compared bit for bit, from sources under activation checkpointing into targets
without (`test_universal_reader_takes_every_stage_both_forms`). The runs are tests/fixtures/layouts.py's, in the
session's run cache (the DiT's context-parallel tests, test_dit_context_parallel.py, share them)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.checkpoint import MANIFEST, file_crc32, read_meta
from tests.conftest import losses, run_train
from tests.fixtures.layouts import DIT, GLOBAL_BATCH, SAVED, VLM, assert_continues, layout, resume

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    "source, target",
    [
        (layout(2, 2), layout(1, 0, accum=2)),  # 2 ranks ZeRO-2 -> 1 rank ZeRO-0 (accumulating the global batch)
        (layout(2, 2), layout(2, 3)),  # -> 2 ranks ZeRO-3
        (layout(2, 1), layout(4, 1)),  # 2 ranks ZeRO-1 -> 4 ranks ZeRO-1
        (layout(2, 3), layout(2, 2)),  # 2 ranks ZeRO-3 -> 2 ranks ZeRO-2
        (layout(2, 3), layout(1, 0, accum=2)),  # 2 ranks ZeRO-3 -> 1 rank ZeRO-0
    ],
    ids=[
        "2r-zero2-to-1r-zero0",
        "2r-zero2-to-2r-zero3",
        "2r-zero1-to-4r-zero1",
        "2r-zero3-to-2r-zero2",
        "2r-zero3-to-1r-zero0",
    ],
)
def test_dit_resumes_under_another_layout(layout_runs, tmp_path, source, target):
    reference = losses(layout_runs.full(DIT, *target))
    ckpt = layout_runs.source(DIT, *source)
    # The global stream and every random draw are the layout's: the first steps agree across layouts already.
    saved = losses(ckpt.parent.parent)
    for step in range(1, SAVED + 1):
        assert saved[step] == pytest.approx(reference[step], rel=1e-5, abs=0), f"step {step} before the checkpoint"
    assert_continues(resume(DIT, ckpt, *target, tmp_path / "resumed"), reference)


@pytest.mark.parametrize(
    "source, target",
    [
        (layout(1, 0), layout(2, 3)),  # 1 rank ZeRO-0 (whole torch AdamW state) -> 2 ranks ZeRO-3, rows packed per rank
        (
            layout(2, 3),
            layout(1, 1),
        ),  # 2 ranks ZeRO-3 (micro-batch 4) -> 1 rank asking ZeRO-1 (runs 0; micro 8)
    ],
    ids=["1r-zero0-to-2r-zero3", "2r-zero3-to-1r-zero1"],
)
def test_vlm_resumes_under_another_layout(layout_runs, tmp_path, source, target):
    reference = losses(layout_runs.full(VLM, *target))
    ckpt = layout_runs.source(VLM, *source)
    assert_continues(resume(VLM, ckpt, *target, tmp_path / "resumed"), reference)


# ---- refusals: one line, nothing lost ----------------------------------------------------------------
def refused(recipe: list[str], args: list[str], resume_from, run_dir) -> str:
    proc = run_train([*recipe, *args, f"run.dir={run_dir}", f"run.resume={resume_from}"], check=False, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kiln: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists(), sorted(map(str, run_dir.rglob("*")))  # no config.yaml, no checkpoints/.tmp
    return errors[0]


def tree_digest(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_refusals(layout_runs, tmp_path):
    ckpt = layout_runs.source(DIT, *layout(2, 2))
    _, one_rank = layout(1, 0, accum=2)
    assert "is a checkpoint of recipe dit_tiny; this run is vlm_tiny" in refused(VLM, one_rank, ckpt, tmp_path / "a")
    line = refused(DIT, [*one_rank, "model.num_layers=2"], ckpt, tmp_path / "b")
    assert "holds another model" in line and "transformer_blocks.2" in line
    assert "no complete checkpoint there" in refused(DIT, one_rank, tmp_path, tmp_path / "c")
    half = ["parallel.zero_stage=0", "trainer.micro_batch_size=4", "trainer.grad_accum=1"]  # 4 samples per step, not 8
    line = refused(DIT, half, ckpt, tmp_path / "d")
    assert "took 8 samples per step; this run takes 4" in line

    broken = tmp_path / "broken" / ckpt.name
    shutil.copytree(ckpt, broken)
    shard = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    # A shard written broken (its manifest agrees): verification passes, DeepSpeed's conversion fails.
    manifest = json.loads((broken / MANIFEST).read_text())
    manifest["files"][shard.name] = {"size": shard.stat().st_size, "crc32": file_crc32(shard)}
    (broken / MANIFEST).write_text(json.dumps(manifest))
    before = tree_digest(broken.parent)
    line = refused(DIT, one_rank, broken, tmp_path / "e")
    assert "converting" in line and "failed" in line and "left as it was" in line
    assert tree_digest(broken.parent) == before  # the original untouched

    # A ZeRO-3 checkpoint whose optimizer shards hold no AdamW step count (its manifest agrees): DeepSpeed converts it
    # (it reads only weights and moments), the load after the conversion finds no step count. One line, nothing left.
    stepless = tmp_path / "stepless" / ckpt.name
    shutil.copytree(layout_runs.source(DIT, *layout(2, 3)), stepless)
    manifest = json.loads((stepless / MANIFEST).read_text())
    for shard in stepless.glob("*optim_states.pt"):
        saved = torch.load(shard, weights_only=False)
        for state in saved["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
            del state["step"]
        torch.save(saved, shard)
        manifest["files"][shard.name] = {"size": shard.stat().st_size, "crc32": file_crc32(shard)}
    (stepless / MANIFEST).write_text(json.dumps(manifest))
    before = tree_digest(stepless.parent)
    line = refused(DIT, one_rank, stepless, tmp_path / "f")
    assert "converted to a universal checkpoint" in line and "no single AdamW step count" in line, line
    assert tree_digest(stepless.parent) == before


# ---- the universal reader, in process: every source stage into one rank, both file forms, fp32 and bf16 -------------
# What a resume restores is copied, not computed: the whole fp32 weights, AdamW's moments and step count, the weights
# the forward reads, the LR schedule. So the loaded engine must hold them bit for bit as the saving one did, which a
# process per layout (not a training run per layout) shows for every source stage; ds_to_universal writes a ZeRO-3
# source's states as bare flat tensors without step.pt, a ZeRO-1/2 source's as shaped {"param": ...} dicts.
UNIVERSAL_SOURCES = [(stage, "fp32") for stage in range(4)] + [(3, "bf16"), (0, "bf16")]


def _engine(stage: int, precision: str, ranks: int, ac: str = "none"):
    from common.engine import DeepSpeedEngine
    from recipes.dit.model import build_model
    from recipes.dit.parallelize import parallelize
    from scripts.kiln.launch import compose

    cfg = compose(
        [
            "recipe=dit_tiny",
            f"parallel.zero_stage={stage}",
            f"toggles.precision={precision}",
            f"trainer.micro_batch_size={GLOBAL_BATCH // ranks}",
            "optim.warmup_steps=1",
            f"toggles.activation_checkpointing={ac}",
        ]
    )
    torch.manual_seed(0)  # the same initial weights on every rank and in every layout
    model = build_model(cfg.model, cfg.data.image_size, cfg.model.in_channels)
    return DeepSpeedEngine(parallelize(model, cfg), cfg, ranks), cfg


def _full_state(engine) -> dict:
    """Each trained parameter's whole fp32 weight, AdamW moments and compute-dtype weight, AdamW's step counts, the
    LR and DeepSpeed's step counter (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from common.deepspeed import gathered_one
    from common.toggles import unwrapped_name

    e = engine.ds
    inner = getattr(e.optimizer, "optimizer", e.optimizer)
    whole = {}  # ZeRO-0: torch's AdamW on the parameters themselves (fp32) or on DeepSpeed's fp32 masters (bf16)
    if e.zero_optimization_stage() == 0:
        masters = e.optimizer.fp32_groups if e.bfloat16_enabled() else [g["params"] for g in inner.param_groups]
        lows = e.optimizer.fp16_groups if e.bfloat16_enabled() else masters
        whole = {lp: hp for lps, hps in zip(lows, masters) for lp, hp in zip(lps, hps)}
    params = {}
    for wrapped, p in e.module.named_parameters():
        name = unwrapped_name(wrapped)  # the sources' blocks run under activation checkpointing, the targets' do not
        if whole:
            hp = whole[p]
            params[name] = [hp.detach().clone(), *(inner.state[hp][k].clone() for k in ("exp_avg", "exp_avg_sq"))]
        else:
            params[name] = [
                safe_get_full_fp32_param(p),
                *(safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")),
            ]
        with gathered_one(p, e.zero_optimization_stage()):
            params[name].append(p.detach().clone())
        params[name] = [t.reshape(-1) for t in params[name]]
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return {"params": params, "steps": steps, "lr": e.get_lr(), "global_steps": e.global_steps}


def _save_sources(root: str) -> dict:
    """On 2 ranks: each source layout takes two AdamW steps on a fixed batch and saves a Kiln checkpoint, under
    activation checkpointing (its files name the blocks' parameters under checkpoint_wrapper's prefix; the targets'
    models have none)."""
    import torch.distributed as tdist

    from common.checkpoint import CheckpointManager
    from common.distributed import DistInfo

    rank, world = tdist.get_rank(), tdist.get_world_size()
    for stage, precision in UNIVERSAL_SOURCES:
        engine, cfg = _engine(stage, precision, world, ac="full")
        dtype = next(engine.module.parameters()).dtype
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(
            cfg.trainer.micro_batch_size, cfg.model.in_channels, cfg.data.image_size, cfg.data.image_size, generator=g
        ).to(dtype)
        labels, t = torch.arange(x.shape[0]) % 10, torch.full((x.shape[0],), 500)
        for _ in range(2):
            engine.ds.backward(engine.ds(x, timestep=t, class_labels=labels).sample.float().square().mean())
            engine.ds.step()
        run = Path(root, f"zero{stage}_{precision}")
        dist = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
        CheckpointManager(run, keep=1, dist=dist).save(2, engine.save, meta=engine.layout())
        state = _full_state(engine)
        if rank == 0:
            torch.save(state, run / "state.pt")
        engine.ds.destroy()
    return {}


def _load_everywhere(root: str) -> dict:
    """On 1 rank, which runs ZeRO-0 whatever parallel.zero_stage asks (common/deepspeed.py zero_stage): each source
    converted and loaded; what differs from what the source held. (Into ZeRO-1/2/3: the 2-rank resumes above.)"""
    from common import deepspeed as ds

    differ = {}
    for stage, precision in UNIVERSAL_SOURCES:
        run = Path(root, f"zero{stage}_{precision}")
        saved = torch.load(run / "state.pt", weights_only=False)
        for target in (0,):
            engine, _ = _engine(target, precision, 1)
            ds.load_checkpoint(engine.ds, run / "checkpoints" / "step_0000002", scratch=Path(root, "scratch"))
            loaded = _full_state(engine)
            key = f"zero{stage}_{precision}->one rank, zero{engine.zero_stage}"
            differ[key] = [
                name
                for name, ts in saved["params"].items()
                if not all(torch.equal(a, b) for a, b in zip(ts, loaded["params"][name], strict=True))
            ]
            differ[key] += [k for k in ("steps", "lr", "global_steps") if saved[k] != loaded[k]]
            engine.ds.destroy()
    return differ


def test_universal_reader_takes_every_stage_both_forms(tmp_path):
    from tests.support.launcher import spawn_ranks

    spawn_ranks(_save_sources, (str(tmp_path),), world=2, out_dir=tmp_path)
    three = tmp_path / "zero3_fp32" / "checkpoints" / "step_0000002"
    assert read_meta(three)["zero_stage"] == 3 and read_meta(three)["world_size"] == 2
    assert torch.load(tmp_path / "zero3_fp32" / "state.pt", weights_only=False)["steps"] == [2.0]
    [differ] = spawn_ranks(_load_everywhere, (str(tmp_path),), world=1, out_dir=tmp_path)
    assert len(differ) == len(UNIVERSAL_SOURCES) and all(key.endswith("zero0") for key in differ)
    assert differ == {key: [] for key in differ}
    assert not (tmp_path / "scratch").exists()  # every conversion removed after its load
