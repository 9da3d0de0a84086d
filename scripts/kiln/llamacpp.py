"""llama.cpp's own environment, `.venv-llamacpp` (`make llamacpp-env`; $KILN_LLAMACPP_VENV names another): xllamacpp, a
prebuilt wheel of llama.cpp's library with llama.cpp's server (`llama-server`'s code, run in process)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def llamacpp_venv() -> Path:
    """llama.cpp's own environment: $KILN_LLAMACPP_VENV, else .venv-llamacpp in the checkout (`make llamacpp-env`)."""
    return Path(os.environ.get("KILN_LLAMACPP_VENV") or REPO / ".venv-llamacpp")


def check_env(venv: Path) -> str | None:
    """Why `venv` cannot serve here (not built by `make llamacpp-env`), or None."""
    if not (venv / ".kiln-installed").exists() or not (venv / "bin" / "python").exists():
        return f"llama.cpp's environment is not built ({venv}): make llamacpp-env"
    return None

