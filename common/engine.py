"""The engine under every recipe: what runs a micro-batch's backward, clips, steps the optimizer and its LR
schedule, and saves/loads the model and optimizer. Two implementations, one contract:

    DeepSpeedEngine   DeepSpeed ZeRO 0-3 (the DiT, the VLM)
    NativeEngine      PyTorch's own: FSDP2 / tensor parallelism / pipeline parallelism, DCP checkpoints (the LLM)

The common Trainer (common/trainer.py) drives either one the same way, once per optimizer step:

    for each micro-batch: loss_sum = engine.forward_backward(loss, batch, inv_count, last=...)
    norm = engine.clip_grad_norm()      # None where the optimizer computes it inside its step
    (the Trainer reads the host once: is the norm finite, did a rank get a stop signal)
    norm = engine.step(skip=...)        # the one optimizer step of this engine

Gradients are those of (summed loss over the global batch) / (its count of tokens or samples): the Trainer
passes `inv_count` = 1 / global count, and each engine undoes its own averaging over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from abc import ABC, abstractmethod
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as tdist
from torch import nn

from common import deepspeed as ds
from common.config import TrainConfig
from common.optim import adamw_kernel, lr_factor
from common.parallel_dims import CPGroups, batch_mesh
from common.profiling import StepTimer
from common.toggles import unwrapped_name
from common.ulysses import UlyssesGroups


class Engine(ABC):
    """`model` is what a recipe's loss calls (DeepSpeed: its engine, which gathers ZeRO-3 partitions);
    `module` holds the parameters (evaluation, export). `extras` are stateful parts a checkpoint's
    TrainState carries for the engine (the native LR schedule)."""

    model: nn.Module
    module: nn.Module
    dp: int
    extras: dict = {}
    scratch: Path | None = None  # a folder every rank sees, for a conversion on load (the Trainer sets it)

    @abstractmethod
    def forward_backward(
        self, loss: Callable, batch, inv_count: torch.Tensor, last: bool, timer: StepTimer
    ) -> torch.Tensor:
        """`loss(batch)` (a summed loss), its backward scaled to the global mean, and the detached sum.
        `last`: the step's last micro-batch (gradients are reduced across ranks then)."""

    @abstractmethod
    def clip_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm, clipped to optim.grad_clip, as a device tensor; None where the
        optimizer computes and clips it inside `step` (then `step` returns it)."""

    @abstractmethod
    def step(self, skip: bool = False) -> torch.Tensor | float | None:
        """The optimizer and LR step (none with `skip`), gradients cleared; the norm where `clip_grad_norm` gave
        None."""

    @property
    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, *, loss: bool = False) -> torch.Tensor:
        """Sum `t` over the data-parallel ranks in place (a device collective, not read). `loss`: a loss
        that only a pipeline's last stage computed (summed over the stages too)."""

    @abstractmethod
    def save(self, tmp: Path) -> None:
        """Collective: this rank's share of the model and optimizer state into checkpoint dir `tmp`."""

    def save_async(self, tmp: Path, group) -> Future:
        """Collective: `save`, with the state copied to host memory first and written in the background on process
        group `group`; the Future completes when the write is. Only engines that can (config.py refuses the rest)."""
        raise RuntimeError(
            f"{type(self).__name__} saves synchronously: checkpoint.async_save=true is refused for it at "
            "composition (common/config.py)"
        )

    @abstractmethod
    def load(self, path: Path) -> None:
        """Collective: the model and optimizer state from checkpoint dir `path`."""

    @abstractmethod
    def layout(self) -> dict:
        """What a checkpoint records of the layout that wrote it (meta.json)."""


