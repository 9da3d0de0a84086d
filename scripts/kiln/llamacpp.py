"""serve.engine=llamacpp: a GGUF export (scripts/export.py --format gguf) on llama.cpp's own OpenAI-compatible server.

The server comes from its own environment, `.venv-llamacpp` (`make llamacpp-env`; $KILN_LLAMACPP_VENV names another):
xllamacpp, a prebuilt wheel of llama.cpp's library with llama.cpp's server (`llama-server`'s code, run in process).
scripts/llamacpp_server.py, run by that environment's Python, starts it; nothing of llama.cpp is re-implemented here.
"""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "scripts" / "llamacpp_server.py"
# llama.cpp's server reads its API key from this variable (llama-server's --api-key / LLAMA_API_KEY): given in the
# environment, never on the command line (ps shows that to every user of the machine)
KEY_ENV = "LLAMA_API_KEY"


def llamacpp_venv() -> Path:
    """llama.cpp's own environment: $KILN_LLAMACPP_VENV, else .venv-llamacpp in the checkout (`make llamacpp-env`)."""
    return Path(os.environ.get("KILN_LLAMACPP_VENV") or REPO / ".venv-llamacpp")


def check_env(venv: Path) -> str | None:
    """Why `venv` cannot serve here (not built by `make llamacpp-env`), or None."""
    if not (venv / ".kiln-installed").exists() or not (venv / "bin" / "python").exists():
        return f"llama.cpp's environment is not built ({venv}): make llamacpp-env"
    return None


def gguf_file(export: Path) -> Path:
    """The GGUF file to serve: `export` itself, or the one .gguf in the folder (or in its gguf/, where scripts/export.py
    --format gguf writes it); else a one-line UserError."""
    if export.is_file():
        if export.suffix != ".gguf":
            raise UserError(f"serve.engine=llamacpp serves a .gguf file; {export} is not one")
        return export
    found = sorted(export.glob("*.gguf")) or sorted(export.glob("gguf/*.gguf"))
    if not found:
        raise UserError(
            f"serve.engine=llamacpp serves a GGUF file and {export} has none: scripts/export.py RUN --format gguf "
            "writes <out>/gguf/model-f16.gguf"
        )
    if len(found) > 1:
        raise UserError(
            f"serve.engine=llamacpp: {export} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}): "
            "name one, serve.model=<folder>/<file>.gguf"
        )
    return found[0]


def has_chat_template(path: Path) -> bool:
    """Whether the GGUF file carries a chat template (tokenizer.chat_template), read with llama.cpp's `gguf` package."""
    import gguf

    return "tokenizer.chat_template" in gguf.GGUFReader(path).fields


def plan(s, served_name, base_chat_template: str, scratch: Path) -> dict:
    """What serves serve.model's GGUF file on llama.cpp's server: {"name", "argv", "notes"} (raises ConfigError or
    UserError with one line). The served name is serve.served_model_name, else `served_name(folder)` of the export
    the file sits in (<export>/gguf/model-f16.gguf: <export>'s). A file without a chat template (a base LM's) gets
    `base_chat_template`, written under `scratch`, as the other engines do."""
    path = Path(s.model).expanduser().resolve()
    if not path.exists():
        raise UserError(f"serve.model={s.model}: no such file or folder (a .gguf file, or the folder that holds one)")
    file = gguf_file(path)
    if s.lora:
        raise ConfigError("serve.lora: serve.engine=llamacpp serves one GGUF file; serve the merged model's GGUF")
    if s.dtype != "auto":
        raise ConfigError(
            f"serve.dtype={s.dtype}: llama.cpp runs the GGUF file's own types (scripts/export.py --gguf-type picks "
            "them); leave serve.dtype=auto"
        )
    venv = llamacpp_venv()
    problem = check_env(venv)
    if problem and not s.dry_run:
        raise UserError(f"serve.engine=llamacpp: {problem}")
    name = s.served_model_name or served_name(file.parent.parent if file.parent.name == "gguf" else file.parent)
    argv = [str(venv / "bin" / "python"), str(SERVER), "--model", str(file), "--alias", name]
    argv += ["--host", s.host, "--port", str(s.port), "--ctx-size", str(s.max_model_len)]
    if s.threads:
        argv += ["--threads", str(s.threads)]
    notes = [problem] if problem else []
    if not has_chat_template(file):
        scratch.mkdir(parents=True, exist_ok=True)
        template = scratch / "chat_template.jinja"
        template.write_text(base_chat_template)
        argv += ["--chat-template-file", str(template)]
        notes.append("the GGUF has no chat template (a base LM): chat messages are joined as plain text")
    return {"name": name, "argv": argv, "notes": notes}
