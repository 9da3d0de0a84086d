"""Ulysses context parallelism for the DeepSpeed recipes (``parallel.cp``): each sample's token sequence split over the
cp ranks of a data-parallel group, attention by DeepSpeed's all-to-all (``deepspeed.sequence.layer``), and the
process groups DeepSpeed reduces gradients and shards ZeRO over.

The split (DeepSpeed-Ulysses, Jacobs et al. 2023): the cp ranks of a group read the same samples, timesteps and
noise; each holds a contiguous 1/cp of the tokens between the embedding and the output projection. Attention
exchanges heads for tokens (all-to-all), so each rank attends with the whole sequence over heads/cp heads, then the
inverse all-to-all gives its tokens back. Everything else in a block works token by token. The output projection's
tokens are gathered again, so the loss is computed whole and identically on every cp rank.

Gradients: a rank's weights receive the contributions of its own tokens only, so the full gradient is their sum over
the cp group; DeepSpeed does exactly that when given these groups as its sequence-parallel ``mpu``: it reduces over
dp x cp ranks and divides by dp (``dp_world_size / sequence_parallel_size`` in its engine and ZeRO optimizers; ZeRO-3's
reduce-scatter path does not, and common/deepspeed.py keeps ZeRO-3 off it under cp), and ZeRO partitions over all
dp x cp ranks. The Trainer's loss and sample counts are summed over dp only (DeepSpeedEngine.all_reduce).

The groups are common/parallel_dims.py's CPGroups (one type for every family and both engines); UlyssesGroups is
their DeepSpeed view. Text-to-image (SD3's joint attention) keeps the prompt's text tokens whole on every cp rank:
recipes/t2i/parallelize.py ulysses_joint_kernel, around this module's exchange.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as tdist

from common.parallel_dims import CPGroups


def check_layout(cfg, *, heads: int, tokens: int, heads_from: str, tokens_from: str) -> None:
    """One line where parallel.cp cannot split this model: cp not dividing the heads (each rank attends with heads/cp
    whole heads) or a sample's `tokens` (`heads_from`, `tokens_from`: where the numbers come from, for the message).
    parallel.cp_method is the family's (common/compose.py: its spec's cp_methods); cp dividing the ranks is checked
    when the job's world size is known (common/parallel_dims.py)."""
    from common.errors import ConfigError

    cp = cfg.parallel.cp
    if cp > 1 and heads % cp:
        raise ConfigError(
            f"parallel.cp={cp} must divide the {heads} attention heads ({heads_from}): Ulysses attention gives each "
            "cp rank heads/cp whole heads"
        )
    if cp > 1 and tokens % cp:
        raise ConfigError(f"parallel.cp={cp} must divide the {tokens} patch tokens of a sample ({tokens_from})")


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (B, S, H, D) q, k, v -> (B, S, H, D)


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) attention without a mask through torch SDPA."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class UlyssesGroups:
    """A run's cp groups (common/parallel_dims.py: CPGroups, from its ("dp", "cp") mesh) in the form DeepSpeed takes a
    sequence-parallel layout: the ``mpu`` protocol of its own ``deepspeed.runtime.sequence_parallel.parallel_state_sp``
    (what its Ulysses trainers pass to ``deepspeed.initialize``). That module keeps its groups in process-wide globals,
    created once per process; this reads them from Kiln's mesh, so the mesh stays the one source of the layout.
    DeepSpeedEngine builds it from the CPGroups it is given."""

    def __init__(self, groups: CPGroups):
        self.groups = groups
        self.cp = groups.cp

    # No get_data_parallel_world_size: DeepSpeed's config then counts world / cp data-parallel ranks in its batch size
    # (deepspeed/runtime/config.py). DeepSpeed tells a sequence-parallel mpu from a Megatron one by this attribute
    # (deepspeed/utils/groups.py: `hasattr(mpu, "initialize_sequence_parallel")`); the groups exist already.
    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.cp:
            raise ValueError(f"these groups split sequences over {self.cp} ranks, not {sequence_parallel_size}")

    def get_sequence_parallel_group(self):
        return self.groups.cp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.cp_rank

    def get_sequence_data_parallel_group(self):
        return self.groups.batch_group  # dp x cp: ZeRO's partitions, gradient reduction

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.dp * self.cp

    def get_sequence_data_parallel_rank(self) -> int:
        return tdist.get_rank(self.groups.batch_group)

    # As in parallel_state_sp: the model-parallel queries read as the cp group. DeepSpeed's gradient norms then count
    # a whole (replicated) gradient on cp rank 0 only and sum over the group.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        """No tensor parallelism. DeepSpeed records this as a checkpoint's tp degree (deepspeed/utils/bwc.py asks for
        it before the model-parallel size): read as cp, ds_to_universal would look for cp model-state files and
        refuse to convert a checkpoint written under cp > 1."""
        return 1


def ulysses_kernel(kernel: Kernel, group) -> Kernel:
    """`kernel` on this rank's (B, S/cp, H, D) tokens through DeepSpeed's DistributedAttention: q, k, v all-to-all'd
    to (B, S, H/cp, D) (scatter the heads, dim 2; gather the sequence, dim 1), `kernel` on them, the output back to
    (B, S/cp, H, D). Exact for attention without a mask (each head sees every token). Arguments after q, k, v go to
    `kernel` as they are (the VLM passes each call's own kernel: recipes/vlm/context_parallel.py)."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    # Its all-to-all goes through deepspeed.comm, which wraps the process group torch.distributed already has
    # (deepspeed.initialize does the same; this kernel may run before it, or without an engine).
    deepspeed.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
    attention = DistributedAttention(kernel, group, scatter_idx=2, gather_idx=1)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args) -> torch.Tensor:
        return attention(q, k, v, 0, None, *args)  # batch_dim_idx 0, no rotary_pos_emb, then `kernel`'s own

    return attend


def shard_tokens(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's contiguous 1/cp of `x`'s tokens (dim `dim`: 1, or the last for positions laid out
    [3, B, S] as Qwen's mRoPE). A plain slice: its backward puts the rank's gradient back in its rows (the embedding
    before it then gets the rank's share, which DeepSpeed sums over cp)."""
    n = x.shape[dim] // cp
    return x.narrow(dim, rank * n, n)


class _GatherTokens(torch.autograd.Function):
    """All-gather of the tokens (dim 1) over the cp group whose backward keeps this rank's rows of the gradient: what
    follows (the unpatchify and the loss) is computed identically on every cp rank, so each rank's copy of the loss
    already has the whole gradient, and summing the ranks' copies (an all-gather's usual backward) would count it cp
    times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        cp = tdist.get_world_size(group)
        ctx.cp, ctx.rank = cp, tdist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        tdist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)  # (B, cp * S/cp, ...): rank 0's tokens first

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return shard_tokens(grad, ctx.cp, ctx.rank).contiguous(), None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Every cp rank's (B, S/cp, ...) tokens -> (B, S, ...) in sequence order (see _GatherTokens for its backward)."""
    return _GatherTokens.apply(x, group)
