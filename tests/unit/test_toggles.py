"""common/toggles.apply_toggles: the one place every recipe's fp8, activation checkpointing and compile come from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from common.launch import compose
from common.toggles import apply_toggles
from recipes.llm.model import Transformer, TransformerBlock
from recipes.llm.train import llama_args


def tiny_llama(**toggles):
    cfg = compose(["recipe=llm_tiny"])
    model = Transformer(llama_args(cfg, vocab_size=512))
    model.init_weights(seed=0)
    return model, dataclasses.replace(cfg.toggles, **toggles)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_wraps_every_block_and_keeps_the_math(mode):
    model, toggles = tiny_llama(activation_checkpointing=mode)
    reference, _ = tiny_llama()
    names = sorted(model.state_dict())
    apply_toggles(model, toggles, block_types=(TransformerBlock,))
    wrapped = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == model.args.n_layers and all(isinstance(w._checkpoint_wrapped_module, TransformerBlock)
                                                      for w in wrapped)
    assert sorted(model.state_dict()) == names  # checkpoints and exports keep the model's own names
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(tokens).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_fp8_converts_the_blocks_linears_not_the_output_head():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model, toggles = tiny_llama(precision="fp8")
    # fp8 GEMMs need both widths divisible by 16: llm_tiny's attention projections (128 x 128, 128 x 64)
    # qualify, its SwiGLU (ffn_dim 344) does not; the logits' head never converts.
    attention = {f"layers.{i}.attention.{w}" for i in range(model.args.n_layers) for w in ("wq", "wk", "wv", "wo")}
    apply_toggles(model, toggles, block_types=(TransformerBlock,))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert model.args.ffn_dim % 16 and converted == attention and not isinstance(model.output, Float8Linear)
