"""Shared test helpers: run the real entrypoint (python or torchrun) in a subprocess; keep GPUs
away from the processes CPU tests start."""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.support.launcher import DIST_VARS, REPO, TRAIN, preload, run_train  # noqa: F401  (the tests' launcher: tests/support)

# Nothing is downloaded in a test: every process the suite starts (and the fork server's preloaded
# huggingface_hub, which reads this once) runs offline.
os.environ["HF_HUB_OFFLINE"] = "1"
# DeepSpeed builds its CPU shared-memory allreduce op (shm_comm) on the first engine of a process that does not find it
# built (~30-60 s of compiling), in TORCH_EXTENSIONS_DIR, and builds it again whenever the one there came from another
# DeepSpeed's sources: two checkouts testing at once (a worktree and a fresh clone) rebuilt it on each other's every
# run. One folder per Python environment (the sources it is built from): built once per environment.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# run_train's and spawn_ranks' processes fork from a server that imported torch, transformers, diffusers and
# DeepSpeed once (tests/support/launcher.py): the same entrypoint, without ~6 s of imports each.
# KILN_TEST_PRELOAD=0 starts every one as a fresh interpreter instead.
if os.environ.get("KILN_TEST_PRELOAD", "1") != "0":
    preload()

# Small, fast DiT runs: few steps, tiny eval, no progress bar.
FAST_DIT = [
    "recipe=dit_tiny",
    "trainer.progress_bar=false",
    "diffusion.sample_every=0",
    "trainer.log_every=1",
    "diffusion.sample_steps=5",
    "diffusion.samples_per_class=2",
    "diffusion.eval_samples_per_class=3",
]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """The session's cache of training runs (tests/fixtures/runs.py): `trained(args, nproc)` -> its run dir."""
    from tests.fixtures.runs import TrainedRuns
    from tests.fixtures.shared import shared_root

    root = shared_root(tmp_path_factory) / "trained"
    root.mkdir(exist_ok=True)
    return TrainedRuns(root)


@pytest.fixture(scope="session")
def layout_runs(trained):
    """The DeepSpeed layout tests' DiT and VLM runs by layout (tests/fixtures/layouts.py Runs), in the run cache."""
    from tests.fixtures.layouts import Runs

    return Runs(trained)


@pytest.fixture(scope="session")
def latent_dit_data(tmp_path_factory):
    """`latent_dit_data(image_size)` -> {"vae", "shards"}: one small random VAE (it halves images) and the image
    shards of tests/fixtures/dit.py's IMAGE_SETS, each built once per pytest run for the latent DiT tests."""
    from data.tiny_bases import make_vae
    from tests.fixtures.dit import make_image_shards
    from tests.fixtures.shared import once, shared_root

    root = shared_root(tmp_path_factory) / "latent_dit"
    root.mkdir(exist_ok=True)

    def get(image_size: int) -> dict:
        vae = once(root, "sd-vae-ft-mse", lambda out: make_vae(out, block_out_channels=(16, 32)))
        shards = once(root, f"{image_size}px", lambda out: make_image_shards(out, image_size))
        return {"vae": vae, "shards": shards}

    return get


@pytest.fixture(scope="session")
def t2i_world(tmp_path_factory):
    """The text-to-image tests' tiny SD3 pipeline folder and caption shards (tests/fixtures/t2i.py), built once."""
    from tests.fixtures.shared import once, shared_root
    from tests.fixtures.t2i import make_t2i_world

    return once(shared_root(tmp_path_factory), "t2i", make_t2i_world)


@pytest.fixture(scope="session")
def t2i_flux_world(tmp_path_factory, t2i_world):
    """t2i_world with a tiny FLUX.1-dev-shaped FluxPipeline folder as its "pipeline" (the same caption shards),
    built once."""
    from tests.fixtures.shared import once, shared_root
    from tests.fixtures.t2i import make_flux_world

    return {**t2i_world, **once(shared_root(tmp_path_factory), "t2i_flux", make_flux_world)}


@pytest.fixture(scope="session")
def pairs_root(tmp_path_factory):
    """The preference tests' pair shards (tests/fixtures/preference.py make_pairs_world), built once."""
    from tests.fixtures.preference import make_pairs_world
    from tests.fixtures.shared import once, shared_root

    return once(shared_root(tmp_path_factory), "pairs", make_pairs_world)


