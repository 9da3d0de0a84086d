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

Text-to-image (SD3's joint attention) keeps the prompt's text tokens whole on every cp rank: see ulysses_joint_kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as tdist

# parallel.cp_method of the recipes that split sequences this way (the DiT, text-to-image): the name the LLM gives the
# same exchange of heads (recipes/llm/context_parallel.py), one name for one method.
METHOD = "alltoall"


def default_method(cfg, command_line: set[str]) -> None:
    """parallel.cp_method = alltoall (Ulysses) unless the command line gave one (the shared default is the LLM's)."""
    if "parallel.cp_method" not in command_line:
        cfg.parallel.cp_method = METHOD


def check_method(cfg, recipe: str) -> None:
    from common.errors import ConfigError

    if cfg.parallel.cp_method != METHOD:
        raise ConfigError(
            f"parallel.cp_method={cfg.parallel.cp_method!r} is not in the {recipe} recipe; choose one of: {METHOD}"
        )


def check_layout(cfg, *, heads: int, tokens: int, recipe: str, heads_from: str, tokens_from: str) -> None:
    """One line where parallel.cp / cp_method cannot split this model: another method, cp not dividing the heads
    (each rank attends with heads/cp whole heads) or a sample's `tokens` (`heads_from`, `tokens_from`: where the
    numbers come from, for the message). cp dividing the ranks is checked when the job's world size is known
    (common/parallel_dims.py)."""
    from common.errors import ConfigError

    check_method(cfg, recipe)
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
    """The ("dp", "cp") mesh of a DeepSpeed run with cp > 1 (cp innermost: a cp group is consecutive ranks), in the
    form DeepSpeed takes a sequence-parallel layout: the ``mpu`` protocol of its own
    ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (what its Ulysses trainers pass to
    ``deepspeed.initialize``). That module keeps its groups in process-wide globals, created once per process; this
    builds them from Kiln's mesh, so the mesh stays the one source of the layout.

    ``dp_group``: the ranks with the same cp rank, one per data-parallel group: a step's loss and sample counts,
    identical on the cp ranks of a group, are summed over it (the Trainer's ``engine.all_reduce``)."""

    def __init__(self, dp: int, cp: int, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        from common.parallel_dims import batch_mesh

        self.dp, self.cp = dp, cp
        self.mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
        self.cp_group = self.mesh["cp"].get_group()
        self.dp_group = self.mesh["dp"].get_group()
        self.seq_dp_group = batch_mesh(self.mesh).get_group()  # dp x cp: ZeRO's partitions, gradient reduction

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    # No get_data_parallel_world_size: DeepSpeed's config then counts world / cp data-parallel ranks in its batch size
    # (deepspeed/runtime/config.py). DeepSpeed tells a sequence-parallel mpu from a Megatron one by this attribute
    # (deepspeed/utils/groups.py: `hasattr(mpu, "initialize_sequence_parallel")`); the groups exist already.
    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.cp:
            raise ValueError(f"these groups split sequences over {self.cp} ranks, not {sequence_parallel_size}")

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_data_parallel_group(self):
        return self.seq_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp * self.cp

    def get_sequence_data_parallel_rank(self) -> int:
        return tdist.get_rank(self.seq_dp_group)

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


def data_parallel_layout(parallel, dist):
    """(ParallelDims, UlyssesGroups or None, this rank's data-parallel rank) of a DeepSpeed recipe: ZeRO data
    parallelism with dp = world / cp. Under parallel.cp > 1 the cp ranks of each data-parallel group read the same
    samples (so draw the same noise and timesteps: common/seed.py keys them by sample) and split their tokens."""
    from common.parallel_dims import ParallelDims

    dims = ParallelDims.from_config(parallel, dist.world_size)
    if dims.cp == 1:
        return dims, None, dist.rank
    groups = UlyssesGroups(dims.dp, dims.cp, dist.device.type)
    return dims, groups, groups.dp_rank


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


def ulysses_joint_kernel(kernel: Kernel, group):
    """Joint attention (SD3's: the image tokens and the prompt's text tokens in one softmax) under the split: this
    rank's (B, S/cp, H, D) image q, k, v and the whole (B, T, H, D) text q, k, v (the text stream is short and is
    computed whole on every cp rank) -> (this rank's image output (B, S/cp, H, D), the whole text output (B, T, H, D)).

    The image tokens go through DistributedAttention's all-to-all; inside it, with heads/cp heads of every image
    token, the rank appends the same heads of the text tokens (the all-to-all hands rank r the r-th block of heads)
    and runs `kernel` on the joint sequence (key order does not matter without a mask). The text output's heads are
    all-gathered; its backward sums the ranks' gradients (each rank's text stream carries the gradient of its own
    heads and image tokens only, like its weights), which DeepSpeed's sum over cp then completes."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    deepspeed.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
    cp, rank = tdist.get_world_size(group), tdist.get_rank(group)

    def attend(q, k, v, q_text, k_text, v_text):
        h = q_text.shape[2] // cp
        mine = [t[:, :, rank * h : (rank + 1) * h] for t in (q_text, k_text, v_text)]
        text_out = []

        def joint(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor) -> torch.Tensor:
            n = qi.shape[1]
            out = kernel(*(torch.cat([a, b], dim=1) for a, b in zip((qi, ki, vi), mine, strict=True)))
            text_out.append(out[:, n:])
            return out[:, :n]

        image = DistributedAttention(joint, group, scatter_idx=2, gather_idx=1)(q, k, v, batch_dim_idx=0)
        heads_first = text_out[0].permute(2, 0, 1, 3).contiguous()  # (H/cp, B, T, D): gathered rank after rank
        text = wait_tensor(all_gather_single_autograd(heads_first, 0, group)).permute(1, 2, 0, 3)
        return image, text

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