# ---- DeepSpeed ----------------------------------------------------------------------------------
class DeepSpeedEngine(Engine):
    """DeepSpeed over the model's trainable parameters (`common/deepspeed.py` derives its config).

    Kiln owns the accumulation boundary (`set_gradient_accumulation_boundary`): one backward per
    micro-batch, gradients reduced after the last one, and `engine.step()` called once per optimizer step.

    `cp` (parallel.cp > 1; common/parallel_dims.py CPGroups, as NativeEngine's): the cp ranks of each of the `dp`
    groups split every sample's tokens; DeepSpeed gets them as its sequence-parallel groups (common/ulysses.py
    UlyssesGroups: gradients summed over cp, averaged over dp; ZeRO over both)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, dp: int, cp: CPGroups | None = None):
        self.ds = ds.initialize(model, cfg, dp, mpu=None if cp is None else UlyssesGroups(cp))
        self.model, self.module, self.dp = self.ds, self.ds.module, dp
        self.cp = cp
        self.zero_stage = self.ds.zero_optimization_stage()  # 0 on one rank (common/deepspeed.py zero_stage)
        # finetune=lora: checkpoints hold what trains (the adapter, a VLM's projector) and its optimizer state; the
        # frozen base comes from its source on every start (common/lora.py checks a resume's base).
        self.frozen_in_checkpoints = cfg.finetune != "lora"

    def forward_backward(self, loss, batch, inv_count, last, timer):
        self.ds.set_gradient_accumulation_boundary(last)
        with timer.phase("forward"):
            loss_sum = loss(batch)
        with timer.phase("backward"):
            # DeepSpeed averages gradients over dp: `dp / global count` leaves the global mean.
            self.ds.backward(loss_sum * (inv_count * self.dp).to(loss_sum.dtype), scale_wrt_gas=False)
        return loss_sum.detach()

    def clip_grad_norm(self):
        # ZeRO-0 in fp32 only: the gradients sit whole on p.grad (DeepSpeed clips them in its step);
        # every other stage and precision computes, clips and checks the norm in `step`.
        return ds.full_grad_norm(self.ds)

    def step(self, skip=False):
        self.ds.optimizer.kiln_skip = skip  # ZeRO-0 fp32: common/deepspeed.py's pre-hook drops the gradients
        self.ds.step()
        return ds.grad_norm(self.ds)

    @property
    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def all_reduce(self, t, *, loss=False):
        if self.cp is not None:  # the cp ranks of a group hold the same samples and the same (whole) loss
            tdist.all_reduce(t, group=self.cp.dp_group)
        elif tdist.is_initialized() and tdist.get_world_size() > 1:
            tdist.all_reduce(t)
        return t

    def save(self, tmp):
        self.ds.save_checkpoint(
            str(tmp.parent), tag=tmp.name, save_latest=False, exclude_frozen_parameters=not self.frozen_in_checkpoints
        )

    def load(self, path):
        """Any ZeRO stage and number of ranks: another layout than this run's is converted (common/deepspeed.py)."""
        ds.load_checkpoint(
            self.ds, path, scratch=self.scratch or path.parent / ".tmp", strict=self.frozen_in_checkpoints
        )

    def layout(self):
        cp = {} if self.cp is None else {"cp": self.cp.cp}
        return {"zero_stage": self.zero_stage, **cp, "trained_shapes": ds.trained_shapes(self.ds)}

    def gathered(self):
        """Full weights on every rank for the duration (ZeRO-3 partitions them)."""
        return ds.gathered(self.module, self.zero_stage)


# ---- PyTorch-native: FSDP2 / TP / PP + DCP ---------------------------------------------------------
# Optimizer state keyed per parameter FQN ("param_groups.<fqn>.lr", ...). Nested, `param_groups` is
# one object that DCP saves from a single rank: under pipeline parallelism each stage's groups name
# different parameters, and the other stages would load groups without their hyperparameters.
# Frozen parameters (a LoRA run's base) are not the run's state: they come from their source (model.init_from)
# on every start, so a checkpoint holds what trains and its optimizer state only.


@functools.cache
def _flat_optim():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)


