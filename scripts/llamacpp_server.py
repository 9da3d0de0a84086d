#!/usr/bin/env python
"""llama.cpp's own OpenAI-compatible server on a GGUF file, until SIGTERM or Ctrl-C: what `scripts/serve.py
serve.engine=llamacpp` runs, with the Python of llama.cpp's environment (.venv-llamacpp: make llamacpp-env).

xllamacpp runs llama.cpp's server (llama-server's code: /v1/chat/completions, /v1/completions, /v1/models, /health,
its API-key check) in this process; this script only sets its parameters. It imports nothing from Kiln (that
environment has no torch): scripts/kiln/llamacpp.py builds its command line. The API key, if any, comes in
$LLAMA_API_KEY, never on the command line (ps shows that to every user of the machine)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llamacpp_server.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--alias", required=True, help="the served model name (a request's `model`)")
    parser.add_argument("--ctx-size", type=int, default=0, help="the context in tokens; 0: the model's own")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads; 0: llama.cpp's default")
    parser.add_argument("--chat-template-file", default="", help="a Jinja chat template for a file without one")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.model_alias = {args.alias}
    params.n_ctx = args.ctx_size
    if args.threads:
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    if key := os.environ.get("LLAMA_API_KEY"):
        params.api_keys = [key]
    if args.chat_template_file:
        with open(args.chat_template_file) as file:
            params.chat_template = file.read()
    params.use_jinja = True  # the file's chat template rendered as transformers renders it (Jinja)
    params.ui = False  # the API only, as the other engines
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # loads the model and listens; serves until deleted
    print(f"llamacpp_server: serving {args.model} as '{args.alias}' on {server.listening_address}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
