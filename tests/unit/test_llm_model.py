"""Kiln Llama: parity with transformers' LlamaForCausalLM, packing isolation, meta build, pipeline split."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from common.data.packing import pack_samples
from recipes.llm.hf_adapter import from_hf_state_dict, to_hf_config, to_hf_state_dict
from recipes.llm.model import LlamaArgs, Transformer
from recipes.llm.train import llama_args
from scripts.kiln.launch import compose

# 3 layers (pipeline split leaves more than one layer in the second stage), GQA with n_rep=2,
# max_seq_len above the longest test row.
ARGS = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=160, max_seq_len=64)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) weights once


def _model(args: LlamaArgs = ARGS, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model.eval()


def _tokens(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _hf(model: Transformer, attn: str) -> LlamaForCausalLM:
    hf = LlamaForCausalLM(to_hf_config(model.args, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    hf.set_attn_implementation(attn)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.args), strict=False)
    # Tied: one tensor in Hugging Face format (save_pretrained writes no lm_head.weight); transformers ties it.
    assert missing == (["lm_head.weight"] if model.args.tie_embeddings else []) and not unexpected
    return hf.eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(attn: str, tie: bool) -> None:
    args = dataclasses.replace(ARGS, tie_embeddings=tie)
    model = _model(args)
    hf = _hf(model, attn)
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = _tokens(2, 24)
    # Non-trivial positions too: an offset per row exercises the position_ids lookup against HF's.
    position_ids = torch.arange(24)[None] + torch.tensor([[0], [17]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            model(tokens, position_ids=position_ids),
            hf(input_ids=tokens, position_ids=position_ids).logits,
            atol=1e-5,
            rtol=0,
        )


def test_state_dict_round_trip() -> None:
    model = _model()
    sd = model.state_dict()
    assert "rope_cache" not in sd  # non-persistent: recomputed, never checkpointed
    hf_sd = to_hf_state_dict(sd, ARGS)
    back = from_hf_state_dict(hf_sd, ARGS)
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k] is sd[k]  # a pure rename: the same tensors, no permutation or copy
    # An HF model's own state dict loads strictly into a fresh Kiln model and reproduces it.
    hf_sd_native = _hf(model, "sdpa").state_dict()
    assert hf_sd_native.keys() == hf_sd.keys()
    fresh = Transformer(ARGS)
    fresh.load_state_dict(from_hf_state_dict(hf_sd_native, ARGS), strict=True)
    tokens = _tokens(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(tokens), model(tokens), atol=0, rtol=0)


def test_adapter_rejects_unknown_keys() -> None:
    with pytest.raises(KeyError, match="layers.3"):
        to_hf_state_dict({"layers.3.attention.wq.weight": torch.zeros(1)}, ARGS)  # only 3 layers
    with pytest.raises(KeyError, match="q_norm"):
        from_hf_state_dict({"model.layers.0.self_attn.q_norm.weight": torch.zeros(1)}, ARGS)
    # Older HF checkpoints carry the rope inv_freq; it is recomputed, so dropped.
    assert from_hf_state_dict({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}, ARGS) == {}


def test_packed_rows_match_documents_run_alone() -> None:
    model = _model()
    lengths = [9, 5, 12, 7, 3]
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, ARGS.vocab_size, (n,), generator=gen) for n in lengths]
    batch = pack_samples([{"input_ids": d, "labels": d} for d in docs], max_seq_len=20, pad_id=0)
    assert batch.num_rows == 2 and any(len(r) > 1 for r in batch.seq_lens)  # really packed, with padding
    mask = batch.attention_mask_4d(torch.bool)
    with torch.no_grad():
        packed = model(batch.input_ids, position_ids=batch.position_ids, attn_mask=mask)
        leaked = model(batch.input_ids)  # plain causal over the row: documents see each other
        doc_iter = iter(batch.order)
        max_leak = 0.0
        for r, row in enumerate(batch.seq_lens):
            start = 0
            for n in row:
                alone = model(docs[next(doc_iter)][None])[0]
                torch.testing.assert_close(packed[r, start : start + n], alone, atol=1e-5, rtol=0)
                max_leak = max(max_leak, (leaked[r, start : start + n] - alone).abs().max().item())
                start += n
    assert max_leak > 1e-2  # the mask is what isolates documents, not a coincidence of the data


def test_llm_8b_meta_build_allocates_nothing() -> None:
    args = llama_args(compose(["recipe=llm_8b"]), vocab_size=0)  # the recipe sets the vocabulary
    with torch.device("meta"):
        model = Transformer(args)
    n = num_params(model)
    assert 8.0e9 < n < 8.1e9, n
    assert n == 8_030_261_248  # Llama-3-8B
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_meta_build_materializes_like_direct_build() -> None:
    args = llama_args(compose(["recipe=llm_tiny"]), vocab_size=512)
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    direct = _model(args, seed=3)
    assert [(k, type(m)) for k, m in meta.named_modules()] == [(k, type(m)) for k, m in direct.named_modules()]
    sd_meta, sd_direct = meta.state_dict(), direct.state_dict()
    assert sd_meta.keys() == sd_direct.keys()
    for k in sd_direct:  # same seed, same init on the same device: identical
        torch.testing.assert_close(sd_meta[k], sd_direct[k], atol=0, rtol=0)
    torch.testing.assert_close(meta.rope_cache, direct.rope_cache, atol=0, rtol=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.no_grad():
        logits = meta.eval()(tokens)
    assert logits.shape == (2, 32, args.vocab_size) and torch.isfinite(logits).all()


def test_tied_meta_build_reties_and_seed_leaves_global_rng_alone() -> None:
    args = dataclasses.replace(ARGS, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")  # unties: each module gets its own new Parameter
    state = torch.get_rng_state()
    model.init_weights(seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.output.weight is model.tok_embeddings.weight
    assert num_params(model) == num_params(Transformer(args))


def test_pipeline_split_chains_to_full_model() -> None:
    model = _model()
    stage0, stage1 = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(1, ARGS.n_layers):
        del stage0.layers[str(i)]
    stage0.norm = stage0.output = None
    del stage1.layers["0"]
    stage1.tok_embeddings = None
    # FQNs survive the split: the stages' state dicts partition the full one, and each converts alone.
    sd0, sd1 = stage0.state_dict(), stage1.state_dict()
    assert not sd0.keys() & sd1.keys() and sd0.keys() | sd1.keys() == model.state_dict().keys()
    assert (
        to_hf_state_dict(sd0, ARGS).keys() | to_hf_state_dict(sd1, ARGS).keys()
        == to_hf_state_dict(model.state_dict(), ARGS).keys()
    )
    tokens = _tokens(2, 16)
    with torch.no_grad():
        hidden = stage0(tokens)
        assert hidden.shape == (2, 16, ARGS.dim)
        torch.testing.assert_close(stage1(hidden), model(tokens), atol=1e-6, rtol=0)


def test_rejects_bad_inputs() -> None:
    model = _model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, ARGS.max_seq_len + 1))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaArgs(n_heads=4, n_kv_heads=3)
    with pytest.raises(TypeError, match="token_id"):
        to_hf_config(ARGS, vocab=5)