@pytest.fixture(scope="session")
def grpo_world(trained, tmp_path_factory):
    """The GRPO tests' export (LLM_SERVED's) and prompts tokenized with it (tests/fixtures/grpo.py), built once."""
    from tests.fixtures.grpo import make_prompts
    from tests.fixtures.runs import LLM_SERVED
    from tests.fixtures.shared import once, shared_root

    export = trained(LLM_SERVED) / "export"
    return {"export": export, "prompts": once(shared_root(tmp_path_factory), "grpo", lambda f: make_prompts(export, f))}


@pytest.fixture(scope="session")
def vlm_pairs_world(tmp_path_factory):
    """The VLM preference tests' pairs with images and tiny llava-hf base (tests/fixtures/preference.py), built once."""
    from tests.fixtures.preference import make_vlm_pairs_world
    from tests.fixtures.shared import once, shared_root

    return once(shared_root(tmp_path_factory), "vlm_pairs", make_vlm_pairs_world)


@pytest.fixture(scope="session")
def video_world(tmp_path_factory):
    """The video tests' tiny WanPipeline folder and moving-digit shards (tests/fixtures/video.py), built once."""
    from tests.fixtures.shared import once, shared_root
    from tests.fixtures.video import make_video_world

    return once(shared_root(tmp_path_factory), "video", make_video_world)


@pytest.fixture(scope="session")
def dit_lora_world(tmp_path_factory, latent_dit_data):
    """The DiT LoRA tests' images, VAE and base run (tests/fixtures/lora.py make_dit_world), built once."""
    from tests.fixtures.lora import DIT_SIZE, make_dit_world
    from tests.fixtures.shared import once, shared_root

    return once(shared_root(tmp_path_factory), "dit_lora", lambda out: make_dit_world(out, latent_dit_data(DIT_SIZE)))


@pytest.fixture(scope="session")
def vlm_lora_world(tmp_path_factory):
    """The VLM LoRA tests' LLaVA data and llava-hf base (tests/fixtures/lora.py make_vlm_world), built once."""
    from tests.fixtures.lora import make_vlm_world
    from tests.fixtures.shared import once, shared_root

    return once(shared_root(tmp_path_factory), "vlm_lora", make_vlm_world)


@pytest.fixture(scope="session")
def qwen_world(tmp_path_factory):
    """The Qwen2.5-VL tests' tiny release folder and instruct shards (tests/fixtures/vlm.py make_qwen_world), built
    once: their runs share the run cache (`qwen_run_args`)."""
    from tests.fixtures.shared import once, shared_root
    from tests.fixtures.vlm import make_qwen_world

    return once(shared_root(tmp_path_factory), "qwen", make_qwen_world)


@pytest.fixture(scope="session")
def qwen3_world(tmp_path_factory):
    """qwen_world for Qwen3-VL (tests/fixtures/vlm.py make_qwen3_world), built once: test_vlm_qwen_train trains it,
    test_vlm_qwen_cp takes that cached run as its cp=2 reference and test_serve_vllm_qwen serves it."""
    from tests.fixtures.shared import once, shared_root
    from tests.fixtures.vlm import make_qwen3_world

    return once(shared_root(tmp_path_factory), "qwen3", make_qwen3_world)


@pytest.fixture(scope="session")
def vllm_env():
    """vLLM's environment (make serve-env, .venv-serve): skips without it, fails under CI=true (fixtures/ci.py)."""
    from scripts.kiln.serving import serve_env
    from tests.fixtures.ci import missing

    if serve_env() is None:
        missing("serve-env", "needs vLLM's environment: make serve-env (.venv-serve)")
    return serve_env()


@pytest.fixture(scope="session")
def triton_env():
    """Triton's environment (make triton-env, .venv-triton): skips without it, fails under CI=true (fixtures/ci.py)."""
    from scripts.kiln.triton import check_env, triton_venv
    from tests.fixtures.ci import missing

    if problem := check_env(triton_venv()):
        missing("triton-env", f"needs Triton's environment: {problem}")
    return triton_venv()


def kiln_error(argv: list[str], capsys) -> str:
    """scripts/train.py's main(argv) in process stops with exit code 2 and one `kiln: error:` line: that line."""
    from scripts.kiln.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kiln: error: "), err
    return err[0]


