"""The trainer's side of the rollout engine (common/rollout/vllm_process.py, vLLM in its own environment): start and
stop the process, ask it for G samples per prompt, push the trainer's weights into it without a restart, and
prove after every push that the engine now computes what the trainer computes (the probe check).

The probe check: after a push the engine scores a fixed token sequence (the probe) and its log-probs must equal
the trainer's own on the same weights within `bound`; a push that did not take (the engine still on old weights,
a tensor skipped) stops the run with one line (WeightSyncError). Weights travel as one safetensors file in Hugging
Face names, written to shared memory (/dev/shm where it has room, else the temporary folder) and read in place by
the engine. Under LoRA (`lora_rank` > 0) the engine holds the base it started on, and a sync sends the adapter only:
a PEFT folder that becomes the engine's current adapter (a new id each sync); the probe check then runs through it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import WeightSyncError

ENGINE_SCRIPT = Path(__file__).with_name("vllm_process.py")
# The largest |engine - trainer| log-prob of the probe allowed after a sync, in float32. Measured on llm_tiny: ~1e-6
# (two fp32 implementations of the same model, vLLM's CPU kernels and PyTorch's), while a sync that skipped one
# tensor moved the probe by ~0.2 (docs/rl.md). 1e-4 leaves room for larger models and longer probes.
PROBE_BOUND = 1e-4


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the engine's log-prob of each generated token (vLLM's raw_logprobs)
    text: str
    finish_reason: str


@dataclass
class Group:
    prompt_token_ids: list[int]
    samples: list[Sample]


@dataclass
class SyncReport:
    gap: float  # max |engine - trainer| over the probe's log-probs
    bytes: int  # the safetensors file's size (under LoRA: the adapter's)
    write_s: float  # the trainer writing it
    load_s: float  # the engine loading it in place (vLLM's reload_weights)
    check_s: float  # the engine scoring the probe


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from a causal LM's logits [T, V] over `ids` [T], in float32."""
    return torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None].long()).squeeze(-1)


def weights_folder(nbytes: int) -> Path:
    """A new folder for one push's file: in shared memory (/dev/shm, a RAM file system) where it has room for it
    (a container's is often 64 MiB), else in the temporary folder."""
    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > nbytes + (64 << 20)
    return Path(tempfile.mkdtemp(prefix="kiln-rollout-", dir=shm if room else None))