class NativeEngine(Engine):
    """AdamW + Kiln's LR schedule over an already parallelized model on a ("pp", "dp", "tp") mesh.

    The recipe's loss runs its forward in its own contexts (autocast, loss parallel: recipes/llm/loss.py);
    `backward_context`: the context its backward needs (torch's loss_parallel). A pipeline schedule runs forward
    and backward itself: the recipe calls it instead of `forward_backward`, with `grad_scale(inv_count)`.
    `tied`: tied embeddings held by two pipeline stages (gradients summed before clipping, one copy left out of
    the norm). `cp` (parallel.cp > 1; common/parallel_dims.py CPGroups, as DeepSpeedEngine's): the mesh's cp groups,
    None without context parallelism."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        mesh,
        *,
        cp: CPGroups | None = None,
        tied=None,
        backward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        o = cfg.optim
        self.model = self.module = model
        self.mesh, self.tied, self.backward_context = mesh, tied, backward_context
        self.dp, self.tp, self.pp = mesh["dp"].size(), mesh["tp"].size(), mesh["pp"].size()
        # The ranks that split a step's tokens (dp, x cp under context parallelism): FSDP2 averages the gradients
        # over them, and the loss and its token count are summed over them.
        self.batch = batch_mesh(mesh)
        self.cp = cp
        if (1 if cp is None else cp.cp) != self.batch.size() // self.dp:  # the mesh's own groups, or none
            raise ValueError(f"the mesh has cp={self.batch.size() // self.dp}: pass cp=CPGroups.of(mesh)")
        self.ep = getattr(cfg.parallel, "ep", 1)  # the experts' gradients live on their own ("edp", "ep") mesh
        self.grad_clip = o.grad_clip or float("inf")
        device = next(iter(model.parameters())).device
        # Only what trains (a LoRA run: the adapter) reaches the optimizer: no state for a frozen base.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **adamw_kernel(device)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_factor, cfg=o, max_steps=cfg.trainer.max_steps)
        )
        self.extras = {"scheduler": self.scheduler}
        self._stager = None  # async saves' host copy, reused save after save

    def grad_scale(self, inv_count: torch.Tensor) -> torch.Tensor:
        """What a loss sum is multiplied by before its backward: FSDP averages gradients over dp (x cp)."""
        return inv_count * self.batch.size()

    def forward_backward(self, loss, batch, inv_count, last, timer):
        with timer.phase("forward"):
            loss_sum = loss(batch)
        with timer.phase("backward"), self.backward_context():
            (loss_sum * self.grad_scale(inv_count).to(loss_sum.dtype)).backward()
        return loss_sum.detach()

    def clip_grad_norm(self):
        if self.tied is not None:
            self.tied.all_reduce_grads()
        params = list(self.model.parameters())
        if self.pp == 1 and self.ep == 1:  # one mesh: DTensor's own norm
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return clip_grad_norm_(
            params,
            self.grad_clip,
            dp_group=self.batch.get_group() if self.ep > 1 else None,  # DTensors on two meshes
            pp_group=self.mesh["pp"].get_group() if self.pp > 1 else None,  # every stage's gradients
            skip=self.tied.norm_skip if self.tied is not None else None,
        )

    def step(self, skip=False):
        if not skip:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def all_reduce(self, t, *, loss=False):
        if self.batch.size() > 1:
            tdist.all_reduce(t, group=self.batch.get_group())
        if loss and self.pp > 1:  # only the last stage computed it
            tdist.all_reduce(t, group=self.mesh["pp"].get_group())
        return t

    def _state(self) -> dict:
        """What a checkpoint holds: the trained weights and their optimizer state, as DCP saves and loads them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_flat_optim())
        return {"model": self._trained(model_sd), "optim": optim_sd}

    def save(self, tmp):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(tmp / "dcp"))

    def save_async(self, tmp, group):
        """DCP's async save: the state is staged (copied) to host memory before this returns -- pinned memory on
        CUDA, a plain copy on CPU (pinning needs CUDA) -- so training may change the weights while a thread writes."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
                )
            )
        return dcp.async_save(
            self._state(), checkpoint_id=str(tmp / "dcp"), process_group=group, async_stager=self._stager
        )

    def load(self, path):
        """DCP reshards: a checkpoint written under one (pp, dp, tp) layout loads under another."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        # Not strict: the frozen weights are not in a checkpoint (they are loaded from their source already).
        loaded = set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=dataclasses.replace(_flat_optim(), strict=False),
        )
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        if trainable & set(loaded.missing_keys):
            raise RuntimeError(f"{path} lacks trained weights: {sorted(trainable & set(loaded.missing_keys))[:3]}")

    def layout(self):
        cp = 1 if self.cp is None else self.cp.cp
        return {"layout": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": cp}}

    def _trained(self, model_sd: dict) -> dict:
        """`model_sd` without frozen weights. `ignore_frozen_params` drops them by `named_parameters()`, which names
        a tied weight once: a frozen tied output projection (`output.weight`) would stay in."""
        frozen = {
            unwrapped_name(name)
            for name, p in self.model.named_parameters(remove_duplicate=False)
            if not p.requires_grad
        }
        return {k: v for k, v in model_sd.items() if k not in frozen}


def clip_grad_norm_(
    params: list[nn.Parameter], max_norm: float, *, dp_group=None, pp_group=None, skip: nn.Parameter | None = None
) -> torch.Tensor:
    """Clip by the global norm of gradients that one DTensor norm cannot take.

    ``dp_group`` (expert parallelism): the gradients are DTensors on different meshes whose shards each cover their
    tensor once over the ranks that split the step's tokens (dp, under context parallelism dp x cp): the experts on
    ("edp", "ep"), the rest FSDP-sharded on the same ranks. DTensor ops take one mesh at a time (and a 2-D partial norm
    costs two all-reduces), so the local shards' squared norm is summed over those ranks by one all-reduce. Without
    it, the gradients share one mesh and DTensor reduces their norm.
    ``pp_group`` (pipeline parallelism): each rank holds only its stages' parameters; the squared norms are summed over
    the stages. ``skip``: a parameter whose gradient another stage already counts (a tied embedding's copy).
    Then each mesh's gradients are clipped on their own."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's Shard(0) on top of ep's Shard(0)

    grads = [p.grad for p in params if p.grad is not None and p is not skip]
    if dp_group is not None:
        dp = tdist.get_world_size(dp_group)
        for g in grads:
            if not (
                isinstance(g, DTensor)
                and g.device_mesh.size() == dp
                and all(isinstance(x, (Shard, _StridedShard)) for x in g.placements)
            ):
                raise RuntimeError(
                    f"a gradient {getattr(g, 'placements', 'not a DTensor')} is not sharded over the {dp} dp ranks"
                )
        sq = torch.nn.utils.get_total_norm([g.to_local() for g in grads], 2.0).float() ** 2
        tdist.all_reduce(sq, group=dp_group)
    else:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        sq = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
    if pp_group is not None:
        tdist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
