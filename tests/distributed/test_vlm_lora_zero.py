"""finetune=lora on the VLM under DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks (tiny llava-hf base; the ZeRO-3 run
under selective activation checkpointing): the same per-step losses and adapters in both (ZeRO and AC only change
where the trainable state lives and what is recomputed), checkpoints that hold the adapter and the projector only
(ZeRO-3 partitions the frozen base too, and leaves it out), a ZeRO-3 resume that continues bit for bit, and
scripts/export.py on the ZeRO-3 run's last checkpoint (its adapter recorded under checkpoint_wrapper's prefix)
writing its end-of-run export."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script, losses, run_train
from tests.fixtures.lora import assert_same_export, checkpoint_bytes, tensors
from tests.fixtures.lora import vlm_overrides as overrides

pytestmark = pytest.mark.distributed
STEPS = 4
LAYOUT = {
    2: ["parallel.zero_stage=2"],
    3: ["parallel.zero_stage=3", "toggles.activation_checkpointing=selective"],
}


@pytest.fixture(scope="module")
def world(vlm_lora_world):
    return vlm_lora_world  # test_vlm_lora's


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    out = {}
    for stage in (2, 3):
        out[stage] = tmp_path_factory.mktemp(f"zero{stage}")
        run_train(
            overrides(
                world,
                out[stage],
                *LAYOUT[stage],
                "trainer.micro_batch_size=4",
                f"trainer.max_steps={STEPS}",
                "checkpoint.every=2",
            ),
            nproc=2,
        )
    return out


def test_zero2_and_zero3_train_the_same_adapter(runs):
    two, three = losses(runs[2]), losses(runs[3])
    assert sorted(two) == sorted(three) == list(range(1, STEPS + 1)) and two[STEPS] < two[1]
    for step in two:
        assert three[step] == pytest.approx(two[step], rel=1e-5), step
    want, have = tensors(runs[2] / "export"), tensors(runs[3] / "export")
    assert want.keys() == have.keys() and len(want) == 2 * 7 * 2 + 4
    error = max((want[k] - have[k]).abs().max().item() for k in want)
    print(f"ZeRO-2 vs ZeRO-3: losses {[two[s] for s in sorted(two)]}; max |adapter difference| = {error:.2e}")
    assert error <= 1e-4  # another reduction order, through Adam's 1/sqrt(v) (lr 1e-2)

    trained = sum(v.numel() * v.element_size() for v in want.values())
    for stage, run in runs.items():  # weights + Adam's two moments of what trains, nothing of the frozen base
        assert checkpoint_bytes(run / "checkpoints" / "step_0000002") <= 3 * trained + 400_000, stage


def test_zero3_resumes_bitwise(world, runs, tmp_path):
    run_train(
        overrides(
            world,
            tmp_path,
            *LAYOUT[3],
            "trainer.micro_batch_size=4",
            f"trainer.max_steps={STEPS}",
            f"run.resume={runs[3] / 'checkpoints' / 'step_0000002'}",
        ),
        nproc=2,
    )
    want, got = losses(runs[3]), losses(tmp_path)
    assert sorted(got) == list(range(3, STEPS + 1)) and all(got[s] == want[s] for s in got), (want, got)
    assert all(torch.equal(v, tensors(runs[3] / "export")[k]) for k, v in tensors(tmp_path / "export").items())


def test_export_py_from_the_zero3_checkpoint(runs, tmp_path, capsys):
    """The adapter and projector read from the 2 ranks' ZeRO-3 flat groups: the end-of-run export, bit for bit."""
    code = load_script("export").main([str(runs[3]), "--out", str(tmp_path / "again")])
    assert code == 0, capsys.readouterr().err
    assert_same_export(runs[3] / "export", tmp_path / "again")
