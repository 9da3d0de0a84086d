"""Pipeline parallelism for the LLM recipe (torch.distributed.pipelining, torchtitan-style manual split).

Split
    The model is cut into ``pp * v`` stages of consecutive layers (``v = 2`` virtual stages per
    rank for ``interleaved_1f1b``, else 1). Rank ``r`` of the ``pp`` mesh dimension owns stages
    ``r, r + pp, ...`` (the loop-style placement ScheduleInterleaved1F1B expects). Stage 0 keeps
    ``tok_embeddings``, the last stage keeps ``norm`` and ``output``.

    Each rank builds ONE meta ``Transformer`` and deletes every layer/end it owns in no stage: the
    "rank model". Because ``layers`` is a ModuleDict keyed by the global layer index, every FQN is
    unchanged, so the rank model is what the trainer parallelizes, initializes, optimizes and
    checkpoints (DCP merges the disjoint per-rank FQNs into one checkpoint that any layout --
    or ``scripts/export.py`` in one process -- can load). The per-stage modules handed to
    ``PipelineStage`` are thin ``Transformer`` views that *share* the rank model's submodules
    (one view per stage; for 1F1B/GPipe the single view holds everything the rank has).

Masking across stages
    Packed rows need per-document ``position_ids`` and the block-diagonal causal 4-D mask in
    every layer, i.e. in every stage. They are passed as keyword arguments of
    ``schedule.step(...)``: the schedule splits kwargs into microbatches along dim 0 like the
    positional input, and ``PipelineStage.forward_one_chunk`` gives each stage its microbatch's
    kwargs (only positional args travel stage to stage, over P2P). Every rank of a pipeline packs
    the same documents (the data stream is global and sliced by dp rank only), so each rank has
    the whole microbatch's mask and positions locally: nothing extra is sent, and the
    non-differentiable mask/positions never enter the P2P/backward path.

    With ``toggles.attention=flash`` no mask is built: the kwarg is ``row_segments`` (each row's
    segment lengths, a host tensor split by rows like the inputs) and each stage module
    (``_VarlenStage``) turns its microbatch's rows into that microbatch's own ``cu_seqlens`` /
    ``max_seqlen`` -- segments never cross rows, so a group of rows is a packed batch of its own --
    and hands them to the varlen kernel. They are computed on the host, so no step waits on the GPU.

    Under context parallelism (``parallel.cp``) each round's padded rows are cut into the cp rank's share
    before the schedule sees them (``shard_rows``: the rank's chunks of the ids and positions, each position's
    next-token target, the rank's rows of the mask), the same split as without pp. Every rank of a pipeline
    holds the same cp rank's chunks, so the stages pass ``[rows, L/cp, dim]`` hidden states as they pass
    ``[rows, L, dim]`` without cp; each stage module (``_ContextParallelStage``) wraps its microbatch's mask rows
    into the ``ContextParallelMask`` whose attention exchanges keys/values (or heads) with the other cp ranks
    of the same stage, which run the same schedule, so their collectives pair up.

Mixture of Experts
    The load-balancing loss pools the routing of every MoE layer, and the layers sit on different stages:
    each stage adds its layers' routing counts to those it received and sends them on beside the hidden
    state, and the totals come back from the last stage as those counts' gradient, in step with the
    microbatch's backward; each stage then puts its layers' share of the aux loss into its own backward
    (``_MoEStage``, ``_CarriedCounts``). The aux loss is thus taken per pipeline microbatch.

Fixed shapes
    ``PipelineStage`` infers the shapes of the tensors it sends/receives once (first step) and
    keeps those buffers. The microbatch shape is therefore fixed for the run:
    ``[rows_per_microbatch, max_seq_len]``, with ``rows_per_microbatch = ceil(micro_batch_size /
    M)`` (M = ``parallel.pp_microbatches``, 0 = pp). One schedule step ("round") processes
    ``M * rows_per_microbatch`` rows. The packed batch (FFD, as without PP) is padded with empty
    rows -- pad tokens, labels -100, position 0, a causal mask inside the row -- up to a whole
    number of rounds; the number of rounds is the max over all dp ranks (packed on the host from the
    global stream: recipes/llm/train.py:LLMTrainer.prepare), so the FSDP and P2P collectives stay
    matched. Gradients accumulate over rounds. Empty rows add compute but no loss: the loss is a
    token sum scaled by the step's global token count (common/engine.py), so the losses equal the
    non-pipelined run's.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as tdist
from torch import nn

from common.config import TrainConfig
from common.data.packing import IGNORE_INDEX, PackedBatch, cu_seqlens_of_rows
from common.parallel_dims import CPGroups
from recipes.llm.context_parallel import ContextParallelMask, shard_rows
from recipes.llm.data import real_token_mask
from recipes.llm.loss import NextTokenLoss
from recipes.llm.model import MoE, Segments, Transformer
from recipes.llm.moe_losses import MoEAux, RouterSums

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def virtual_stages(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def num_microbatches(cfg: TrainConfig) -> int:
    p = cfg.parallel
    return p.pp_microbatches or p.pp


def stage_layer_ids(n_layers: int, n_stages: int) -> list[list[int]]:
    """Consecutive layer indices per stage; the first ``n_layers % n_stages`` stages get one more."""
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_stages(pp_rank: int, pp: int, v: int) -> list[int]:
    """Loop placement: rank r owns stages r, r + pp, ..."""
    return [pp_rank + i * pp for i in range(v)]


def split_for_rank(model: Transformer, pp_rank: int, pp: int, v: int) -> Transformer:
    """Delete (in place) every layer and end this rank owns in no stage; FQNs are kept."""
    n_stages = pp * v
    layer_ids = stage_layer_ids(model.args.n_layers, n_stages)
    mine = rank_stages(pp_rank, pp, v)
    keep = {str(i) for s in mine for i in layer_ids[s]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if 0 not in mine:
        model.tok_embeddings = None
    if n_stages - 1 not in mine:
        model.norm = None
        model.output = None
    return model


def _stage_view(rank_model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A Transformer whose submodules are the rank model's own (shared, not copied)."""
    with torch.device("meta"):
        view = Transformer(rank_model.args)
    view.layers = nn.ModuleDict({str(i): rank_model.layers[str(i)] for i in layer_ids})
    view.tok_embeddings = rank_model.tok_embeddings if first else None
    view.norm = rank_model.norm if last else None
    view.output = rank_model.output if last else None
    view.rope_cache = rank_model.rope_cache
    return view


