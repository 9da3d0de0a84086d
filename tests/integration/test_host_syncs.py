"""A training step waits for the device at most once (issue 16): Kiln's own code reads a device
tensor on the host (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.numpy()`) at most once
per optimizer step, except on logging steps, which read the step's metrics.

On CPU these reads cost nothing, but they are the same calls that block a CUDA stream, so counting
them here counts the syncs a GPU step would make. Reads made inside torch, DeepSpeed or transformers
are theirs, not counted, and so are reads of tensors the loader built on the host. Each recipe runs in
child processes (one, or two gloo ranks under torchrun: the ranks' agreement on stop signals is a
collective whose result must not be read a second time), and each rank writes its count per step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.launcher import TRAIN, launch_env, run_python, train_command

ROOT = Path(__file__).resolve().parents[2]
KILN = tuple(f"{ROOT / folder}/" for folder in ("common", "recipes", "scripts", "data"))  # not .venv/, not tests/
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
# Functions that read tensors the loader built on the host (CPU tensors on a GPU machine too):
# no device is involved, so they are not syncs. Each says so in its docstring.
HOST_SIDE = {("packing.py", "cu_seqlens_of_rows"), ("packing.py", "_build")}
LOG_EVERY, STEPS = 4, 7  # non-logging steps 2, 3, 5, 6 (step 1 counts FLOPs, 4 and 7 log)


def count_reads(argv: list[str], out: Path) -> None:
    """Run `scripts/train.py argv` here, counting host reads by Kiln's frames per training step."""
    import torch

    import common.trainer
    from scripts.kiln.launch import main

    counts: dict[int, list[str]] = {}
    current = [0]  # the step being computed (0: set-up)

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = frame.f_code.co_filename
            function = frame.f_code.co_qualname.split(".<locals>")[0]  # a generator expression: its function
            if caller.startswith(KILN) and (Path(caller).name, function) not in HOST_SIDE:
                counts.setdefault(current[0], []).append(f"{name} {Path(caller).name}:{frame.f_lineno}")
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in READS:
        counting(name)
    heartbeat = common.trainer.heartbeat

    def step_starts(step: int) -> None:
        current[0] = step
        heartbeat(step)

    common.trainer.heartbeat = step_starts
    code = main(argv)
    rank = os.environ.get("RANK", "0")
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps({"code": code, "counts": counts}))


RECIPES = {
    "dit_tiny": ["diffusion.sample_every=0"],
    "vlm_tiny": [],
    "llm_tiny": [],
    "moe_tiny": [],  # the MoE's routing and auxiliary losses stay on the device (dp=2: FSDP2 over stacked experts)
}


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_training_step_reads_the_device_at_most_once(recipe, nproc, tmp_path):
    out = tmp_path / "counts.json"
    argv = [
        f"recipe={recipe}",
        f"trainer.max_steps={STEPS}",
        f"trainer.log_every={LOG_EVERY}",
        "trainer.eval=false",
        "checkpoint.every=0",
        f"run.dir={tmp_path / 'run'}",
        *RECIPES[recipe],
    ]
    cmd = train_command([str(out), *argv], nproc)
    cmd[cmd.index(TRAIN)] = __file__  # scripts/train.py's main, counting
    proc = run_python(cmd, env=launch_env(nproc), timeout=900)  # forked from the preloaded server, as run_train
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(nproc):
        result = json.loads((tmp_path / f"counts.rank{rank}.json").read_text())
        assert result["code"] == 0
        counts = {int(k): v for k, v in result["counts"].items()}
        quiet = [s for s in range(2, STEPS + 1) if s % LOG_EVERY and s != STEPS]
        for step in quiet:
            assert len(counts.get(step, [])) <= 1, (rank, step, counts.get(step))
        # The count can fail: a logging step reads its metrics (a second read), and the test sees it.
        assert len(counts.get(LOG_EVERY, [])) >= 2, (rank, counts.get(LOG_EVERY))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    count_reads(sys.argv[2:], Path(sys.argv[1]))
