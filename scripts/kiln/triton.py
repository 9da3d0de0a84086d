"""serve.engine=triton: an export as a Triton Inference Server model repository, served by the real `tritonserver`.

The server comes from its own environment, `.venv-triton` (`make triton-env`; $KILN_TRITON_VENV names another): the
`nvidia-pytriton` wheel bundles a `tritonserver` binary with its Python backend (PyTriton's own bind() path fails on
Python 3.11.7; the binary on an ordinary model repository works), and `tritonclient` to talk to it. The family's
`triton_module` (recipes/registry.py) writes the repository from the export under <export>/triton; its Python models
run Kiln's own code from this checkout and this environment (the repository's model.py files put both on sys.path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from common.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]
HEALTH = "/v2/health/ready"  # Triton's readiness (every model loaded)


def triton_venv() -> Path:
    """Triton's own environment: $KILN_TRITON_VENV, else .venv-triton in the checkout (`make triton-env`)."""
    return Path(os.environ.get("KILN_TRITON_VENV") or REPO / ".venv-triton")


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def server_root(venv: Path) -> Path | None:
    """The bundled server (pytriton/tritonserver: bin/, backends/) in `venv`, or None."""
    return next(iter(sorted(venv.glob("lib/python*/site-packages/pytriton/tritonserver"))), None)


def check_env(venv: Path) -> str | None:
    """Why `venv` cannot serve here (not built, or its backend's stub is for another Python), or None."""
    stamp = venv / ".kiln-installed"
    if not stamp.exists() or server_root(venv) is None:
        return f"Triton's environment is not built ({venv}): make triton-env"
    built = stamp.read_text().strip()
    if built != python_version():
        return (
            f"{venv}'s Python backend runs Python {built} and this environment is Python {python_version()}: "
            f"rebuild it with this Python (rm -r {venv}; make triton-env)"
        )
    return None


def family_of(export: Path, image_family) -> object:
    """The registry's spec of the export's family if it has a Triton path, else a one-line ConfigError naming what
    the export is and which exports serve.engine=triton takes."""
    from recipes.registry import specs

    family = image_family(export)
    if family is not None and family.triton_module:
        return family
    served = " and ".join(f"{f.export_kind} exports" for f in specs().values() if f.triton_module)
    what = f"a {family.export_kind} export" if family is not None else "a Hugging Face LLM/VLM export"
    raise ConfigError(f"serve.engine=triton serves {served}; {export} is {what}, which has no Triton path")


def command(s, repo: Path, venv: Path) -> list[str]:
    """tritonserver on the repository, HTTP only (gRPC and metrics off: one port, as the other engines), through
    `env` so that the printed line runs as it is (the bundled libraries are found with LD_LIBRARY_PATH)."""
    site = venv / "lib" / f"python{python_version()}" / "site-packages"
    root = server_root(venv) or site / "pytriton" / "tritonserver"
    return [
        "env",
        f"LD_LIBRARY_PATH={root.parent.parent / 'nvidia_pytriton.libs'}",
        str(root / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={root / 'backends'}",
        f"--http-address={s.host}",
        f"--http-port={s.port}",
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--exit-timeout-secs=1",  # a stop (SIGTERM) waits this long for requests in flight
        f"--log-verbose={1 if s.log_level == 'debug' else 0}",
    ]


def kiln_paths() -> list[str]:
    """What the repository's Python models put on sys.path: this checkout, then this environment's packages."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([str(REPO), paths["purelib"], paths["platlib"]]))


def plan(s, export: Path, name: str, image_family) -> dict:
    """The repository written under <export>/triton and what starts the server on it: {"argv", "why", "notes"}
    (raises ConfigError/UserError with one line)."""
    import importlib

    family = family_of(export, image_family)
    if "/" in name:
        raise ConfigError(f"serve.served_model_name={name!r}: a Triton model name has no '/'")
    if s.lora:
        raise ConfigError("serve.lora: Triton serves one model; serve the merged export (export.merge_lora=true)")
    if s.dtype not in ("auto", "float32"):
        raise ConfigError(f"serve.dtype={s.dtype}: {family.serve_dtype_note}; leave serve.dtype=auto")
    if not (export / "onnx" / "model.onnx").exists():
        raise UserError(
            f"serve.engine=triton runs the export's ONNX graph, and {export}/onnx/model.onnx is missing: "
            f"python scripts/export_dit.py {export} writes it"
        )
    venv = triton_venv()
    problem = check_env(venv)
    if problem and not s.dry_run:
        raise UserError(f"serve.engine=triton: {problem}")
    repo = export / "triton"
    models = importlib.import_module(family.triton_module).write_repository(
        export,
        repo,
        name=name,
        sys_path=kiln_paths(),
        max_batch=s.max_batch_images,
        wait_us=1000 * s.batch_wait_ms,
    )
    notes = [f"model repository {repo} ({', '.join(models)}); requests: scripts/triton_client.py (docs/deploy.md)"]
    if problem:
        notes.append(problem)
    return {"argv": command(s, repo, venv), "why": "requested", "notes": notes}


def ask(venv: Path, base: str, model: str, pairs: list, out: Path, *, steps: int = 0, concurrency: int = 1) -> dict:
    """tritonclient's answers to one-image requests `pairs` ([[class, seed], ...]), sent by scripts/triton_client.py
    from Triton's environment (tritonclient is installed there, not in Kiln's): {"images" [N, C, S, S] (NaN where one
    failed), "status" [N] (200 or Triton's HTTP status), "seconds" (all of them, wall clock), "stderr"}."""
    import numpy as np

    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            str(REPO / "scripts" / "triton_client.py"),
            base.removeprefix("http://"),
            model,
            f"--requests={json.dumps(pairs)}",
            f"--steps={steps}",
            f"--concurrency={concurrency}",
            f"--out={out}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode not in (0, 1):  # 1: some requests failed, as the answers say
        raise RuntimeError(f"scripts/triton_client.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    with np.load(out) as got:
        answers = {"images": got["images"], "status": got["status"], "seconds": float(got["seconds"])}
    return answers | {"stderr": proc.stderr}
