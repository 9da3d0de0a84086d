"""A real one-node SLURM cluster (scripts/slurm/local_cluster.sh): train.sbatch runs dit_tiny on
2 ranks; a job requeued mid-training (scontrol requeue), and one warned of its time limit
(SIGUSR1, which makes the trainer checkpoint and requeue itself), resume and log exactly the
losses of an uninterrupted run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, losses, run_train
from tests.fixtures.ci import missing

pytestmark = [pytest.mark.integration, pytest.mark.distributed]
CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
STEPS = 30
ARGS = [
    "recipe=dit_tiny",
    f"trainer.max_steps={STEPS}",
    "checkpoint.every=5",
    "parallel.zero_stage=2",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.eval=false",
    "diffusion.sample_every=0",
    "diffusion.sample_steps=2",
    "diffusion.samples_per_class=1",
]


def _sh(*cmd: str, env=None, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=check, timeout=300)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment for sbatch/scontrol against a fresh local cluster; skips where none can run (fails under CI=true,
    where .ci/run installs it: tests/fixtures/ci.py)."""
    if os.geteuid() != 0:
        missing("slurm", "a local SLURM cluster needs root (slurmd)")
    if shutil.which("sbatch") is None:
        installed = _sh(str(CLUSTER), "install", check=False)
        if installed.returncode != 0:
            missing("slurm", f"slurm-wlm/munge could not be installed: {installed.stderr.strip()[-300:]}")
    state = tmp_path_factory.mktemp("slurm")
    started = _sh(str(CLUSTER), "start", str(state), check=False)
    if started.returncode != 0:
        missing("slurm", f"the local SLURM cluster did not start: {started.stderr.strip()[-500:]}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "KILN_NPROC_PER_NODE": "2"}
    yield env
    _sh("scancel", "--user=root", env=env, check=False)
    _sh(str(CLUSTER), "stop", str(state), check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    run_train([*ARGS, f"run.dir={run_dir}"], nproc=2)
    return losses(run_dir)


def submit(env, run_dir: Path, log: Path) -> str:
    out = _sh(
        "sbatch", "--parsable", f"--output={log}", "scripts/slurm/train.sbatch", *ARGS, f"run.dir={run_dir}", env=env
    )
    return out.stdout.strip().split(";")[0]


def job_state(env, job: str) -> str:
    out = _sh("scontrol", "show", "job", job, "-o", env=env, check=False).stdout
    match = re.search(r"JobState=(\w+)", out)
    return match.group(1) if match else "UNKNOWN"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_done(env, job: str, log: Path, timeout: float = 400) -> None:
    """Until the job ends; a requeued job's 2-minute BeginTime delay is lifted as soon as it is pending."""

    def done() -> bool:
        state = job_state(env, job)
        if state == "PENDING":
            _sh("scontrol", "update", f"JobId={job}", "StartTime=now", env=env, check=False)
        return state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    wait_for(done, timeout, f"job {job}")
    assert job_state(env, job) == "COMPLETED", f"job {job} ended {job_state(env, job)}:\n{log.read_text()[-3000:]}"


def test_sbatch_runs_the_recipe(slurm, reference, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm, run_dir, log)
    wait_done(slurm, job, log)
    text = log.read_text()
    assert f"run.dir={run_dir}" in text and "on 2 rank(s)" in text
    assert losses(run_dir) == reference


@pytest.mark.parametrize("interrupt", ["scontrol_requeue", "time_limit_signal"])
def test_interrupted_job_resumes_exactly(slurm, reference, tmp_path, interrupt):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm, run_dir, log)
    wait_for(lambda: logged_steps(run_dir) >= 12, 300, "step 12")
    if interrupt == "scontrol_requeue":  # e.g. an admin or a preemption: SIGTERM, then requeued by SLURM
        _sh("scontrol", "requeue", job, env=slurm)
    else:  # what --signal=USR1@180 sends before the time limit: the trainer checkpoints and requeues
        _sh("scancel", "--signal=USR1", job, env=slurm)
    wait_done(slurm, job, log)

    text = log.read_text()
    stopped = re.search(r"(SIGTERM|SIGUSR1) received: stopped after step (\d+)", text)
    assert stopped, text[-3000:]
    assert 12 <= int(stopped.group(2)) < STEPS
    assert "(restart 1)" in text and f"at step {stopped.group(2)}" in text  # resumed from that checkpoint
    if interrupt == "time_limit_signal":
        assert f"requeueing SLURM job {job}" in text
    assert losses(run_dir) == reference  # every step, bit for bit
