"""The rollout engine: vLLM on an LLM export folder, run with vLLM's own interpreter (.venv-serve's python, `make
serve-env`), driven by common/rollout/client.py over JSON lines (one request a line on stdin, one answer a line on
stdout; everything else the process prints goes to stderr), so the trainer's environment never imports vLLM.

Requests (`cmd`): `generate` (G samples per prompt with the sampling settings: token ids, text, the engine's
log-probs), `load_weights` (a folder of safetensors in Hugging Face names, loaded IN PLACE into the running engine:
vLLM's `reload_weights`, reached through `LLM.collective_rpc`), `load_adapter` (with `--max-lora-rank`: a PEFT LoRA
folder loaded as a new adapter, which `generate` and `score` then use; the one before it is dropped), `score` (the
log-probs of a fixed sequence: vLLM's prompt_logprobs), `stop`. Every answer has `ok`; a failed request answers
`{"ok": false, "error": one line}` and the engine keeps serving.

Imports only the standard library, torch and vLLM: this file runs outside Kiln's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing

# The LoRA adapter that `generate` and `score` use (load_adapter sets it): vLLM's LoRARequest, None for the base.
ADAPTER: dict = {"request": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the export folder (config.json, safetensors, tokenizer)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-lora-rank", type=int, default=0, help="> 0: LoRA enabled, adapters of up to this rank")
    return p.parse_args(argv)


def lora_settings(rank: int) -> dict:
    """LLM(...)'s LoRA keys for adapters of rank `rank` (0: none): one adapter at a time, vLLM's max_lora_rank the
    smallest of its allowed values (vllm/config/lora.py MaxLoRARanks) that holds it."""
    if rank <= 0:
        return {}
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise SystemExit(f"vLLM serves LoRA ranks up to {allowed[-1]}; this adapter's is {rank}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


def build_llm(args: argparse.Namespace):
    # One process: vLLM's engine core in this one (VLLM_ENABLE_V1_MULTIPROCESSING=0) and its worker too (the "uni"
    # executor), not three processes: on 2 CPU cores the start took ~10 s instead of ~31 s, and an engine that dies
    # leaves no orphan behind. Set before vLLM is imported.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    # raw_logprobs: the model's own log-softmax over the vocabulary (before temperature, top_p, penalties), the
    # quantity a trainer recomputes from the same weights; it is vLLM's default, named here so it stays so.
    return LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        logprobs_mode="raw_logprobs",
        distributed_executor_backend="uni",  # the model runs in this process (see main)
        **lora_settings(args.max_lora_rank),
    )


def prompt_input(prompt):
    """A prompt as vLLM takes it: token ids (a list of ints) or text."""
    return {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt


def generate(llm, req: dict) -> dict:
    from vllm import SamplingParams

    def sampling(seed):
        return SamplingParams(
            n=int(req.get("n", 1)),
            temperature=float(req.get("temperature", 1.0)),
            top_p=float(req.get("top_p", 1.0)),
            max_tokens=int(req["max_tokens"]),
            stop=req.get("stop") or None,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob only
        )

    # One seed for every prompt, or one per prompt (vLLM seeds a prompt's i-th sample with its seed + i).
    seed = req.get("seed")
    params = [sampling(s) for s in seed] if isinstance(seed, list) else sampling(seed)
    prompts = [prompt_input(p) for p in req["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=ADAPTER["request"])
    groups = []
    for out in outputs:
        samples = []
        for c in out.outputs:
            ids = list(c.token_ids)
            logprobs = [step[t].logprob for t, step in zip(ids, c.logprobs)]
            samples.append({"token_ids": ids, "logprobs": logprobs, "text": c.text, "finish_reason": c.finish_reason})
        groups.append({"prompt_token_ids": list(out.prompt_token_ids), "samples": samples})
    return {"groups": groups}


def score(llm, req: dict) -> dict:
    """The log-prob of each token of `ids` after the ones before it (len(ids) - 1 values)."""
    from vllm import SamplingParams

    ids = [int(t) for t in req["ids"]]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=ADAPTER["request"])
    return {"logprobs": [step[t].logprob for t, step in zip(ids[1:], out.prompt_logprobs[1:])]}


def load_weights(llm, req: dict) -> dict:
    """vLLM's in-place reload (vllm/model_executor/model_loader/reload/inplace.py) from the folder the trainer
    wrote: the running engine's parameters are overwritten where they are; nothing restarts. The prefix cache
    holds KV computed with the old weights: reset after the load."""
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": req["path"]})
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - start}


def load_adapter(llm, req: dict) -> dict:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) as the adapter `generate` and `score` use
    from now on: loaded at once under the id the trainer gives (a new one each sync: vLLM keeps an adapter by its id
    and would not read a folder again under an id it holds), then the one before it removed. The base stays."""
    from vllm.lora.request import LoRARequest

    start = time.perf_counter()
    new, old = int(req["id"]), ADAPTER["request"]
    request = LoRARequest(f"policy-{new}", new, req["path"])
    llm.llm_engine.add_lora(request)
    ADAPTER["request"] = request
    if old is not None and old.lora_int_id != new:
        llm.llm_engine.remove_lora(old.lora_int_id)
    return {"seconds": time.perf_counter() - start, "loaded": sorted(llm.llm_engine.list_loras())}


COMMANDS = {"generate": generate, "score": score, "load_weights": load_weights, "load_adapter": load_adapter}


def serve(llm, channel) -> None:
    def answer(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    answer({"ok": True, "event": "ready"})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        if cmd == "stop":
            answer({"ok": True})
            return
        if cmd not in COMMANDS:
            answer({"ok": False, "error": f"unknown command {cmd!r} (one of {', '.join(COMMANDS)}, stop)"})
            continue
        try:
            answer({"ok": True, **COMMANDS[cmd](llm, req)})
        except Exception as exc:  # noqa: BLE001 -- the engine keeps serving; the client raises the line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            answer({"ok": False, "error": f"{cmd}: {type(exc).__name__}: {first}"})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # vLLM and its libraries print to stdout: the answers keep the original stdout (a private copy, not inherited by
    # vLLM's engine-core process), and fd 1 becomes stderr (the client's log) for everything else.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    llm = build_llm(args)
    serve(llm, channel)
    # Nothing to hand back (one process, nothing on disk): skip the interpreter's and vLLM's teardown (~5 s on 2
    # cores) and exit at once.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
