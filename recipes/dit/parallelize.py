"""Apply LoRA, the attention kernel, context parallelism and the toggles to a DiT, in the fixed order: LoRA → kernels
(Ulysses under parallel.cp) → fp8 → AC → compile (ZeRO comes last, when common/engine.py:DeepSpeedEngine wraps the
model)."""

from __future__ import annotations

from typing import Callable

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from common.config import TrainConfig
from common.lora import apply_lora
from common.parallel_dims import CPGroups
from common.toggles import apply_toggles
from common.ulysses import gather_tokens, sdpa_kernel, shard_tokens, ulysses_kernel

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flash_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA (`sdpa_kernel`, the CPU reference) restricted to torch's own FlashAttention kernel (no flash-attn
    package): an error, not a silent fallback to another kernel, where flash cannot run (fp32, CPU, an unsupported
    head size)."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as sdpa_backends

    with sdpa_backends(SDPBackend.FLASH_ATTENTION):
        return sdpa_kernel(q, k, v)


class KernelAttnProcessor:
    """DiT self-attention with a pluggable (B, S, H, D) kernel: torch's FlashAttention on CUDA.

    The projections mirror diffusers' AttnProcessor2_0 for the DiT's attention (no mask,
    no cross-attention, no q/k norm); tests check it against AttnProcessor2_0 on CPU with
    `sdpa_kernel`, so the flash path differs only in the kernel call.
    """

    def __init__(self, kernel: Kernel):
        self.kernel = kernel

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        **_,
    ):
        if encoder_hidden_states is not None or attention_mask is not None or attn.norm_q is not None:
            raise ValueError("KernelAttnProcessor handles unmasked self-attention only")
        residual = hidden_states
        b, s, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, s, attn.heads, -1) for proj in (attn.to_q, attn.to_k, attn.to_v))
        out = self.kernel(q, k, v).reshape(b, s, -1).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


KERNELS: dict[str, Kernel] = {"sdpa": sdpa_kernel, "flash": flash_kernel}  # the backends with a (B, S, H, D) kernel


def set_attention(model: DiTTransformer2DModel, backend: str, cp: CPGroups | None = None) -> None:
    """Every Attention module's processor for `backend`; under context parallelism (`cp`) the backend's kernel
    inside DeepSpeed's Ulysses all-to-all (recipes/dit/config.py refuses eager, which has no such kernel)."""
    if cp is not None:
        kernel = ulysses_kernel(KERNELS[backend], cp.cp_group)
        make = lambda: KernelAttnProcessor(kernel)  # noqa: E731
    else:
        make = {"sdpa": AttnProcessor2_0, "eager": AttnProcessor, "flash": lambda: KernelAttnProcessor(flash_kernel)}[
            backend
        ]
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(make())


def split_sequence(model: DiTTransformer2DModel, cp: CPGroups) -> None:
    """The patch tokens split over the cp ranks from the patch embedding to the output projection: the embedding's
    output is cut to this rank's contiguous share, the output projection's gathered whole again before diffusers
    unpatchifies it (it reads the image size off the token count). The blocks in between (adaLN, the MLP) work token
    by token; their attention exchanges heads (set_attention)."""
    model.pos_embed.register_forward_hook(lambda _m, _args, out: shard_tokens(out, cp.cp, cp.cp_rank))
    model.proj_out_2.register_forward_hook(lambda _m, _args, out: gather_tokens(out, cp.cp_group))


def parallelize(model: DiTTransformer2DModel, cfg: TrainConfig, cp: CPGroups | None = None) -> DiTTransformer2DModel:
    """`model` with its adapters (finetune=lora: the blocks' attention and feed-forward linears, the rest frozen),
    attention kernel, sequence split over `cp` (parallel.cp > 1) and toggles applied, ready for the engine (DeepSpeed
    ZeRO over what trains, over dp x cp ranks)."""
    if cfg.finetune == "lora":
        apply_lora(model, cfg.lora)
    set_attention(model, cfg.toggles.attention, cp)
    if cp is not None:
        split_sequence(model, cp)
    # Selective AC recomputes the MLP's up projection too: the default policy keeps 11 of the 20
    # hidden-sized tensors a DiT block saves (adaLN-Zero keeps more than a Llama block), this one 7.
    apply_toggles(model, cfg.toggles, block_types=(BasicTransformerBlock,), recompute_widening=True)
    return model
