#!/usr/bin/env python
"""Serve an export with an OpenAI-compatible API: python scripts/serve.py serve.model=<export dir>.

LLM/VLM exports on vLLM or transformers serve (/v1/chat/completions, /v1/completions), DiT and text-to-image
exports on Kiln's images server (/v1/images/generations), video exports on the same server (/v1/videos/generations,
MP4 clips); a DiT export on Triton Inference Server with serve.engine=triton (its KServe v2 API, docs/deploy.md);
an LLM's GGUF file (scripts/export.py --format gguf) on llama.cpp's own server with serve.engine=llamacpp."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from common.errors import UserError  # noqa: E402
from scripts.kiln.launch import user_error_exit  # noqa: E402
from scripts.kiln.serving import compose, plan  # noqa: E402

USAGE = """usage: python scripts/serve.py serve.model=<run.dir>/export [serve.KEY=VALUE ...]

  LLM/VLM: serve.engine=auto|vllm|transformers   auto: vLLM from .venv-serve (make serve-env) or beside CUDA,
           else transformers serve
  DiT:     serve.engine=auto|tensorrt|onnxruntime|torch   auto: TensorRT (CUDA + onnx/model.plan), else onnxruntime
           (onnx/model.onnx from scripts/export_dit.py), else torch; serve.max_batch_images, serve.batch_wait_ms
  DiT on Triton Inference Server: serve.engine=triton (make triton-env; writes <export>/triton, a model repository;
           loopback only unless serve.allow_unauthenticated=true); serve.max_batch_images, serve.batch_wait_ms
  text-to-image, video: serve.engine=auto|torch, serve.device; serve.max_batch_images, serve.batch_wait_ms
  GGUF on llama.cpp's server: serve.engine=llamacpp serve.model=<out>/gguf (or the .gguf file; make llamacpp-env);
           serve.max_model_len (its context), serve.threads; the API key as vLLM's
  serve.host, serve.port, serve.served_model_name, serve.dtype, serve.dry_run=true (print the command, exit)
  beyond loopback (serve.host=0.0.0.0): an API key in $KILN_API_KEY (serve.api_key_env=NAME picks another
  variable; vLLM, llama.cpp and the images server check it) or serve.allow_unauthenticated=true; \
transformers serve only with the latter
  vllm: serve.tensor_parallel_size, serve.max_model_len, serve.gpu_memory_utilization
  transformers: serve.device, serve.continuous_batching, serve.cb_num_blocks, serve.cb_max_batch_tokens
All keys and defaults: scripts/kiln/serving.py (ServeSection); docs/serving.md."""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        s = compose(argv)
        launch = plan(s)
    except UserError as exc:
        raise user_error_exit(str(exc)) from None
    print(
        f"kiln: serving {s.model} as '{launch.name}' on http://{s.host}:{s.port}{launch.api} "
        f"with engine={launch.engine} ({launch.why})",
        flush=True,
    )
    for note in launch.notes:
        print(f"kiln: note: {note}", flush=True)
    print("kiln: " + launch.shown(), flush=True)
    if s.dry_run:
        return 0
    if launch.run is not None:  # the images server (DiT, text-to-image, video)
        launch.run()
        return 0
    if launch.cwd is not None:
        os.chdir(launch.cwd)
    # exec: the engine becomes this process, so signals (Ctrl-C, SLURM, a test's terminate) reach it directly.
    os.execvpe(launch.argv[0], launch.argv, {**os.environ, **launch.env})


if __name__ == "__main__":
    from common.known_warnings import silence_known_warnings

    silence_known_warnings()
    sys.exit(main(sys.argv[1:]))
