"""GRPO in the LLM recipe (grpo.enabled): what LLMTrainer runs instead of next-token prediction. The objective and the
rewards are common/grpo.py's and common/rewards.py's; the rollout engine (vLLM in its own process) is
common/rollout/client.py's.

One optimizer step, on dp (FSDP2) x tp ranks (recipes/llm/config.py:check_grpo_layout refuses pp, cp, ep):

1. the step's prompts: ``trainer.grad_accum`` global micro-batches of ``trainer.micro_batch_size`` x dp prompts from
   the prompt shards (data/prepare_prompts.py), one global stream that every rank reads (as the LLM's loader: a
   layout-independent position, saved in every checkpoint as any loader's), dp rank r's prompts the rows r, r+dp, ...
   of each micro-batch;
2. every rank takes part in gathering the policy's whole weights (from the DTensors) and in the probe's forward;
   rank 0 pushes the weights into the running engine (RolloutEngine.sync) and checks the probe: the engine's
   log-probs of a fixed token sequence against the trainer's own (``sync/logprob_gap``; beyond 1e-4 the run stops);
3. rank 0 draws ``grpo.num_generations`` samples per prompt, once for the whole step (as TRL generates once per
   step), each prompt seeded from ``trainer.seed + step`` and its place in the step (sample_seeds: a resumed run, or
   another layout, draws the same samples at the same step), scores them and takes the advantages, and sends them
   to every rank (a failure there, a sync that did not take, stops every rank with its one line); each rank trains
   its prompts' whole groups (a prompt's G samples on one rank: the advantages need no communication), the tp ranks
   of a dp rank the same ones;
4. the rewards (common/rewards.py), the group-normalized advantages and the loss (common/grpo.py), one forward and
   backward per micro-batch. The old log-probs the ratio is taken against: at ``grpo.temperature`` 1 the engine's
   (vLLM's raw log-probs); at any other temperature the trainer's own forward before the update, as TRL takes them
   when it steps once per generation (the same forward as the loss's, detached: the engine's raw log-probs are not
   of logits / temperature).
   With ``grpo.beta`` > 0 the loss adds beta x the KL to a reference whose per-token log-probs of the samples are
   taken in the same step, under no_grad, at the sampling temperature: a frozen copy of the starting weights (as
   preference training builds it: model.init_from, else the seeded init, whatever the run resumed), or under
   finetune=lora the policy itself with its adapter off (no copy).

The engine starts once per run, after the model's weights are loaded (and resumed), on an export of them written to
RUN_DIR/rollout/start (removed when it stops), and stops at the end of training or on an error (LLMTrainer.fit).
Under finetune=lora it starts on model.init_from itself (the frozen base) with LoRA enabled, and every sync sends the
adapter only, as a PEFT folder that becomes the engine's current adapter; the probe check runs through it.
Its log is RUN_DIR/rollout/engine.log; every completion, with its prompt and rewards, is a line of
RUN_DIR/rollout/samples.jsonl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from common import faults
from common.config import TrainConfig
from common.distributed import broadcast_object
from common.errors import ConfigError, DataError, UserError
from common.grpo import completion_metrics, group_advantages, grpo_loss, token_logps, weighted_sum
from common.lora import adapters_disabled, is_adapter_key
from common.rewards import Rewards
from recipes.llm.lora import peft_adapter
from recipes.llm.preference import fill_start_weights

PROMPTS_FORMAT = "prompts"  # meta.json "format" of data/prepare_prompts.py's shards
PROBE_LEN = 32  # tokens of the fixed sequence the engine and the trainer score after every sync


def check_data(cfg: TrainConfig, meta: dict) -> None:
    """One line for prompt shards without grpo.enabled, other shards with it, or prompts that leave no room for
    grpo.max_completion_length in data.max_seq_len (the engine's context and the trainer's row)."""
    prompts, on = meta.get("format") == PROMPTS_FORMAT, cfg.grpo.enabled
    if prompts and not on:
        raise DataError(f"data.root={cfg.data.root} holds prompts: train them with grpo.enabled=true (docs/rl.md)")
    if on and not prompts:
        raise DataError(
            f"grpo.enabled=true trains on prompts; data.root={cfg.data.root} holds {meta.get('format') or 'text'} "
            "data: build prompts with python -m data.prepare_prompts"
        )
    if on and meta["longest_sample"] + cfg.grpo.max_completion_length > cfg.data.max_seq_len:
        raise DataError(
            f"data.root={cfg.data.root} holds prompts of up to {meta['longest_sample']} tokens: with "
            f"grpo.max_completion_length={cfg.grpo.max_completion_length} they need data.max_seq_len >= "
            f"{meta['longest_sample'] + cfg.grpo.max_completion_length} (it is {cfg.data.max_seq_len})"
        )


def decode_prompt(sample: dict) -> dict:
    """A raw shard sample -> ``{"ids": [token ids], "prompt": ..., <the row's other fields>}`` (data/prepare_prompts.py
    writes them). Module-level: picklable for the loader's workers."""
    ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
    return {"ids": ids.astype(np.int64).tolist(), **json.loads(sample["json"])}


