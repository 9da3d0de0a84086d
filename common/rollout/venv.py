"""Where vLLM's own environment is (it pins its own torch and transformers): scripts/kiln/serving.py serves with it,
the GRPO loop starts its rollout engine with it. No torch here: the serving config checks import it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def serve_venv() -> Path:
    """vLLM's own environment (it pins its own torch and transformers): $KILN_SERVE_VENV, else .venv-serve in
    the checkout, which `make serve-env` builds."""
    return Path(os.environ.get("KILN_SERVE_VENV") or REPO / ".venv-serve")