def pad_rows(
    packed: PackedBatch, num_rows: int, pad_id: int, attention: str = "sdpa", moe: bool = False
) -> dict[str, torch.Tensor]:
    """Inputs of ``packed`` grown to ``num_rows`` rows with empty rows (pad, -100, pos 0, one causal segment):
    input_ids, labels, position_ids and, by ``attention``, the dense ``attn_mask`` or (``flash``)
    ``row_segments``: the model's keyword names. ``moe``: also each row's ``real_tokens`` (bool, no padding) and
    ``labelled`` count, what the MoE stages' auxiliary losses take (:class:`_MoEStage`)."""
    extra = num_rows - packed.num_rows
    if extra < 0:
        raise ValueError(f"packed batch has {packed.num_rows} rows, more than {num_rows}")
    L = packed.row_len
    inputs = {"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids}
    fill = {
        "input_ids": torch.full((extra, L), pad_id, dtype=torch.long),
        "labels": torch.full((extra, L), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((extra, L), dtype=torch.long),
    }
    if attention == "flash":
        segments = packed.row_segments()
        inputs["row_segments"] = segments
        fill["row_segments"] = torch.zeros((extra, segments.shape[1]), dtype=segments.dtype)
        fill["row_segments"][:, 0] = L
    else:
        inputs["attn_mask"] = packed.attention_mask_4d()
        fill["attn_mask"] = torch.ones(L, L, dtype=torch.bool).tril().expand(extra, 1, L, L)
    if moe:
        inputs["real_tokens"], fill["real_tokens"] = real_token_mask(packed), torch.zeros((extra, L), dtype=torch.bool)
        inputs["labelled"] = (packed.labels != IGNORE_INDEX).sum(1)
        fill["labelled"] = torch.zeros(extra, dtype=torch.long)
    return {k: torch.cat([inputs[k], fill[k]]) for k in inputs}


class _VarlenStage(nn.Module):
    """A stage view fed ``row_segments`` (its microbatch's rows) instead of a mask: it derives the
    microbatch's ``cu_seqlens`` on the host and runs the view with them (the varlen kernel)."""

    def __init__(self, view: Transformer):
        super().__init__()
        self.view = view

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, row_segments: torch.Tensor) -> torch.Tensor:
        cu_seqlens, max_seqlen = cu_seqlens_of_rows(row_segments)
        segments = Segments(cu_seqlens.to(x.device, non_blocking=True), max_seqlen)
        return self.view(x, position_ids=position_ids, attn_mask=segments)


class _ContextParallelStage(nn.Module):
    """A stage view under context parallelism: fed the rank's rows of its microbatch's document + causal mask (a plain
    tensor, which the schedule splits by rows like the inputs), it runs the view with them as a
    ``ContextParallelMask`` over the cp group, whose attention exchanges keys/values (or heads) with the other cp
    ranks of the same stage."""

    def __init__(self, view: Transformer, group, method: str):
        super().__init__()
        self.view, self.group, self.method = view, group, method

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        mask = ContextParallelMask(attn_mask, self.group, self.method)
        return self.view(x, position_ids=position_ids, attn_mask=mask)


class _CarriedCounts(torch.autograd.Function):
    """A stage's routing counts added to those carried from the stages before, and, in the backward, the gradient of
    the stage's routing sums from the microbatch's totals (``aux_grads(totals, prob_sum, z_sum)``).

    The load-balancing loss pools every MoE layer's routing, on every stage: its gradient on one stage needs the
    counts of the later ones, known only once the microbatch has passed the last stage. The pipeline's one channel
    from a later stage back to an earlier one, in step with each microbatch's backward, is the gradient it sends:
    so the totals travel back AS the carried counts' gradient. The last stage holds the totals after its forward
    (``last``: it uses them and ignores the zero gradient its loss gives them); every stage hands them on as the
    gradient of the counts it received."""

    @staticmethod
    def forward(ctx, carried, counts, prob_sum, z_sum, aux_grads, last):
        total = carried + counts
        ctx.aux_grads, ctx.last = aux_grads, last
        ctx.save_for_backward(total, prob_sum, z_sum)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        total, prob_sum, z_sum = ctx.saved_tensors
        totals = total if ctx.last else grad_total
        grad_prob, grad_z = ctx.aux_grads(totals, prob_sum, z_sum) if ctx.aux_grads is not None else (None, None)
        return totals, None, grad_prob, grad_z, None, None


class _MoEStage(nn.Module):
    """A stage of an MoE model: it also carries the microbatch's routing counts (per expert, and the token count:
    ``[E + 1]``, global over dp) from stage to stage beside the hidden state, and puts its MoE layers' share of the
    auxiliary losses into the backward (:class:`_CarriedCounts`): the same loss and gradients as without pipeline
    parallelism, per pipeline microbatch (with one microbatch per step, exactly the non-pipelined step's).

    The last stage returns ``(logits, counts)``; ``Pipeline._loss_fn`` ties the counts into the loss by a zero term."""

    def __init__(
        self,
        inner: nn.Module,
        aux: MoEAux,
        ids: list[int],
        num_experts: int,
        first: bool,
        last: bool,
        pipeline: "Pipeline",
    ):
        super().__init__()
        self.inner, self.aux, self.ids, self.num_experts = inner, aux, ids, num_experts
        self.first, self.last, self.pipeline = first, last, pipeline
        self.stage = None  # its PipelineStage (set by Pipeline)

    def inferring(self) -> bool:
        """Whether this call is PipelineStage's shape inference: one forward (and backward) of the real module on
        placeholder inputs before the first microbatch, whose routing is no microbatch's (torch 2.13: the stage's
        output metadata is unset until it returns)."""
        meta = getattr(self.stage, "_stage_meta", None)  # older torch infers on meta tensors, without grad: see forward
        return meta is not None and meta.outputs is None

    def forward(
        self,
        x: torch.Tensor,
        carried: torch.Tensor | None = None,
        *,
        real_tokens: torch.Tensor,
        labelled: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.inner(x, **kwargs)
        if self.first:  # nothing counted yet; a leaf that requires grad, so that the counts are differentiable
            carried = torch.zeros(self.num_experts + 1, device=out.device, requires_grad=True)
        # No MoE layer on this stage, or no microbatch (shape inference), or no backward (eval): counts passed on.
        if not self.ids or self.inferring() or not torch.is_grad_enabled():
            counts, prob_sum, z_sum, aux_grads = torch.zeros_like(carried), None, None, None
        else:
            sums, weight = self.aux.routed(real_tokens.flatten(), labelled.sum().float(), self.ids)
            counts = torch.cat([sums.tokens_per_expert, sums.num_tokens.reshape(1)])
            prob_sum, z_sum = sums.prob_sum, sums.z_sum

            def aux_grads(totals, prob_sum, z_sum):  # this stage's share of the microbatch's aux loss
                leaves = prob_sum.detach().requires_grad_(), z_sum.detach().requires_grad_()
                with torch.enable_grad():
                    share = self.aux.loss(RouterSums(totals[:-1], *leaves, totals[-1]), weight)
                    grads = torch.autograd.grad(share * self.pipeline.grad_scale(share.dtype), leaves)
                self.pipeline.aux_sum += share.detach()
                return grads

        return out, _CarriedCounts.apply(carried, counts, prob_sum, z_sum, aux_grads, self.last)


class Pipeline:
    """The rank's PipelineStages and schedule over the (already parallelized, materialized) rank model."""

    def __init__(
        self,
        rank_model: Transformer,
        cfg: TrainConfig,
        mesh,
        device: torch.device,
        pad_id: int,
        loss: NextTokenLoss,
        moe_aux: MoEAux | None = None,
    ):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        p = cfg.parallel
        if p.pp_schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule must be one of {SCHEDULES}, got {p.pp_schedule!r}")
        self.pp, self.v = p.pp, virtual_stages(p.pp_schedule)
        self.m = num_microbatches(cfg)
        self.rows_per_microbatch = max(1, math.ceil(cfg.trainer.micro_batch_size / self.m))
        self.round_rows = self.m * self.rows_per_microbatch
        self.device, self.pad_id, self.loss = device, pad_id, loss
        self.pp_group = mesh["pp"].get_group()
        pp_rank = mesh["pp"].get_local_rank()
        n_stages = self.pp * self.v
        layer_ids = stage_layer_ids(rank_model.args.n_layers, n_stages)
        self.stage_ids = rank_stages(pp_rank, self.pp, self.v)
        self.is_first = 0 in self.stage_ids
        self.is_last = n_stages - 1 in self.stage_ids
        self.attention = cfg.toggles.attention
        self.moe = moe_aux is not None
        # Context parallelism: each round's rows are cut into this cp rank's share (shard_rows) before the schedule
        # splits them into microbatches; the stages of a pipeline hold the same cp rank's chunks.
        cp = CPGroups.of(mesh)
        self.cp, self.cp_rank, self.cp_method = (cp.cp, cp.cp_rank, p.cp_method) if cp else (1, 0, "")
        if self.attention == "flash":  # what turns a stage's microbatch mask input into what attention takes
            masked = _VarlenStage
        elif cp:
            masked = functools.partial(_ContextParallelStage, group=cp.cp_group, method=p.cp_method)
        else:
            masked = lambda view: view  # noqa: E731  (the dense mask as it is)

        def wrap(s: int) -> nn.Module:
            first, last = s == 0, s == n_stages - 1
            inner = masked(_stage_view(rank_model, layer_ids[s], first, last))
            if not self.moe:
                return inner
            ids = [i for i in layer_ids[s] if any(isinstance(m, MoE) for m in rank_model.layers[str(i)].modules())]
            return _MoEStage(inner, moe_aux, ids, rank_model.args.moe.num_experts, first, last, self)

        self.stages = [PipelineStage(wrap(s), s, n_stages, device, group=self.pp_group) for s in self.stage_ids]
        for stage in self.stages:
            if isinstance(stage.submod, _MoEStage):
                stage.submod.stage = stage
        self._scale = 1.0  # set per micro-batch: dp / (the step's global labelled tokens)
        self.aux_sum = torch.zeros((), device=device)  # this step's MoE aux losses of this rank's stages (_MoEStage)
        kw = dict(n_microbatches=self.m, loss_fn=self._loss_fn, scale_grads=False)
        if p.pp_schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kw)
        else:
            cls = ScheduleGPipe if p.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(self.stages[0], **kw)

    def grad_scale(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(self._scale).to(dtype)

    def _loss_fn(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """The recipe's loss (recipes/llm/loss.py) of one microbatch, scaled as common/engine.py scales every loss sum.
        An MoE's last stage also returns the microbatch's routing counts: a zero term ties them into the loss, so that
        its backward starts their way back through the stages (_CarriedCounts)."""
        logits, counts = output if self.moe else (output, None)
        loss = self.loss(logits, labels) * self._scale
        return loss if counts is None else loss + 0 * counts.sum()

    def step(self, batch, scale: torch.Tensor) -> torch.Tensor:
        """Forward + backward of the whole packed batch (recipes/llm/train.py:LocalBatch), gradients scaled
        by ``scale``; returns this rank's CE token sum (0 off the last stage), plus its stages' MoE aux losses.
        Every dp rank has the same rows (trainer.micro_batch_size), so every rank runs the same number of rounds
        (matched P2P and FSDP collectives). The schedule's backward runs inside the loss's forward context too (it
        interleaves with the forwards)."""
        self._scale = scale
        with self.loss.forward():
            loss_sum = self._rounds(batch, functools.partial(self.schedule.step, return_outputs=False)) / scale
        aux_sum, self.aux_sum = self.aux_sum, torch.zeros_like(self.aux_sum)  # the stages' shares, in their backward
        return loss_sum + aux_sum

    def eval_loss(self, batch) -> torch.Tensor:
        """Forward only (``schedule.eval``): this rank's CE token sum of the batch (0 off the last stage)."""
        self._scale = torch.ones((), device=self.device)
        with self.loss.forward():
            return self._rounds(batch, self.schedule.eval)

    def _rounds(self, batch, run) -> torch.Tensor:
        """``run`` (the schedule's step or eval) over the batch's rounds; the sum of the last stage's scaled losses."""
        packed, pad_id = batch.packed, self.pad_id
        loss_sum = torch.zeros((), device=self.device)
        rounds = math.ceil(packed.num_rows / self.round_rows)
        # row_segments stay on the host: each stage derives its microbatch's cu_seqlens from them.
        inputs = pad_rows(packed, rounds * self.round_rows, pad_id, self.attention, self.moe)
        if self.cp > 1:  # this cp rank's chunks of every row (padding rows too); labels become next-token targets
            inputs = shard_rows(inputs, self.cp, self.cp_rank, self.cp_method)
        inputs = {k: v if k == "row_segments" else v.to(self.device) for k, v in inputs.items()}
        mask = "row_segments" if self.attention == "flash" else "attn_mask"
        extra = ("real_tokens", "labelled") if self.moe else ()
        for r in range(rounds):
            losses: list[torch.Tensor] = []
            rows = slice(r * self.round_rows, (r + 1) * self.round_rows)
            args = (inputs["input_ids"][rows],) if self.is_first else ()
            target = inputs["labels"][rows] if self.is_last else None
            run(
                *args,
                target=target,
                losses=losses,
                position_ids=inputs["position_ids"][rows],
                **{k: inputs[k][rows] for k in (mask, *extra)},
            )
            if losses:  # last stage: the scaled microbatch losses
                loss_sum += torch.stack([x.detach() for x in losses]).sum()
        return loss_sum


class TiedEmbeddings:
    """Tied input/output embeddings under pipeline parallelism (Megatron's embedding group).

    The first stage's ``tok_embeddings.weight`` and the last stage's ``output.weight`` are one weight
    held twice. They start equal (one tensor in a Hugging Face checkpoint, one in rank 0's seeded
    init) and stay equal: their gradients are summed over the pair of ranks before every optimizer
    step, so both copies take the same steps. The last stage's copy is left out of the gradient norm
    (``norm_skip``) so the shared weight counts once, as without PP.
    """

    def __init__(self, rank_model: Transformer, mesh):
        # One group per (dp, tp) coordinate: the first and last pipeline rank. Every rank creates every
        # group (new_group is collective over the world), and keeps the one it belongs to.
        ranks = mesh.mesh  # [pp, dp, tp] global ranks
        me = tdist.get_rank()
        self.group = None
        for pair in ranks[[0, -1]].reshape(2, -1).T.tolist():
            group = tdist.new_group(pair)
            if me in pair:
                self.group = group
        first, last = rank_model.tok_embeddings, rank_model.output
        self.param = first.weight if first is not None else last.weight if last is not None else None
        self.norm_skip = last.weight if last is not None and first is None else None

    def all_reduce_grads(self) -> None:
        if self.param is None or self.param.grad is None:  # a middle stage
            return
        grad = self.param.grad
        # Both copies are sharded alike (FSDP over dp, Shard(0) over tp): sum the local shards.
        tdist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)