@dataclass
class RolloutEngine:
    """vLLM on `export` in a separate process (`python`: vLLM's environment's interpreter). A context manager:
    `with RolloutEngine(export, python=..., log_path=...) as engine: ...` starts it and always stops it."""

    export: Path
    python: Path
    log_path: Path
    probe: list[int] = field(default_factory=list)  # token ids the sync check scores
    bound: float = PROBE_BOUND
    max_model_len: int = 256
    dtype: str = "float32"
    enforce_eager: bool = True
    cpu_kvcache_gib: int = 1
    seed: int = 0
    lora_rank: int = 0  # > 0: the engine serves LoRA adapters of up to this rank over its base; syncs send adapters
    startup_s: float = 420
    start_s: float = field(default=0.0, init=False)  # how long the last start took
    adapter_id: int = field(default=0, init=False)  # the engine's current adapter (0: none yet)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> RolloutEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def command(self) -> list[str]:
        cmd = [str(self.python), str(ENGINE_SCRIPT), "--model", str(self.export), "--dtype", self.dtype]
        cmd += ["--max-model-len", str(self.max_model_len), "--seed", str(self.seed)]
        cmd += ["--max-lora-rank", str(self.lora_rank)] if self.lora_rank > 0 else []
        return cmd + (["--enforce-eager"] if self.enforce_eager else [])

    def start(self) -> None:
        began = time.monotonic()
        # The export is a local folder: nothing is downloaded at run time.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.cpu_kvcache_gib), "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # Kiln's checkout is not vLLM's environment's business
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        try:
            self._read(self.startup_s, "start")
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - began

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                    proc.stdin.flush()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    def _read(self, timeout_s: float, what: str) -> dict:
        # The engine answers every request with one line; an empty read is the process gone.
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            if not ready:
                self._proc.kill()
            code = self._proc.wait()
            tail = Path(self.log_path).read_text()[-3000:]
            state = f"exited ({code})" if ready else f"gave no answer in {timeout_s:.0f} s"
            raise RuntimeError(f"the rollout engine {state} during {what}; its log ({self.log_path}):\n{tail}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"rollout engine: {answer.get('error')}")
        return answer

    def request(self, cmd: str, **body) -> dict:
        if self._proc is None:
            raise RuntimeError("the rollout engine is not running (start it first)")
        self._proc.stdin.write(json.dumps({"cmd": cmd, **body}) + "\n")
        self._proc.stdin.flush()
        return self._read(self.startup_s, cmd)

    def generate(
        self,
        prompts: list[list[int] | str],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | list[int] | None = None,
    ) -> list[Group]:
        """`n` samples for each prompt (token ids or text), with the engine's log-prob of every generated token.
        `seed`: one for every prompt, or one per prompt (vLLM seeds a prompt's i-th sample with its seed + i)."""
        settings = {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        answer = self.request("generate", prompts=prompts, stop=stop or [], seed=seed, **settings)
        return [Group(g["prompt_token_ids"], [Sample(**s) for s in g["samples"]]) for g in answer["groups"]]

    def score(self, ids: list[int]) -> list[float]:
        """The engine's log-prob of each of ids[1:] after the tokens before it."""
        return self.request("score", ids=[int(t) for t in ids])["logprobs"]

    def push(self, hf_state: dict[str, torch.Tensor]) -> tuple[int, float, float]:
        """Load `hf_state` (Hugging Face names, the export's) into the running engine in place; returns (bytes,
        seconds writing, seconds loading)."""
        from safetensors.torch import save_file

        began = time.perf_counter()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_state.items()}
        folder = weights_folder(sum(t.numel() * t.element_size() for t in tensors.values()))
        try:
            path = folder / "model.safetensors"
            save_file(tensors, str(path))
            size, wrote = path.stat().st_size, time.perf_counter()
            self.request("load_weights", path=str(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return size, wrote - began, time.perf_counter() - wrote

    def push_adapter(self, adapter: dict[str, torch.Tensor], config) -> tuple[int, float, float]:
        """Make a LoRA adapter (`adapter`: peft's saved names -> tensors; `config`: peft's LoraConfig) the running
        engine's current one: written as a PEFT folder (common/lora.py, as the export writes it), loaded under a new
        id, the one before it dropped; the base is not sent. Returns (the adapter file's bytes, seconds writing,
        seconds loading)."""
        from common.lora import write_adapter_folder

        if self.lora_rank <= 0:
            raise RuntimeError("the rollout engine was started without LoRA (lora_rank=0)")
        began = time.perf_counter()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
        folder = weights_folder(sum(t.numel() * t.element_size() for t in tensors.values()))
        try:
            write_adapter_folder(folder, tensors, config)
            size, wrote = (folder / "adapter_model.safetensors").stat().st_size, time.perf_counter()
            try:
                self.request("load_adapter", path=str(folder), id=self.adapter_id + 1)
            except RuntimeError as exc:
                if self._proc is None or self._proc.poll() is not None:
                    raise  # the engine is gone: its own error
                # vLLM refused the folder (a tensor missing, a shape it does not take): it keeps its old adapter
                raise WeightSyncError(
                    f"the rollout engine did not take the trainer's adapter: {exc} (log: {self.log_path})"
                ) from None
            self.adapter_id += 1
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return size, wrote - began, time.perf_counter() - wrote

    def sync(
        self, hf_state: dict[str, torch.Tensor], trainer_probe: torch.Tensor | list[float], adapter_config=None
    ) -> SyncReport:
        """Push `hf_state` (with `adapter_config`, peft's LoraConfig: a LoRA adapter in peft's names, push_adapter),
        then check that the engine's log-probs of the probe equal `trainer_probe` (the trainer's own on the same
        weights, token_logprobs over self.probe) within self.bound; WeightSyncError otherwise."""
        if adapter_config is None:
            size, write_s, load_s = self.push(hf_state)
        else:
            size, write_s, load_s = self.push_adapter(hf_state, adapter_config)
        began = time.perf_counter()
        gap = self.probe_gap(trainer_probe)
        report = SyncReport(gap, size, write_s, load_s, time.perf_counter() - began)
        if not gap <= self.bound:  # NaN fails too
            raise WeightSyncError(
                f"the rollout engine did not take the trainer's weights: its log-probs of the probe differ from "
                f"the trainer's by {gap:.3g} after the sync (bound {self.bound:g}; log: {self.log_path})"
            )
        return report

    def probe_gap(self, trainer_probe: torch.Tensor | list[float]) -> float:
        """max |engine - trainer| over the probe's log-probs."""
        if len(self.probe) < 2:
            raise ValueError("the probe needs at least two tokens")
        engine = torch.tensor(self.score(self.probe), dtype=torch.float64)
        trainer = torch.as_tensor(trainer_probe, dtype=torch.float64).flatten()
        if trainer.shape != engine.shape:
            raise ValueError(f"trainer probe log-probs have {trainer.numel()} values, the engine's {engine.numel()}")
        return (engine - trainer).abs().max().item()
