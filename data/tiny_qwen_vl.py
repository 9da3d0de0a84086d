"""A tiny random Qwen-VL base, to try the Qwen recipes and their serving on a CPU in minutes.

    python -m data.tiny_qwen_vl --out outputs/tiny-qwen2.5-vl [--arch qwen2.5-vl|qwen3-vl] [--force]

A release folder as `save_pretrained` writes it and as model.init_from reads a downloaded Qwen2.5-VL-7B-Instruct
(or Qwen3-VL-8B-Instruct): transformers' Qwen2_5_VLForConditionalGeneration (Qwen3VLForConditionalGeneration) with
random weights, a few hundred kilobytes, its image processor and a Qwen2Tokenizer trained offline with Qwen's special
tokens and chat template (data/tiny_bases.py make_qwen2_5_vl / make_qwen3_vl). Its language model's attention
heads are 32 wide, the narrowest vLLM's CPU attention runs (scripts/kiln/serving.py VLLM_CPU_HEAD_SIZES), so a run's
export of it serves on vLLM's CPU build as well as on transformers. A folder already there is left alone (pass
--force to rebuild); the folder appears whole (built beside it, then renamed).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

# --arch -> (the builder in data/tiny_bases.py, its arguments: language heads of 32 dimensions).
ARCHS = {
    "qwen2.5-vl": ("make_qwen2_5_vl", {"hidden_size": 128}),  # 4 heads (2 key/value) of 32
    "qwen3-vl": ("make_qwen3_vl", {"num_heads": 2}),  # 2 heads of 32 at hidden 64
}


def build(out: str | Path, arch: str = "qwen2.5-vl") -> Path:
    """The tiny `arch` base in ``out`` (replaced if there), built beside it and renamed into place."""
    from data import tiny_bases as fixtures

    out = Path(out).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        name, kwargs = ARCHS[arch]
        getattr(fixtures, name)(tmp / "base", **kwargs)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "base").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.tiny_qwen_vl", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the base's folder (model.init_from=DIR)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-vl", help="the release it is shaped like")
    parser.add_argument("--force", action="store_true", help="replace a folder that is there")
    args = parser.parse_args(argv)
    out = args.out.expanduser().absolute()
    if out.exists() and not args.force:
        if (out / "config.json").exists():
            print(f"{out}/config.json exists; nothing to do (pass --force to rebuild)")
            return 0
        if not out.is_dir() or any(out.iterdir()):
            print(
                f"kiln: error: {out} is not empty and holds no model; choose another --out or pass --force",
                file=sys.stderr,
            )
            return 2
    build(out, args.arch)
    print(f"wrote {out}: a tiny random {args.arch} (attention heads of 32: vLLM's CPU build serves what trains on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