def load_script(name: str):
    """scripts/NAME.py as a module, to call its main(argv) in process."""
    spec = importlib.util.spec_from_file_location(f"kiln_script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (scripts/plan.py's Cluster) look their module up while it executes
    spec.loader.exec_module(module)
    return module


def metrics(run_dir, *keys: str) -> dict:
    """A run's metrics.jsonl by step: each record, or its value of one key, or a tuple of several keys' values.
    Fails on a step logged twice or out of order (a resume that did not rewind): a dict alone would keep the last."""
    from common.metrics import read_metrics

    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"{run_dir}/metrics.jsonl: steps repeated or out of order: {steps}"
    if not keys:
        return {r["step"]: r for r in records}
    if len(keys) == 1:
        return {r["step"]: r[keys[0]] for r in records}
    return {r["step"]: tuple(r[k] for k in keys) for r in records}


def losses(run_dir) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl (no step repeated: `metrics`)."""
    return metrics(run_dir, "loss")


# ---- GPUs and CPU tests ------------------------------------------------------------------------
# CPU tests are written for gloo and the CPU: on a GPU host, a 2-rank run would pick NCCL and
# cuda:<local rank> (cuda:1 does not exist on a 1-GPU host), and single runs would lose the bitwise
# reproducibility the tests assert. So every process a test starts sees no GPU, unless the test is
# gpu-marked. The variable is set for the whole session (module-scoped fixtures start processes
# too) after this process has counted its GPUs: CUDA reads it once, at initialisation, so pytest
# itself still sees them and runs the gpu tests.
_VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="session", autouse=True)
def _child_processes_see_no_gpu():
    torch.cuda.is_available()  # initialise CUDA here with the real devices before hiding them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


def _show_gpus(mp: pytest.MonkeyPatch) -> None:
    if _VISIBLE_GPUS is None:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        mp.setenv("CUDA_VISIBLE_DEVICES", _VISIBLE_GPUS)


@pytest.fixture(autouse=True)
def _gpu_tests_see_the_gpus(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        _show_gpus(monkeypatch)


@contextmanager
def gpus_visible():
    """For a fixture shared with gpu tests whose processes need the GPU (a TensorRT build)."""
    with pytest.MonkeyPatch.context() as mp:
        _show_gpus(mp)
        yield


@contextmanager
def _dist_vars_restored():
    saved = {k: os.environ.get(k) for k in DIST_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# A test or module fixture that joins a process group of one in this process (init_distributed) sets
# RANK, WORLD_SIZE, MASTER_PORT, ... here, and its group keeps MASTER_PORT's store open. A later test's
# `subprocess.run(train.py)` inherits them, joins as rank 0 of a torchrun job and fails with EADDRINUSE
# on that port (CI of stop 28: 8 tests). Each test and each module gets the variables back as they were
# (autouse fixtures of a scope are set up before the others of that scope).
@pytest.fixture(autouse=True, scope="module")
def _process_group_variables_stay_in_the_module():
    with _dist_vars_restored():
        yield


@pytest.fixture(autouse=True)
def _process_group_variables_stay_in_the_test():
    with _dist_vars_restored():
        yield


# `make test` runs the files in xdist workers in collection order (--dist loadfile --no-loadscope-reorder), so the
# longest go first and the last file to end is a short one (longest first: no worker idles while another still has
# a long file ahead of it). Integration before distributed before unit; within a tier the files measured longest
# (module wall time on CI's 2 cores, stop 35) first.
LONGEST_FIRST = (
    "integration/test_readme_commands.py",  # ~460 s, its commands one after another
    "integration/test_fault_tolerance.py",  # ~230 s
    # ~145 s (a shared 2-core machine): an engine per Qwen-VL generation (~30-40 s each), the Qwen fine-tunes it
    # shares with test_vlm_qwen_train (~20 s each) and their LoRA runs (~17 s each)
    "integration/test_serve_vllm_qwen.py",
    "distributed/test_deepspeed_resume_any_layout.py",  # ~135 s with test_dit_context_parallel's runs (shared)
    "integration/test_slurm.py",  # ~120 s
    "integration/test_serve_vllm.py",  # ~115 s (stop 35); its two engines now also serve the LoRA and MoE cases
    "integration/test_host_syncs.py",  # ~110 s
)
TIERS = ("integration", "distributed", "unit")


def _file_order(item) -> tuple[int, int]:
    path = Path(str(item.fspath)).resolve().relative_to(REPO / "tests").as_posix()
    tier = path.split("/")[0]
    first = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    return first, TIERS.index(tier) if tier in TIERS else len(TIERS)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_order)  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