@dataclasses.dataclass
class RolloutBatch:
    """A step's samples, laid for the policy's forward: ``ids`` [N, T] (prompt then completion, right-padded),
    ``mask`` [N, T-1] on the targets that are completion tokens, ``old_logps`` [N, T-1] the engine's (None: the
    trainer's own, temperature != 1), ``advantages`` [N]."""

    ids: torch.Tensor
    mask: torch.Tensor
    old_logps: torch.Tensor | None
    advantages: torch.Tensor
    prompts: int
    tokens: int  # prompt and completion tokens, padding left out


def sample_seeds(step_seed: int, prompts: int, generations: int) -> list[int]:
    """The step's seed per prompt, from ``trainer.seed + step``: vLLM seeds sample i of a prompt with its seed + i, so
    the seeds are spaced by ``generations`` and no two samples of a run share one (below 65,537 prompts a step)."""
    return [(step_seed * 65_537 + j) * generations for j in range(prompts)]


def lay_samples(rows: list[tuple[list[int], list[int], list[float]]], pad_id: int, multiple: int = 1):
    """(ids [N, T], completion mask [N, T-1], engine log-probs [N, T-1]) of (prompt ids, completion ids, log-probs);
    T padded up to a multiple of ``multiple`` (tensor parallelism splits the sequence between its regions)."""
    width = -(-max(len(p) + len(c) for p, c, _ in rows) // multiple) * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    logps = torch.zeros(len(rows), width - 1)
    for i, (prompt, completion, lp) in enumerate(rows):
        p, c = len(prompt), len(completion)
        ids[i, : p + c] = torch.tensor(prompt + completion)
        mask[i, p - 1 : p - 1 + c] = 1.0  # target t+1 is predicted at position t
        logps[i, p - 1 : p - 1 + c] = torch.tensor(lp, dtype=torch.float32)
    return ids, mask, logps


@dataclasses.dataclass
class Rollout:
    """What rank 0 sends every rank once a step: the step's samples in prompt order (prompt ids, completion ids, the
    engine's log-probs), their advantages, and the step's metrics (rewards, completions, the sync, seconds)."""

    samples: list[tuple[list[int], list[int], list[float]]]
    advantages: torch.Tensor
    metrics: dict[str, float]


class GRPOTraining:
    """What LLMTrainer runs when grpo.enabled (recipes/llm/train.py): prepare_step (sync, generate, score), loss,
    metrics."""

    def __init__(self, trainer, build_model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.trainer, self.cfg = trainer, trainer.cfg.grpo
        # grpo.beta > 0: the KL's reference, a frozen copy of the starting weights (under LoRA: the policy with its
        # adapter off, reference_logps)
        self.reference: torch.nn.Module | None = None
        if self.cfg.beta > 0 and not trainer.lora:
            self.reference = build_model(trainer.args, trainer.cfg, trainer.mesh, trainer.device)
            fill_start_weights(self.reference, trainer.args, trainer.cfg, trainer.dist.is_main)
            self.reference.requires_grad_(False)
            self.reference.eval()
        self.rewards = Rewards.from_config(trainer.cfg.reward, self.cfg.max_completion_length)
        gen = torch.Generator().manual_seed(0)
        self.probe = torch.randint(0, trainer.args.vocab_size, (PROBE_LEN,), generator=gen).tolist()
        self.engine = None
        # finetune=lora: the adapter's peft LoraConfig, which every sync's folder carries (None: whole weights)
        self.adapter_config = self.adapter(get_model_state_dict(trainer.model))[1] if trainer.lora else None
        self.started = False  # the engine started (on rank 0); every rank keeps the flag
        self.metrics: dict[str, float] = {}
        self.loss_metrics: list[dict[str, float]] = []  # grpo_loss's, one per micro-batch of the step
        self.prepared_at = 0.0
        self.gather_s = 0.0  # the last sync's trainer side (on_rank0)

    # ---- the engine ------------------------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights (Kiln's names) gathered from the DTensors: a collective, every rank calls it;
        rank 0 holds them, on the host (the other ranks get an empty dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.trainer.model, options=options)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights in Hugging Face names (what the export writes): collective, rank 0's."""
        from recipes.llm.hf_adapter import to_hf_state_dict

        tr = self.trainer
        full = self.full_state()
        if not tr.dist.is_main:  # the gathered weights are rank 0's
            return {}
        return self.adapter(full)[0] if tr.lora else to_hf_state_dict(full, tr.args)

    def adapter(self, state: dict[str, torch.Tensor]):
        """(the adapter's tensors in peft's names, peft's LoraConfig) of a LoRA policy's state dict."""
        tr = self.trainer
        adapter = {k: v for k, v in state.items() if is_adapter_key(k)}
        return peft_adapter(adapter, tr.args, tr.cfg.lora, tr.cfg.model.init_from)

    def start_engine(self, full: dict[str, torch.Tensor]) -> None:
        """vLLM, on rank 0, on an export of ``full`` (full_state()): the weights the run starts from (after a resume,
        the checkpoint's); under LoRA on model.init_from (the frozen base), LoRA enabled: the first sync sends the
        adapter."""
        from common.rollout.client import RolloutEngine
        from common.rollout.venv import serve_venv

        tr = self.trainer
        python = serve_venv() / "bin" / "python"
        if not python.exists():
            raise ConfigError(f"grpo.enabled=true needs vLLM's environment ({python} is missing): run make serve-env")
        (tr.run_dir / "rollout").mkdir(parents=True, exist_ok=True)
        folder = Path(tr.cfg.model.init_from) if tr.lora else self.write_start(full)
        engine = RolloutEngine(
            folder,
            python=python,
            log_path=tr.run_dir / "rollout" / "engine.log",
            probe=self.probe,
            max_model_len=tr.cfg.data.max_seq_len,
            seed=tr.cfg.trainer.seed,
            lora_rank=tr.cfg.lora.rank if tr.lora else 0,
        )
        engine.start()
        self.engine = engine
        print(f"kiln: grpo: rollout engine started in {engine.start_s:.1f} s (log: {engine.log_path})", flush=True)

    def write_start(self, full: dict[str, torch.Tensor]) -> Path:
        """RUN_DIR/rollout/start: the export of the policy's whole weights (``full``) the engine starts on."""
        from recipes.llm.export import write_export

        tr = self.trainer
        folder = tr.run_dir / "rollout" / "start"
        shutil.rmtree(folder, ignore_errors=True)
        write_export(full, tr.args, tr.cfg, folder, tokenizer=tr.tokenizer)
        return folder

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop()
            if not self.trainer.lora:  # the start's export, read once by the engine (under LoRA: model.init_from)
                shutil.rmtree(engine.export, ignore_errors=True)

    @torch.no_grad()
    def probe_logps(self) -> torch.Tensor:
        from common.rollout.client import token_logprobs

        tr = self.trainer
        ids = torch.tensor(self.probe, device=tr.device)
        training, _ = tr.model.training, tr.model.eval()  # the engine's forward: no LoRA dropout
        try:
            return token_logprobs(tr.model(ids[None])[0], ids).cpu()
        finally:
            tr.model.train(training)

    # ---- the step ---------------------------------------------------------------------------------
    def on_rank0(self, work, what: str):
        """Every rank gathers the weights and scores the probe (collectives); rank 0 starts the engine the first time
        and runs ``work(state, probe)`` with it; its result, or its error, reaches every rank, which raises it: one
        line, and no rank left waiting."""
        tr = self.trainer
        start = None if self.started else self.full_state()
        self.started = True
        began = time.perf_counter()
        state, probe = self.hf_state(), self.probe_logps()
        self.gather_s = time.perf_counter() - began  # the sync's trainer side: the weights gathered, the probe scored
        result = failure = None
        if tr.dist.is_main:
            try:
                if start is not None:
                    self.start_engine(start)
                result = work(state, probe)
            except Exception as exc:  # sent to every rank: a user's error as it is, any other named in one line
                failure = exc
                result = exc if isinstance(exc, UserError) else RuntimeError(f"rank 0's {what} failed: {exc!r}")
                self.close()  # before the other ranks hear of it: they stop at once, rank 0 then has its line to say
        result = broadcast_object(result)
        if isinstance(result, Exception):
            raise failure or result
        return result

    def prepare_step(self, micro: list[list[dict]]) -> list[RolloutBatch]:
        """The step's micro-batches of prompts (each a global micro-batch) -> this rank's RolloutBatch of each: rank 0
        syncs, generates once for the step and scores (rollout), every rank gets the samples back (on_rank0)."""
        prompts = [p for rows in micro for p in rows]
        rollout = self.on_rank0(lambda state, probe: self.rollout(prompts, state, probe), "rollout")
        self.metrics = rollout.metrics
        self.prepared_at = time.perf_counter()
        batches, first = [], 0
        for rows in micro:
            batches.append(self.local_batch(rollout, first, len(rows)))
            first += len(rows)
        return batches

    def rollout(self, prompts: list[dict], state: dict[str, torch.Tensor], probe: torch.Tensor) -> Rollout:
        """Rank 0: sync, generate, score the step's prompts: the samples with their advantages and metrics."""
        tr, g = self.trainer, self.cfg
        step = tr.state.step + 1
        began = time.perf_counter()
        sync = self.engine.sync(faults.pushed_weights(step, state), probe, self.adapter_config)
        synced = time.perf_counter()
        groups = self.engine.generate(
            [p["ids"] for p in prompts],
            n=g.num_generations,
            max_tokens=g.max_completion_length,
            temperature=g.temperature,
            top_p=g.top_p,
            seed=sample_seeds(tr.cfg.trainer.seed + step, len(prompts), g.num_generations),
        )
        generated = time.perf_counter()
        samples = [(row, group, s) for row, group in zip(prompts, groups) for s in group.samples]
        per_function = self.score(samples)
        scored = time.perf_counter()
        self.log_samples(step, samples, per_function)
        advantages, zero_std = group_advantages(
            weighted_sum(per_function, self.rewards.weights), g.num_generations, g.scale_rewards
        )
        lengths = [len(s.token_ids) for _, _, s in samples]
        metrics = {
            **self.rewards.metrics(per_function, zero_std),
            **completion_metrics(lengths, [s.finish_reason == "stop" for _, _, s in samples]),
            "advantages/mean": advantages.mean().item(),
            "advantages/std": advantages.std().item(),
            "num_tokens_generated": float(sum(lengths)),
            "sync/logprob_gap": sync.gap,
            "sync/bytes": float(sync.bytes),
            "sync/gather_s": self.gather_s,
            "sync/write_s": sync.write_s,
            "sync/load_s": sync.load_s,
            "sync/check_s": sync.check_s,
            "time/sync_s": self.gather_s + synced - began,
            "time/generate_s": generated - synced,
            "time/reward_s": scored - generated,
        }
        laid = [(list(gr.prompt_token_ids), list(s.token_ids), list(s.logprobs)) for _, gr, s in samples]
        return Rollout(laid, advantages, metrics)

    def local_batch(self, rollout: Rollout, first: int, prompts: int) -> RolloutBatch:
        """This rank's share of the micro-batch of ``prompts`` prompts from the step's prompt ``first``: the whole
        groups of its dp rank's prompts (rows r, r+dp, ...), the same on the tp ranks of a dp rank."""
        tr, n = self.trainer, self.cfg.num_generations
        mine = [first + j for j in range(tr.dp_rank, prompts, tr.dims.dp)]
        picked = [i * n + k for i in mine for k in range(n)]
        rows = [rollout.samples[i] for i in picked]
        ids, mask, logps = lay_samples(rows, tr.pad_id, multiple=tr.dims.tp)
        old = logps if self.cfg.temperature == 1.0 else None
        tokens = sum(len(p) + len(c) for p, c, _ in rows)
        return RolloutBatch(ids, mask, old, rollout.advantages[picked], len(mine), tokens)

    def score(self, samples: list) -> torch.Tensor:
        """[N, F] rewards: each function called once on the step's completions with every field of their prompts."""
        fields = sorted({k for row, _, _ in samples for k in row if k not in ("ids", "prompt")})
        return self.rewards.score(
            [s.text for _, _, s in samples],
            prompts=[row.get("prompt") for row, _, _ in samples],
            completion_ids=[list(s.token_ids) for _, _, s in samples],
            **{k: [row.get(k) for row, _, _ in samples] for k in fields},
        )

    def log_samples(self, step: int, samples: list, per_function: torch.Tensor, file: str = "samples.jsonl") -> None:
        """Each completion of the step with its prompt and rewards, one JSON line each in RUN_DIR/rollout/samples.jsonl
        (TRL's completions table; the held-out evaluation's: eval_samples.jsonl)."""
        names = [n.rpartition(":")[2] for n in self.rewards.names]
        with open(self.trainer.run_dir / "rollout" / file, "a") as out:
            for (row, _, s), values in zip(samples, per_function.tolist()):
                rewards = {n: None if v != v else v for n, v in zip(names, values)}  # NaN: the function said None
                line = {"step": step, "prompt": row.get("prompt"), "completion": s.text, "token_ids": s.token_ids}
                out.write(json.dumps(line | {"rewards": rewards}) + "\n")

    # ---- the held-out evaluation (trainer.eval) ---------------------------------------------------
    def evaluate(self, prompts: list[dict]) -> dict[str, float]:
        """The held-out reward of the policy's current weights: pushed into the engine (the probe check as every
        step's), which answers each of ``prompts`` (the val split's) once, greedily (temperature 0, seeded with
        trainer.seed), scored by reward.functions. ``eval/reward`` is the weighted sum's mean (as ``reward``),
        ``eval/rewards/<function>/mean`` each function's; every answer is a line of RUN_DIR/rollout/eval_samples.jsonl
        with the step it was taken at (0: the weights the run started from). Every rank calls it (on_rank0)."""
        return self.on_rank0(lambda state, probe: self.answer_held_out(prompts, state, probe), "evaluation")

    def answer_held_out(self, prompts: list[dict], state: dict[str, torch.Tensor], probe: torch.Tensor) -> dict:
        """Rank 0: evaluate's sync, answers and rewards."""
        tr = self.trainer
        sync = self.engine.sync(state, probe, self.adapter_config)
        groups = self.engine.generate(
            [p["ids"] for p in prompts],
            n=1,
            max_tokens=self.cfg.max_completion_length,
            temperature=0.0,
            seed=tr.cfg.trainer.seed,
        )
        samples = [(row, group, s) for row, group in zip(prompts, groups) for s in group.samples]
        per_function = self.score(samples)
        self.log_samples(tr.state.step, samples, per_function, file="eval_samples.jsonl")
        metrics = self.rewards.metrics(per_function, torch.zeros(len(samples)))
        means = {f"eval/{k}": v for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean")}
        return {
            "eval/reward": metrics["reward"],
            **means,
            "eval/num_prompts": len(prompts),
            "eval/sync/logprob_gap": sync.gap,
        }

    def count(self, batch: RolloutBatch) -> int:
        """What the loss is summed over, so that the step's division by the global count (every micro-batch on every
        dp rank) gives common/grpo.py's loss with TRL's scaling: completion tokens (dapo: the step's tokens), the
        completions (grpo, dr_grpo: the micro-batches hold as many each, so their mean / grad_accum is the mean over
        the step's completions), one (bnpo: each micro-batch's token mean, then the mean over the micro-batches and dp
        ranks, as TRL divides it by grad_accum and DDP averages the ranks)."""
        if self.cfg.loss_type == "dapo":
            return int(batch.mask.sum().item())
        if self.cfg.loss_type == "bnpo":
            return 1
        return batch.ids.shape[0]

    def tally(self, batch: RolloutBatch) -> dict[str, int]:
        return {"samples": batch.prompts, "tokens": batch.tokens, "slots": batch.ids.numel()}

    def loss(self, batch: RolloutBatch) -> torch.Tensor:
        """The loss times count(batch) (the step divides by it), the policy's forward at the sampling temperature."""
        tr, device = self.trainer, self.trainer.device
        ids, mask = batch.ids.to(device), batch.mask.to(device)
        with tr.objective.forward():
            logits = tr.model(ids)
        logps = token_logps(logits[:, :-1], ids[:, 1:], self.cfg.temperature)
        old = logps.detach() if batch.old_logps is None else batch.old_logps.to(device)
        ref = self.reference_logps(ids) if self.cfg.beta > 0 else None
        loss, metrics = grpo_loss(self.cfg, logps, old, batch.advantages.to(device), mask, ref)
        self.loss_metrics.append(metrics)
        return loss * self.count(batch)

    @torch.no_grad()
    def reference_logps(self, ids: torch.Tensor) -> torch.Tensor:
        """The KL reference's per-token log-probs of ``ids`` [N, T] at the sampling temperature (as TRL takes them):
        the frozen start, or under LoRA the policy with its adapter off."""
        tr = self.trainer
        model = tr.model if self.reference is None else self.reference
        with adapters_disabled(model) if tr.lora else contextlib.nullcontext(), tr.objective.forward():
            logits = model(ids)
        return token_logps(logits[:, :-1], ids[:, 1:], self.cfg.temperature)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """The step's metrics (rank 0's rollout: already the whole step's) and grpo_loss's, as TRL logs them: per
        micro-batch over the dp ranks (means averaged, clip_ratio/low_min the least, high_max the most), then the mean
        over the micro-batches. Collective under dp (every rank calls it, every step)."""
        out, self.metrics = self.metrics, {}
        per_micro, self.loss_metrics = self.loss_metrics, []
        out |= self.reduce_loss_metrics(per_micro)
        out["time/train_s"] = time.perf_counter() - self.prepared_at
        return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in out.items()}

    def reduce_loss_metrics(self, per_micro: list[dict[str, float]]) -> dict[str, float]:
        import torch.distributed as tdist

        if not per_micro:
            return {}
        names = list(per_micro[0])
        tr = self.trainer
        values = torch.tensor([[m[k] for k in names] for m in per_micro], dtype=torch.float64, device=tr.device)
        if tr.dims.dp > 1:
            group = tr.mesh["dp"].get_group()
            low, high = names.index("clip_ratio/low_min"), names.index("clip_ratio/high_max")
            means = values.clone()
            tdist.all_reduce(means, group=group)
            lows, highs = values[:, low].clone(), values[:, high].clone()
            tdist.all_reduce(lows, op=tdist.ReduceOp.MIN, group=group)
            tdist.all_reduce(highs, op=tdist.ReduceOp.MAX, group=group)
            values = means / tr.dims.dp
            values[:, low], values[:, high] = lows, highs
        return dict(zip(names, values.mean(0).tolist()))  # [micro, metric] -> the micro-batches' mean
