"""common/toggles.apply_toggles: the one place every recipe's fp8, activation checkpointing and compile come from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from common.toggles import apply_toggles, unwrapped_names
from recipes.llm.model import Transformer, TransformerBlock
from recipes.llm.train import llama_args
from scripts.kiln.launch import compose


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
    assert len(wrapped) == model.args.n_layers and all(
        isinstance(w._checkpoint_wrapped_module, TransformerBlock) for w in wrapped
    )
    assert sorted(model.state_dict()) == names  # checkpoints and exports keep the model's own names
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(tokens).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_unwrapped_names_are_the_state_dicts():
    """What a DeepSpeed checkpoint records by parameter name (named_parameters of the module it wraps: AC's and
    compile's prefixes in them) read back under the state dict's names, in order; two records of one name refused."""
    model, toggles = tiny_llama(activation_checkpointing="full")
    apply_toggles(model, toggles, block_types=(TransformerBlock,))
    named = {n.replace("layers.1.", "layers.1._orig_mod."): p for n, p in model.named_parameters()}
    assert any("_checkpoint_wrapped_module." in n for n in named) and any("_orig_mod." in n for n in named)
    assert list(unwrapped_names(named)) == list(model.state_dict())
    with pytest.raises(ValueError, match="both unwrap to layers.0.attention.wq.weight"):
        unwrapped_names(
            {"layers.0.attention.wq.weight": 1, "layers.0._checkpoint_wrapped_module.attention.wq.weight": 2}
        )


def test_fp8_converts_the_blocks_linears_not_the_output_head():
    from torchao.float8.float8_linear import Float8Linear

    model, toggles = tiny_llama(precision="fp8")
    # fp8 GEMMs need both widths divisible by 16: llm_tiny's attention projections (128 x 128, 128 x 64)
    # qualify, its SwiGLU (ffn_dim 344) does not; the logits' head never converts.
    attention = {f"layers.{i}.attention.{w}" for i in range(model.args.n_layers) for w in ("wq", "wk", "wv", "wo")}
    apply_toggles(model, toggles, block_types=(TransformerBlock,))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert model.args.ffn_dim % 16 and converted == attention and not isinstance(model.output, Float8Linear)


def dit_with_dropout(dropout: float, **toggles):
    from diffusers.models.attention import BasicTransformerBlock

    from recipes.dit.model import build_model
    from recipes.dit.parallelize import parallelize

    cfg = compose(
        [
            "recipe=dit_tiny",
            f"model.dropout={dropout}",
            "model.num_layers=2",
            *(f"toggles.{k}={v}" for k, v in toggles.items()),
        ]
    )
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model, cfg.data.image_size), cfg).train()
    assert any(isinstance(m, BasicTransformerBlock) for m in model.modules())
    return model


def dit_grads(model) -> dict[str, torch.Tensor]:
    """Gradients of one training-mode forward (dropout masks drawn from a seeded generator)."""
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(4, 1, 16, 16, generator=g), torch.randint(0, 1000, (4,), generator=g), torch.arange(4)
    torch.manual_seed(2)  # the dropout masks' stream: the same for every model
    model(x, timestep=t, class_labels=y).sample.square().mean().backward()
    return {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_with_dropout_gives_the_gradients_without_ac(mode):
    """The recomputation in backward draws the forward's dropout masks again (issue 20): AC keeps the RNG
    state whenever a block can draw random numbers, so the gradients equal the un-checkpointed model's."""
    reference = dit_grads(dit_with_dropout(0.3))
    checkpointed = dit_with_dropout(0.3, activation_checkpointing=mode)
    assert any(isinstance(m, CheckpointWrapper) for m in checkpointed.modules())
    grads = dit_grads(checkpointed)
    assert grads.keys() == reference.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[name], rtol=1e-5, atol=1e-7, msg=name)
    # The masks matter: without dropout the gradients are others (the comparison can fail).
    no_dropout = dit_grads(dit_with_dropout(0.0))
    assert any(not torch.allclose(no_dropout[n], reference[n]) for n in reference)


def test_what_draws_random_numbers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.toggles import draws_random_numbers

    assert draws_random_numbers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert not draws_random_numbers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    tiny = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert draws_random_numbers(LlamaForCausalLM(LlamaConfig(**tiny, attention_dropout=0.1)))  # a float, no nn.Dropout
    assert not draws_random_numbers(LlamaForCausalLM(LlamaConfig(**tiny)))
    assert not draws_random_numbers(tiny_llama()[0])  # Kiln's Llama has no dropout
