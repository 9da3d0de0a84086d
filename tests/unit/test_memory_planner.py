"""The memory planner: ZeRO arithmetic against the paper and DeepSpeed, activations against bytes
autograd really keeps, and scripts/plan.py end to end."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from common.errors import ConfigError
from common.memory import (
    DEEPSPEED_MIXED,
    GB,
    MIXED_ADAM,
    Block,
    Layout,
    StateBytes,
    configured_layout,
    estimate,
    head_saved,
    layer_activation_bytes,
    microbatches_in_flight,
    model_state_bytes,
    per_gpu_bytes,
)
from recipes.dit.sizing import memory_spec as dit_spec
from recipes.llm.sizing import memory_spec as llm_spec
from scripts.kiln.launch import compose, dry_run
from scripts.kiln.planner import GPUS, candidate_layouts, plan
from tests.conftest import REPO, load_script

plan_script = load_script("plan")


# ---- a) Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, K = 12 --------------------


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    states = model_state_bytes(7.5e9, stage, 64, MIXED_ADAM)
    assert round(states["total"] / GB, 1) == expected_gb


# ---- b) DeepSpeed's own estimators --------------------------------------------------------------


@pytest.fixture(scope="module")
def recipe_sizes() -> list[tuple[str, int, int]]:
    """(recipe, parameters, largest module) from the recipes' own builders on the meta device. All
    trainable and 16-bit mixed precision: what DeepSpeed's estimators assume."""
    sizes = []
    for name, build in (("dit_2b", dit_spec), ("llm_8b", llm_spec)):
        spec = build(compose([f"recipe={name}"]))
        sizes.append(
            (name, spec.total_params, spec.gather_unit_params if name == "dit_2b" else spec.first_params)
        )  # the LLM's largest module: its embedding table
    return sizes


@pytest.mark.parametrize("gpus_per_node, nodes", [(1, 1), (8, 1), (8, 4), (4, 16)])
def test_zero2_matches_deepspeed_estimator(recipe_sizes, gpus_per_node, nodes):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n_gpus = gpus_per_node * nodes
    for _, params, _ in recipe_sizes + [("gpt-7.5b", int(7.5e9), 0)]:
        _, ds_gpu = estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=False)
        # DeepSpeed: 2 bytes of 16-bit weights + 18 bytes (16-bit and fp32 grads, fp32 weights, Adam) / N.
        ours = model_state_bytes(params, 2, n_gpus, DEEPSPEED_MIXED)["total"]
        assert ours == pytest.approx(ds_gpu, abs=1)


@pytest.mark.parametrize("gpus_per_node, nodes", [(8, 1), (8, 4), (4, 16)])
def test_zero3_matches_deepspeed_estimator(recipe_sizes, gpus_per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    n_gpus = gpus_per_node * nodes
    for _, params, largest in recipe_sizes:
        _, ds_gpu, ds_largest = estimate_zero3_model_states_mem_needs(
            params, largest, gpus_per_node, nodes, cpu_offload=False, cpu_offload_params=False
        )
        # DeepSpeed's stage-3 estimator: 18 bytes / N (16-bit weights + fp32 weights, grads, Adam) plus
        # the largest layer gathered as 16-bit weights and grads (4 bytes each parameter).
        exact = model_state_bytes(params, 3, n_gpus, StateBytes(2, 0, 16), gathered_params=largest)
        assert exact["gathered"] == ds_largest
        assert exact["total"] == pytest.approx(ds_gpu, abs=1)
        # The planner also counts the 16-bit gradient partition stage 3 allocates
        # (stage3.py: grad_partitions_flat_buffer): 2 bytes / N above DeepSpeed's estimate.
        planner = model_state_bytes(params, 3, n_gpus, DEEPSPEED_MIXED, gathered_params=largest)
        assert planner["total"] - ds_gpu == pytest.approx(2 * params / n_gpus, abs=1)


# ---- c) activations: the generalized count, and bytes autograd keeps on CPU ----------------------


def test_gpt3_layer_reduces_to_korthikanti():
    """Layernorm, 4h gelu MLP, dropout, eager attention, 16-bit: s·b·h·34 + 5·a·s²·b per layer."""
    s, b, h, a = 2048, 4, 12288, 96
    gpt3 = Block(hidden=h, heads=a, ffn=4 * h)
    shape = dict(seq=s, batch=b, act_bytes=2)
    assert layer_activation_bytes(gpt3, **shape) == s * b * h * 34 + 5 * a * s * s * b
    assert layer_activation_bytes(gpt3, tp=8, **shape) == (s * b * h * 34 + 5 * a * s * s * b) / 8  # TP + SP
    assert layer_activation_bytes(gpt3, recompute="selective", **shape) == s * b * h * 34
    assert layer_activation_bytes(gpt3, recompute="full", **shape) == 2 * s * b * h
    fused = Block(hidden=h, heads=a, ffn=4 * h, attention="fused")  # flash: no scores, out + logsumexp kept
    assert layer_activation_bytes(fused, **shape) == s * b * h * 34 + 4 * a * s * b


def test_pipeline_in_flight_microbatches():
    assert [microbatches_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight("gpipe", 4, 8, 0) == 8
    p, v = 4, 2  # Korthikanti §4.2.3: the first stage of an interleaved schedule holds L·(1 + (p-1)/(p·v))
    assert microbatches_in_flight("interleaved_1f1b", p, 8, 0) == p * (1 + (p - 1) / (p * v))


def saved_bytes(run, exclude: list[torch.Tensor]) -> tuple[int, object]:
    """Bytes of the unique storages autograd saves for backward while `run()` executes, leaving out
    `exclude` (parameters, buffers, the batch itself)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()  # keeping `out` keeps the graph, so no saved storage is freed and reused meanwhile
    return sum(kept.values()), out


# Qwen3's shape (Qwen3-4B: 32 heads x 128 = 4096 over a 2560-wide residual): heads x head_dim = 4 x 32 = 128, twice
# model.dim, with its per-head q/k norm; a narrow MLP so that attention weighs, 2 rows to keep it quick.
WIDE_HEADS = (
    "model.dim=64",
    "model.head_dim=32",
    "model.qk_norm=true",
    "model.ffn_dim=128",
    "trainer.micro_batch_size=2",
)
LLM_MODELS = {"llm_tiny": (), "head_dim_32": WIDE_HEADS}


@pytest.fixture(scope="module")
def llm_worlds():
    """(spec, model builder, batch) of llm_tiny with each of LLM_MODELS' overrides, built on first use."""
    from recipes.llm.model import Transformer
    from recipes.llm.train import llama_args

    worlds = {}

    def world(name: str):
        if name not in worlds:
            cfg = compose(["recipe=llm_tiny", *LLM_MODELS[name]])
            assert cfg.toggles.precision == "fp32"
            spec = llm_spec(cfg)
            args = llama_args(cfg, vocab_size=spec.vocab)
            b, s = cfg.trainer.micro_batch_size, cfg.data.max_seq_len
            gen = torch.Generator().manual_seed(0)
            batch = {
                "tokens": torch.randint(0, args.vocab_size, (b, s), generator=gen),
                "positions": torch.arange(s).repeat(b, 1),
                "mask": torch.ones(b, 1, s, s, dtype=torch.bool).tril(),  # the recipe's 4D mask, one document per row
                "labels": torch.randint(0, args.vocab_size, (b * (s - 1),), generator=gen),
            }
            worlds[name] = spec, lambda: Transformer(args), batch
        return worlds[name]

    return world


def predicted_llm(spec, block: Block, ac: str, loss: bool) -> float:
    shape = dict(seq=spec.seq, batch=spec.micro_batch, act_bytes=4)
    predicted = spec.layers * layer_activation_bytes(block, recompute=ac, **shape)
    return predicted + per_gpu_bytes(head_saved(block, vocab=spec.vocab, loss=loss, **shape))


def measure_llm(world, ac: str, loss: bool) -> tuple[float, float]:
    from common.toggles import apply_ac
    from recipes.llm.model import TransformerBlock

    spec, build, batch = world
    torch.manual_seed(0)
    model = build()
    model.init_weights(seed=0)
    if ac != "none":
        apply_ac(model, ac, (TransformerBlock,))  # as recipes/llm/parallelize.py does (common/toggles.py)

    def forward():
        logits = model(batch["tokens"], position_ids=batch["positions"], attn_mask=batch["mask"])
        if not loss:
            return logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"], reduction="sum")  # the recipe's

    exclude = [*model.parameters(), *model.buffers(), *batch.values()]
    measured, _ = saved_bytes(forward, exclude)
    return measured, predicted_llm(spec, spec.block, ac, loss)


@pytest.mark.parametrize(
    "model, ac, loss",
    [("llm_tiny", ac, loss) for loss in (False, True) for ac in ("none", "full")] + [("head_dim_32", "none", False)],
)
def test_llm_tiny_activations_match_saved_tensors(llm_worlds, model, ac, loss):
    """One fp32 forward of the real llm_tiny at the recipe's 8 x 256 tokens, and of a Qwen3-shaped one whose attention
    is wider than its residual (WIDE_HEADS). Not modelled: the RoPE cos/sin gathered by position_ids
    ([2, b, s, head_dim] fp32, shared by every layer)."""
    world = llm_worlds(model)
    measured, predicted = measure_llm(world, ac, loss)
    print(
        f"{model} AC={ac} loss={loss}: predicted {predicted:,.0f} B, measured {measured:,.0f} B, "
        f"ratio {predicted / measured:.3f}"
    )
    assert predicted == pytest.approx(measured, rel=0.15)
    spec = world[0]
    if spec.block.head_dim * spec.block.heads != spec.block.hidden:  # the case tells each of these apart
        for what, change in (("hidden // heads wide", dict(head_dim=0)), ("without the q/k norm", dict(qk_norm=False))):
            other = predicted_llm(spec, dataclasses.replace(spec.block, **change), ac, loss)
            print(f"{model} sized {what}: ratio {other / measured:.3f}")
            assert other != pytest.approx(measured, rel=0.15)


def test_dit_tiny_activations_match_saved_tensors():
    """The adaLN-Zero block of diffusers' DiT, fp32, the recipe's micro batch. Not modelled: every block's
    own timestep/label embedding and modulation vectors (b x 6h: no sequence dimension)."""
    from recipes.dit.model import build_model
    from recipes.dit.parallelize import set_attention

    cfg = compose(["recipe=dit_tiny"])
    spec = dit_spec(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.image_size)
    set_attention(model, cfg.toggles.attention)
    b, size = cfg.trainer.micro_batch_size, cfg.data.image_size
    x, t, y = (
        torch.randn(b, cfg.model.in_channels, size, size),
        torch.randint(0, 1000, (b,)),
        torch.randint(0, 10, (b,)),
    )
    measured, _ = saved_bytes(
        lambda: model(x, timestep=t, class_labels=y).sample, [*model.parameters(), *model.buffers(), x, t, y]
    )
    predicted = spec.layers * layer_activation_bytes(spec.block, seq=spec.seq, batch=b, act_bytes=4)
    print(
        f"dit_tiny AC=none: predicted {predicted:,.0f} B, measured {measured:,.0f} B, ratio {predicted / measured:.3f}"
    )
    assert predicted == pytest.approx(measured, rel=0.15)


# ---- d) the planner ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_8b():
    cfg = compose(["recipe=llm_8b"])
    return cfg, llm_spec(cfg)


def test_llm_8b_needs_sharding_on_8_h100(llm_8b):
    _, spec = llm_8b
    budget = GPUS["h100_80gb"].memory * 0.9
    # 8.03B x 16 bytes of weights, grads and Adam state on every GPU: 128 GB before any activation.
    assert estimate(spec, Layout(dp=8, tp=1, pp=1, zero_stage=0, ac="full"))["total"] > budget
    assert estimate(spec, Layout(dp=8, tp=1, pp=1, zero_stage=3, ac="full"))["total"] < budget


def test_plan_lists_fitting_layouts_best_first(llm_8b):
    cfg, spec = llm_8b
    gpu = GPUS["h100_80gb"]
    rows = plan(spec, 8, gpu, 0.9, allowed=plan_script.recipe_allows(cfg, spec))
    fits = [r for r in rows if r["fits"]]
    assert fits and len(fits) < len(rows)
    assert all(r["total"] <= 0.9 * gpu.memory for r in fits)
    assert all(r["total"] > 0.9 * gpu.memory for r in rows[len(fits) :])
    # No recomputation without sharding at 8k tokens: pure FSDP-8 keeps ~60 GiB of activations.
    assert Layout(8, 1, 1, 3, "none") in [r["layout"] for r in rows[len(fits) :]]
    assert fits[0]["layout"].ac == "none"
    assert all(r["layout"].dp * r["layout"].tp * r["layout"].pp * r["layout"].cp == 8 for r in rows)


def test_plan_respects_recipe_layout_rules():
    """DiT/VLM recipes shard with ZeRO only: every layout has tp = pp = 1, all stages; the DiT offers every AC mode,
    and cp (Ulysses) wherever it divides the 256 tokens and the heads, at every stage (no parameter of dit_2b is over
    ZeRO-3's reduce bucket, which cp x ZeRO-3 would need)."""
    cfg = compose(["recipe=dit_2b"])
    spec = dit_spec(cfg)
    rows = plan(spec, 8, GPUS["h100_80gb"], allowed=plan_script.recipe_allows(cfg, spec))
    layouts = {r["layout"] for r in rows}
    assert {(lay.tp, lay.pp) for lay in layouts} == {(1, 1)}
    assert {lay.cp for lay in layouts} == {c for c in (1, 2, 4, 8) if spec.block.heads % c == 0 and spec.seq % c == 0}
    assert {lay.zero_stage for lay in layouts if lay.cp > 1} == {0, 1, 2, 3}
    assert {lay.zero_stage for lay in layouts} == {0, 1, 2, 3} and {lay.ac for lay in layouts} == {
        "none",
        "selective",
        "full",
    }


def test_cp_x_zero3_bucket_rule_is_one_line_and_the_planners():
    """DeepSpeed's ZeRO-3 under cp averages over dp x cp the gradient of a parameter larger than its reduce bucket
    (common/deepspeed.py): the engine start refuses that in one line, and the planner skips the same layouts."""
    from common.deepspeed import REDUCE_BUCKET, check_cp_zero3

    cfg = compose(["recipe=dit_tiny", "parallel.cp=2", "parallel.zero_stage=3"])
    check_cp_zero3(cfg, REDUCE_BUCKET)  # fits the bucket
    check_cp_zero3(compose(["recipe=dit_tiny", "parallel.zero_stage=3"]), REDUCE_BUCKET + 1)  # no cp
    check_cp_zero3(compose(["recipe=dit_tiny", "parallel.cp=2", "parallel.zero_stage=2"]), REDUCE_BUCKET + 1)
    with pytest.raises(ConfigError, match=r"^parallel.cp=2 with parallel.zero_stage=3: parameter w has 500,000,001 "):
        check_cp_zero3(cfg, REDUCE_BUCKET + 1, "parameter w")
    spec = dataclasses.replace(dit_spec(cfg), largest_trainable=REDUCE_BUCKET + 1)
    rows = plan(spec, 8, GPUS["h100_80gb"], allowed=plan_script.recipe_allows(cfg, spec))
    stages = {(r["layout"].cp > 1, r["layout"].zero_stage) for r in rows}
    assert (True, 3) not in stages and {(True, 2), (False, 3)} <= stages


def test_moe_planner_prices_experts_per_ep_rank():
    """Qwen3-30B-A3B's shapes: 30.53B parameters, all sharded over dp whatever ep; a gathered MoE layer holds its
    1/ep of the experts (128 x 3 x 2048 x 768 weights); the activations are the active width's (top_k experts);
    the planner offers ep only where it divides dp and the expert count, and tp = pp = 1 (refused with MoE)."""
    cfg = compose(["recipe=moe_30b_a3b"])
    spec = llm_spec(cfg)
    assert spec.total_params == 30_532_122_624 and spec.experts == 128 and spec.top_k == 8
    assert spec.expert_params == 128 * 3 * 2048 * 768 and spec.block.ffn == 8 * 768
    one, eight = (estimate(spec, Layout(dp=8, tp=1, pp=1, zero_stage=3, ac="full", ep=ep)) for ep in (1, 8))
    for key in ("weights", "grads", "optimizer", "activations"):
        assert one[key] == eight[key]
    assert one["gathered"] - eight["gathered"] == pytest.approx(2 * 2 * spec.expert_params * 7 / 8)
    rows = plan(spec, 8, GPUS["h100_80gb"], 0.9, allowed=plan_script.recipe_allows(cfg, spec))
    layouts = {r["layout"] for r in rows}
    # EP composes with pipeline parallelism, not with tensor parallelism (refused at composition).
    assert {lay.tp for lay in layouts} == {1} and {lay.ep for lay in layouts} == {1, 2, 4, 8}
    configured = Layout(dp=8, tp=1, pp=1, zero_stage=3, ac=cfg.toggles.activation_checkpointing, ep=8)
    assert next(r for r in rows if r["layout"] == configured)["fits"]  # the recipe's own layout fits 8 H100s


def test_lora_prices_the_adapter_with_adam_and_the_base_as_weights():
    """finetune=lora on llm_8b, sized without its base: the trainable parameters are peft's count on transformers'
    Llama-3-8B; only they have gradients and Adam state, the frozen base costs its fp32 weights alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = compose(["recipe=llm_8b", "finetune=lora", "parallel.tp=1", "run.dry_run=true"])
    spec = llm_spec(cfg)
    m = cfg.model
    with torch.device("meta"):
        hf = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=m.dim,
                num_hidden_layers=m.n_layers,
                num_attention_heads=m.n_heads,
                num_key_value_heads=m.n_kv_heads,
                intermediate_size=m.ffn_dim,
                vocab_size=m.vocab_size,
                tie_word_embeddings=False,
            )
        )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    trainable, total = get_peft_model(
        hf, LoraConfig(r=cfg.lora.rank, target_modules=targets)
    ).get_nb_trainable_parameters()
    assert spec.layers * spec.layer_params + spec.first_params + spec.last_params == trainable == 20_971_520
    assert spec.total_params == total and spec.frozen_params == total - trainable
    est = estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="full"))
    assert (est["grads"], est["optimizer"]) == (4 * trainable, 8 * trainable)
    assert est["weights"] == 4 * total
    sharded = estimate(spec, Layout(dp=8, tp=1, pp=1, zero_stage=3, ac="full"))
    assert sharded["weights"] == 4 * total / 8  # FSDP2 shards the frozen base too


def test_qlora_prices_the_adapted_linears_base_as_torchao_nf4():
    """lora.quantize_base=nf4: each adapted linear's frozen weight costs what torchao's NF4Tensor holds (measured on
    one 14336 x 4096 weight, llm_8b's MLP), the other frozen weights their fp32 bytes."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from common.memory import nf4_bytes

    nf4 = to_nf4(torch.randn(14336, 4096), 64, 256)
    assert nf4_bytes(14336 * 4096) == sum(getattr(nf4, a).nbytes for a in nf4.__tensor_flatten__()[0])
    base = ["recipe=llm_8b", "finetune=lora", "parallel.tp=1", "run.dry_run=true"]
    lora_spec, qlora = llm_spec(compose(base)), llm_spec(compose([*base, "lora.quantize_base=nf4"]))
    m = compose(base).model
    per_layer = m.dim * (2 * m.dim + 2 * m.dim * m.n_kv_heads // m.n_heads) + 3 * m.dim * m.ffn_dim
    saved = m.n_layers * (4 * per_layer) - sum(
        nf4_bytes(n)
        for n in [m.dim * m.dim] * 2 * m.n_layers
        + [m.dim * m.dim * m.n_kv_heads // m.n_heads] * 2 * m.n_layers
        + [m.dim * m.ffn_dim] * 3 * m.n_layers
    )
    assert lora_spec.frozen_bytes - qlora.frozen_bytes == pytest.approx(saved, rel=1e-12)
    one = Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="full")
    print(
        f"llm_8b on one GPU: LoRA weights {estimate(lora_spec, one)['weights'] / 2**30:.2f} GiB, "
        f"QLoRA {estimate(qlora, one)['weights'] / 2**30:.2f} GiB"
    )
    assert estimate(lora_spec, one)["weights"] - estimate(qlora, one)["weights"] == pytest.approx(saved, rel=1e-12)


def test_dit_lora_prices_its_adapters():
    """dit_2b under finetune=lora, sized without its base: per block rank x (in + out) for to_q, to_k, to_v, to_out.0
    (h -> h) and the feed-forward's h -> 4h -> h, i.e. 18 r h; nothing else trains, every other weight is frozen."""
    full = dit_spec(compose(["recipe=dit_2b"]))
    cfg = compose(["recipe=dit_2b", "finetune=lora", "run.dry_run=true"])
    spec = dit_spec(cfg)
    h = cfg.model.num_attention_heads * cfg.model.attention_head_dim
    assert spec.layer_params == 18 * cfg.lora.rank * h and spec.first_params == spec.last_params == 0
    assert spec.total_params == full.total_params + spec.layers * spec.layer_params
    est = estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="full"))
    trainable = spec.layers * spec.layer_params
    # Adam's state and the fp32 EMA (common/ema.py) of the adapter alone
    assert (est["grads"], est["optimizer"]) == (
        DEEPSPEED_MIXED.grads * trainable,
        (DEEPSPEED_MIXED.optimizer + 4) * trainable,
    )
    assert est["weights"] == DEEPSPEED_MIXED.weights * trainable + 2 * spec.frozen_params  # bf16: DeepSpeed casts it


# llm_tiny on preference pairs, sized without their folder (run.dry_run reads no data)
PAIRS = ["recipe=llm_tiny", "data=preference_shards", "run.dry_run=true"]
REFERENCE_LAYOUTS = [
    Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="full"),
    Layout(dp=2, tp=1, pp=1, zero_stage=3, ac="none"),
    Layout(dp=2, tp=2, pp=1, zero_stage=3, ac="selective"),
    Layout(dp=8, tp=1, pp=1, zero_stage=3, ac="full"),
]


def test_preference_prices_the_live_reference_copy_alone():
    """preference.reference=model (DPO's sigmoid) holds a frozen copy of the starting weights, built and sharded as
    the policy: per rank the plan adds exactly its parameters' bytes to the SFT plan of the same rows (counted on
    transformers' Llama of llm_tiny's shapes, in the dtype Kiln's model holds its parameters) and nothing to the
    gradients, the optimizer state, the gathered units or the kept activations. Precomputed log-probs, LoRA (the base
    with its adapter off) and SimPO (reference-free) hold no copy: their plans are those of their SFT runs. Each note
    says which reference was counted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.llm.model import Transformer
    from recipes.llm.sizing import llama_args

    sft_cfg = compose(PAIRS)
    m, vocab = sft_cfg.model, 2048  # the vocabulary the planner assumes without a tokenizer (memory_spec)
    with torch.device("meta"):
        hf = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=m.dim,
                num_hidden_layers=m.n_layers,
                num_attention_heads=m.n_heads,
                num_key_value_heads=m.n_kv_heads,
                intermediate_size=m.ffn_dim,
                vocab_size=vocab,
                tie_word_embeddings=m.tie_embeddings,
            )
        )
        kiln = Transformer(llama_args(sft_cfg, vocab))
    (element,) = {p.element_size() for p in kiln.parameters()}  # fp32 whatever toggles.precision
    reference_bytes = element * hf.num_parameters()
    sft, dpo = llm_spec(sft_cfg), llm_spec(compose([*PAIRS, "preference.loss=sigmoid", "preference.reference=model"]))
    assert dpo.total_params == sft.total_params == hf.num_parameters() and element == 4
    copy = f"reference: a frozen reference copy of {hf.num_parameters() / 1e6:.2f}M in fp32 sharded as the policy"
    assert copy in dpo.note and sft.note == ""
    for layout in REFERENCE_LAYOUTS:
        a, b = estimate(sft, layout), estimate(dpo, layout)
        shards = layout.dp * layout.tp  # FSDP2 over dp and DTensor over tp, as the policy's
        assert b["weights"] - a["weights"] == pytest.approx(reference_bytes / shards, rel=1e-12), layout
        assert all(a[k] == b[k] for k in ("grads", "optimizer", "gathered", "activations")), layout
        assert b["transient"] >= a["transient"]  # its forward's peak, where larger than the policy's
    no_copy = {
        "precomputed reference log-probs: no copy": (
            ["preference.loss=sigmoid", "preference.reference=precomputed"],
            [],
        ),
        "LoRA: the base with the adapter off, no copy": (["preference.loss=ipo", "finetune=lora"], ["finetune=lora"]),
        "reference-free loss: none": (["preference.loss=simpo"], []),
    }
    for note, (run, without) in no_copy.items():
        spec, base = llm_spec(compose([*PAIRS, *run])), llm_spec(compose([*PAIRS, *without]))
        assert spec.note.endswith(f"reference: {note}") and not spec.reference_copy
        assert all(estimate(spec, lay) == estimate(base, lay) for lay in REFERENCE_LAYOUTS), note


def test_reference_forward_peaks_at_its_log_probs_under_the_policys_peak():
    """The live reference's no-grad forward and answer log-probs (common/preference.py answer_logps, as
    recipes/llm/preference.py runs them) on llm_tiny's fp32 rows, every position labelled: the bytes live at its peak,
    summed from the profiler's allocation events, are the logits, the labelled rows' copy and logsumexp's working
    tensor (reference_logps_bytes, within 2%), and under what the plan counts for the policy's own forward and loss
    (activations + transient) at every AC mode: the copy's forward runs first and frees what it made."""
    from torch.profiler import ProfilerActivity, profile

    from common.memory import reference_logps_bytes
    from common.preference import answer_logps
    from recipes.llm.model import Transformer
    from recipes.llm.sizing import llama_args

    cfg = compose([*PAIRS, "preference.loss=sigmoid"])
    spec, (b, s) = llm_spec(cfg), (cfg.trainer.micro_batch_size, cfg.data.max_seq_len)
    assert cfg.toggles.precision == "fp32"
    reference = Transformer(llama_args(cfg, spec.vocab))
    reference.init_weights(seed=0)
    reference.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, spec.vocab, (b, s), generator=gen) for _ in range(2))
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril()  # one document per row
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = reference(tokens, position_ids=torch.arange(s).repeat(b, 1), attn_mask=mask)
        answer_logps(logits, labels, torch.arange(b)[:, None].expand(b, s), b)
        del logits
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = [0]
    for _, nbytes in events:
        live.append(live[-1] + nbytes)
    predicted = reference_logps_bytes(seq=s, batch=b, vocab=spec.vocab, act_bytes=4)
    print(f"reference forward peak: predicted {predicted:,.0f} B, measured {max(live):,.0f} B")
    assert max(live) == pytest.approx(predicted, rel=0.02)
    for ac in spec.ac_modes:
        est = estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac=ac))
        assert est["activations"] + est["transient"] > max(live), ac


def test_llm_8b_dpo_runs_the_layout_the_planner_ranks_first(capsys):
    """configs/recipe/llm_8b_dpo.yaml (DPO with the live reference at 4096 tokens a row) runs the layout
    `scripts/plan.py recipe=llm_8b_dpo cluster.gpus=8` ranks first (FSDP over dp=8, no AC on 80 GB H100s); its reference
    copy costs each of the 8 GPUs an fp32 eighth of the 8.03B weights, which preference.reference=precomputed saves."""
    assert plan_script.main(["recipe=llm_8b_dpo", "cluster.gpus=8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  1\*\s+8\s+1\s+1\s+1\s+1\s+fsdp\s+none ", out)
    assert "reference: a frozen reference copy of 8.03B in fp32 sharded as the policy" in out
    first = {}
    for ref in ("model", "precomputed"):
        assert plan_script.main(["recipe=llm_8b_dpo", f"preference.reference={ref}", "cluster.gpus=8", "--json"]) == 0
        first[ref] = json.loads(capsys.readouterr().out)["layouts"][0]
    live, precomputed = first["model"], first["precomputed"]
    dry_run(compose(["recipe=llm_8b_dpo", "run.dry_run=true"]), llm_spec(compose(["recipe=llm_8b_dpo"])), 8)
    out = capsys.readouterr().out  # what `torchrun --nproc_per_node 8 scripts/train.py ... run.dry_run=true` prints
    assert "dp=8 tp=1 pp=1, FSDP over dp=8" in out and "total            54.65 GiB" in out
    assert "reference: a frozen reference copy of 8.03B in fp32" in out
    assert live["dp"] == precomputed["dp"] == 8 and live["ac"] == precomputed["ac"] == "none"
    assert live["weights_bytes"] - precomputed["weights_bytes"] == 4 * 8_030_261_248 / 8
    assert live["total_bytes"] - precomputed["total_bytes"] == 4 * 8_030_261_248 / 8  # nothing else differs here
    # the figures docs/preference.md and docs/planner.md quote
    assert [f"{r[k] / 2**30:.2f}" for r in (live, precomputed) for k in ("weights_bytes", "total_bytes")] == [
        "7.48",
        "54.65",
        "3.74",
        "50.91",
    ]


def test_plan_says_llm_8b_lora_fits_one_h100(capsys):
    """`scripts/plan.py recipe=llm_8b finetune=lora cluster.gpus=1`: llm_8b's tp=8 is refused under LoRA, so the plan
    starts from one GPU's layout; at 8192 tokens x micro batch 1 the adapter fits one 80 GB H100 (full AC), where a
    full fine-tune (16 bytes a parameter of states alone) does not."""
    assert plan_script.main(["recipe=llm_8b", "finetune=lora", "cluster.gpus=1"]) == 0
    out = capsys.readouterr().out
    assert "finetune=lora with parallel.tp=8" in out and "micro batch 1 x 8192 tokens on 1 x h100_80gb" in out
    fits = int(re.search(r"(\d+) of \d+ layouts the recipe allows fit", out)[1])
    assert fits >= 1 and re.search(r"\n  \d\*?\s+1\s+1\s+1\s+1\s+1\s+none\s+full ", out)
    assert plan_script.main(["recipe=llm_8b", "parallel.tp=1", "cluster.gpus=1"]) == 0
    assert "0 of 3 layouts the recipe allows fit" in capsys.readouterr().out


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plan.py"), *args], capture_output=True, text=True, timeout=120
    )


def test_plan_cli_table_and_json(capsys):
    assert plan_script.main(["recipe=llm_8b", "cluster.gpus=8", "cluster.gpu=h100_80gb"]) == 0
    table = capsys.readouterr().out
    assert "of 60 layouts the recipe allows fit" in table and "does not fit" not in table
    assert plan_script.main(["recipe=llm_8b", "cluster.gpus=8", "cluster.gpu=h100_80gb", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["params"] == 8_030_261_248 and plan["gpu_memory_bytes"] == GPUS["h100_80gb"].memory
    assert any(lay["fits"] for lay in plan["layouts"]) and not all(lay["fits"] for lay in plan["layouts"])


def test_plan_cli_unknown_gpu_is_one_line_exit_2():
    proc = run_plan("recipe=llm_tiny", "cluster.gpus=8", "cluster.gpu=b200")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kiln: error: unknown cluster.gpu='b200'")
    assert all(name in proc.stderr for name in GPUS)


# ---- e) one memory model: run.dry_run and scripts/plan.py agree ---------------------------------

# What importing transformers/peft/diffusers prints with torchao installed (its CUDA kernels on a CPU build, its
# pytree registrations), silenced by common/known_warnings.py in every CLI: noise a user cannot act on.
IMPORT_NOISE = re.compile(r"Failed to load .*_C_|register_constant\(\) on Enum|Unable to import `torchao`")
DRY_RUN_STATES = re.compile(
    r"model states per GPU: ([\d,]+) bytes \(weights ([\d,]+) \+ grads ([\d,]+) "
    r"\+ optimizer ([\d,]+) \+ gathered ([\d,]+)\)"
)


@pytest.mark.parametrize(
    "recipe, overrides, layout",
    [
        *[("dit_2b", [f"parallel.zero_stage={s}"], dict(dp=8, tp=1, pp=1, zero_stage=s)) for s in range(4)],
        ("llm_8b", ["parallel.tp=2"], dict(dp=4, tp=2, pp=1, zero_stage=3)),  # FSDP over dp=4
        ("sd35_medium", ["parallel.zero_stage=3"], dict(dp=8, tp=1, pp=1, zero_stage=3)),  # without its folder
        ("flux_dev", ["finetune=lora"], dict(dp=8, tp=1, pp=1, zero_stage=3)),  # two layer types, adapter-only states
        ("llm_tiny", ["parallel.cp=2"], dict(dp=4, tp=1, pp=1, cp=2, zero_stage=3)),  # FSDP over dp x cp = 8
        ("llm_8b_128k", [], dict(dp=2, tp=1, pp=1, cp=4, zero_stage=3)),  # the long-context preset's own layout
        ("wan2_1_14b", [], dict(dp=2, tp=1, pp=1, cp=4, zero_stage=3)),  # Ulysses over a clip's tokens, no folder
    ],
)
def test_dry_run_and_plan_report_the_same_model_states(recipe, overrides, layout, capsys):
    """`scripts/train.py run.dry_run=true` (what a user sizes a run with) and `scripts/plan.py` print the
    same per-GPU weights, grads and optimizer bytes for the same layout, to the byte. (In process: the CLIs' own
    processes are test_the_sizing_clis_print_no_import_noise's.)"""
    from recipes import registry
    from scripts.kiln.launch import main as train

    assert train([f"recipe={recipe}", "run.dry_run=true", f"parallel.dp={layout['dp']}", *overrides], registry) == 0
    dry = capsys.readouterr().out
    found = DRY_RUN_STATES.search(dry)
    assert found, dry
    total, weights, grads, optimizer, gathered = (int(g.replace(",", "")) for g in found.groups())
    assert plan_script.main([f"recipe={recipe}", "cluster.gpus=8", "--json", *overrides]) == 0
    planned = json.loads(capsys.readouterr().out)
    ac = compose([f"recipe={recipe}"]).toggles.activation_checkpointing
    row = next(r for r in planned["layouts"] if {k: r[k] for k in layout} == layout and r["ac"] == ac)
    assert (weights, grads, optimizer, gathered) == tuple(
        round(row[f"{k}_bytes"]) for k in ("weights", "grads", "optimizer", "gathered")
    )
    assert total == weights + grads + optimizer + gathered


def test_the_sizing_clis_print_no_import_noise():
    """A user's `run.dry_run` and `scripts/plan.py` print their sizes and nothing a user cannot act on: the DiT's
    dry run imports diffusers and peft, the LLM's plan transformers."""
    dry = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "recipe=flux_dev", "finetune=lora", "run.dry_run=true"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0 and DRY_RUN_STATES.search(dry.stdout), dry.stderr[-2000:]
    planned = run_plan("recipe=llm_8b", "cluster.gpus=8", "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["layouts"], planned.stderr
    for proc in (dry, planned):
        assert not IMPORT_NOISE.search(proc.stderr), proc.stderr


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_dit_plan_holds_the_ema_the_trainer_allocates(zero_stage):
    # dit_2b measured 51.9 GiB on an H100 where the plan said 41.2 GiB: the fp32 EMA (7.9 GiB) was left out.
    # The plan's share for it equals the bytes common/ema.py's EMA allocates on one rank of the same tiny DiT.
    import dataclasses

    from common.ema import EMA
    from recipes.dit.train import build_model, model_geometry

    cfg = compose(["recipe=dit_tiny"])
    spec = dit_spec(cfg)
    in_channels, sample_size, _ = model_geometry(cfg)
    shadow = EMA(build_model(cfg.model, sample_size, in_channels), 0.999).shadow
    allocated = sum(s.numel() * s.element_size() for s in shadow)
    layout = Layout(dp=2, tp=1, pp=1, zero_stage=zero_stage, ac="full")
    planned = estimate(spec, layout)["optimizer"] - estimate(dataclasses.replace(spec, ema=False), layout)["optimizer"]
    # ZeRO-3 partitions the weights, and the EMA tracks the partitions (dp=2: half on each rank).
    assert planned == pytest.approx(allocated / (2 if zero_stage == 3 else 1), rel=1e-3)


# ---- f) context parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("model", LLM_MODELS)
@pytest.mark.parametrize("tp", [1, 2])
def test_cp2_halves_a_ranks_activations_but_the_gathered_keys_and_values(tp, model):
    """At cp=2 a rank holds half of every row: its stored activations are half of cp=1's, except the keys and values
    its attention kernel keeps, which are the whole row's (all-gathered, repeated per query head: 2 x L x heads x
    head_dim per layer, this rank's heads). Live around one layer: the gathered K/V (2 x L x kv_heads x head_dim) and
    the rank's [L/2 x L] bool mask rows, or the logits of its L/2 tokens at the loss, whichever is larger."""
    cfg = compose(["recipe=llm_tiny", *LLM_MODELS[model]])
    spec, m = llm_spec(cfg), cfg.model
    head_dim = m.head_dim or m.dim // m.n_heads
    L, b, e = spec.seq, spec.micro_batch, spec.act_bytes
    one, two = (estimate(spec, Layout(dp=1, tp=tp, pp=1, zero_stage=3, ac="none", cp=cp)) for cp in (1, 2))
    kv_excess = spec.layers * 2 * (L - L // 2) * b * m.n_heads * head_dim * e / tp
    assert two["activations"] == pytest.approx(one["activations"] / 2 + kv_excess, rel=1e-12)
    gather = 2 * L * b * m.n_kv_heads * head_dim * e / tp + b * (L // 2) * L
    logits = (L // 2) * b * spec.vocab * (e + 4)
    assert two["transient"] == pytest.approx(max(gather, logits), rel=1e-12)
    assert one["transient"] == pytest.approx(2 * logits, rel=1e-12)
    # FSDP shards over dp x cp: cp=2 at dp=1 holds half of a one-rank run's states.
    assert two["optimizer"] == pytest.approx(one["optimizer"] / 2) and one["optimizer"] > 0


@pytest.mark.parametrize("model", LLM_MODELS)
def test_cp2_alltoall_keeps_the_whole_row_mask_and_prices_its_exchange(model):
    """Under cp_method=alltoall (Ulysses) a rank's attention covers the whole row with heads/cp heads: its q, k, v and
    output are half of cp=1's bytes, but the dense mask it keeps as a bias is the whole row's, and the inverse
    all-to-all's result (the output projection's input) is kept beside the kernel's output. Live around one layer:
    two buffers of a q-sized tensor (heads x head_dim wide) and the whole row's bool mask (the bytes measured from the
    real exchanges: tests/distributed/test_ulysses.py, test_llm_context_parallel.py)."""
    cfg = compose(["recipe=llm_tiny", "parallel.cp=2", "parallel.cp_method=alltoall", *LLM_MODELS[model]])
    spec, m = llm_spec(cfg), cfg.model
    assert spec.cp_method == "alltoall"
    L, b, e, h = spec.seq, spec.micro_batch, spec.act_bytes, m.n_heads * (m.head_dim or m.dim // m.n_heads)
    one, two = (estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=3, ac="none", cp=cp)) for cp in (1, 2))
    mask = e * b * L * L  # per layer, the same at cp=1 and cp=2
    per_layer = mask / 2 + e * (L // 2) * b * h
    assert two["activations"] == pytest.approx(one["activations"] / 2 + spec.layers * per_layer, rel=1e-12)
    exchange = 2 * (L // 2) * b * h * e + b * L * L
    logits = (L // 2) * b * spec.vocab * (e + 4)
    assert two["transient"] == pytest.approx(max(exchange, logits), rel=1e-12)


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_cp_flash_prices_the_segments_copies_and_no_mask(method):
    """Under toggles.attention=flash the LLM hands the varlen kernel segments built on the host (recipes/llm/
    context_parallel.py VarlenSegments), no mask. allgather: the kernel keeps its copies of each query piece's keys and
    values, at most L + L/(2 cp) per row (the whole row's L at cp=1, GQA's kv heads: the kernel shares them), and
    around a layer the gathered K/V live until copied. alltoall: q, k, v and the output are the bytes of L/cp tokens
    with every head, as under SDPA, and three q-sized buffers live around a layer (the output put back in the gathered
    order, then the send copy and the receive buffer). The copies' bytes measured: tests/unit/test_llm_cp_varlen.py;
    the forward's peak on 2 gloo ranks: tests/distributed/test_llm_context_parallel.py."""
    from common.memory import cp_transient_bytes

    cfg = compose(
        ["recipe=llm_tiny", "toggles.attention=flash", "toggles.precision=bf16", f"parallel.cp_method={method}"]
    )
    spec, m = llm_spec(cfg), cfg.model
    head_dim = m.head_dim or m.dim // m.n_heads
    L, b, e, kv, q = spec.seq, spec.micro_batch, spec.act_bytes, m.n_kv_heads * head_dim, m.n_heads * head_dim
    one, two = (estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=3, ac="none", cp=cp)) for cp in (1, 2))
    shape = dict(seq=L, batch=b, act_bytes=e, cp=2, cp_method=method)
    if method == "allgather":
        per_layer = 2 * (L + L // 4 - L // 2) * b * kv * e  # cp=1 keeps the row's L keys/values: half of them here
        assert cp_transient_bytes(spec.block, **shape) == 2 * L * b * kv * e  # no [L/2 x L] mask rows
    else:
        per_layer = e * (L // 2) * b * q  # the inverse exchange's result, the projection's input
        assert cp_transient_bytes(spec.block, **shape) == 3 * (L // 2) * b * q * e  # no [L x L] mask
    assert two["activations"] == pytest.approx(one["activations"] / 2 + spec.layers * per_layer, rel=1e-12)


def test_vlm_cp_prices_the_gathered_logits_of_whole_rows():
    """The VLM gathers the LM head's logits over cp and takes transformers' loss on whole rows on every cp rank
    (recipes/vlm/context_parallel.py): its log-probabilities and logits are cp=1's, not halved."""
    from recipes.vlm.sizing import memory_spec as vlm_spec

    spec = vlm_spec(compose(["recipe=vlm_tiny", "parallel.cp=2"]))
    assert (spec.cp_method, spec.cp_whole_loss) == ("alltoall", True)
    one, two = (estimate(spec, Layout(dp=1, tp=1, pp=1, zero_stage=0, ac="none", cp=cp)) for cp in (1, 2))
    L, b, e = spec.seq, spec.micro_batch, spec.act_bytes
    assert two["transient"] == one["transient"] == L * b * spec.vocab * (e + 4)  # larger than the exchange here


def test_planner_varies_cp_where_the_recipe_runs_it():
    spec = llm_spec(compose(["recipe=llm_8b", "model.max_seq_len=131072", "data.max_seq_len=131072"]))
    layouts = candidate_layouts(spec, 8)
    assert {lay.cp for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.dp * lay.tp * lay.pp * lay.cp == 8 for lay in layouts)
    assert not any(lay.cp > 1 and lay.ep > 1 for lay in layouts)  # cp x ep: not enumerated
    assert any(lay.cp > 1 and lay.pp > 1 for lay in layouts)  # and runs cp x pp
    assert {lay.cp for lay in candidate_layouts(dit_spec(compose(["recipe=dit_2b"])), 8)} == {1, 2, 4, 8}  # Ulysses
    # 128k tokens in one row: only context parallelism fits it on 80 GB GPUs.
    rows = plan(spec, 8, GPUS["h100_80gb"])
    fitting = [r["layout"] for r in rows if r["fits"]]
    assert fitting and all(lay.cp > 1 for lay in fitting)


def test_llm_8b_128k_runs_the_layout_the_planner_picks_for_its_shapes(capsys):
    """configs/recipe/llm_8b_128k.yaml is llm_8b at 128k tokens per row in the layout `scripts/plan.py recipe=llm_8b
    model.max_seq_len=131072 data.max_seq_len=131072 cluster.gpus=8` ranks first among those that fit (dp=2 x cp=4,
    FSDP, full AC on 80 GB H100s); plan.py then stars the preset's own layout as that first row."""
    long = ["model.max_seq_len=131072", "data.max_seq_len=131072"]
    assert plan_script.main(["recipe=llm_8b", *long, "cluster.gpus=8", "--json"]) == 0
    best = next(r for r in json.loads(capsys.readouterr().out)["layouts"] if r["fits"])
    preset = compose(["recipe=llm_8b_128k"])
    p, spec = preset.parallel, llm_spec(preset)
    ac = preset.toggles.activation_checkpointing
    dp = 8 // (p.tp * p.pp * p.cp)
    configured = configured_layout(spec, dp=dp, tp=p.tp, pp=p.pp, zero_stage=0, ac=ac, ep=p.ep, cp=p.cp)
    assert {k: best[k] for k in ("dp", "tp", "pp", "ep", "cp", "zero_stage", "ac")} == dataclasses.asdict(configured)
    assert (configured.dp, configured.cp, configured.ac) == (2, 4, "full")
    # llm_8b's shapes otherwise (the planner's view of the model), at 128k tokens.
    same_model = dataclasses.replace(llm_spec(compose(["recipe=llm_8b", *long])), name=spec.name)
    assert spec == same_model and spec.seq == 131072
    assert plan_script.main(["recipe=llm_8b_128k", "cluster.gpus=8"]) == 0
    assert re.search(r"\n  1\*\s+2\s+1\s+1\s+1\s+4\s+fsdp\s+full ", capsys.readouterr().out)


# ---- g) the video family: Wan's blocks (recipes/video/sizing.py) -------------------------------------------------

# A tiny WanTransformer3DModel (no folder: its config): 2 heads of 16, an FFN twice as wide, 9 frames of 64x64 through
# the VAE's 4x/8x and 1x2x2 patches = 3 x 4 x 4 = 48 video tokens, 32 prompt tokens, 2 clips.
TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)


def wan_kept_per_block(ac: str, dtype: torch.dtype, text: int = 32, b: int = 2) -> float:
    """Bytes one WanTransformerBlock keeps for backward, measured: a 3-block model's minus a 1-block one's, halved
    (what sits outside the blocks, shared by them, cancels: the patch and prompt embeddings, the RoPE table)."""
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from common.activations import kept_for_backward
    from common.toggles import apply_ac

    def kept(layers: int) -> int:
        torch.manual_seed(0)
        model = WanTransformer3DModel(num_layers=layers, **TINY_WAN).to(dtype)  # DeepSpeed's bf16 casts every weight
        if ac != "none":
            apply_ac(model, ac, (WanTransformerBlock,), recompute_widening=True)  # recipes/video/parallelize.py
        g = torch.Generator().manual_seed(0)
        x = torch.randn(b, 16, 3, 8, 8, generator=g).to(dtype)
        context = torch.randn(b, text, TINY_WAN["text_dim"], generator=g).to(dtype)
        t = torch.rand(b, generator=g) * 1000
        run = lambda: model(x, timestep=t, encoder_hidden_states=context).sample  # noqa: E731
        measured, out = kept_for_backward(run, [*model.parameters(), *model.buffers(), x, context, t])
        del out
        return measured

    return (kept(3) - kept(1)) / 2


@pytest.mark.parametrize(
    "ac, dtype",
    [("none", torch.float32), ("none", torch.bfloat16), ("selective", torch.bfloat16), ("full", torch.bfloat16)],
)
def test_wan_block_activations_match_saved_tensors(ac, dtype):
    """What the memory model says a Wan block keeps (recipes/video/sizing.py wan_block, with the CPU's composite
    rms_norm for the q/k norms: CUDA's fused kernel keeps its input and 1/rms only) against the bytes diffusers'
    WanTransformerBlock keeps, in fp32 and in bf16 (where its fp32 LayerNorms, modulation and MLP gate keep fp32
    copies), with recipes/video/parallelize.py's AC. Not modelled: the LayerNorms' mean and 1/std and the per-block
    modulation vectors (b x 6h)."""
    from recipes.video.sizing import wan_block

    measured = wan_kept_per_block(ac, dtype)
    block = dataclasses.replace(wan_block(TINY_WAN, cross_tokens=32), qk_norm_torch="composite")
    e = 4 if dtype == torch.float32 else 2

    def predicted(block: Block) -> float:
        return layer_activation_bytes(block, seq=48, batch=2, act_bytes=e, recompute=ac)

    print(f"wan block {dtype} AC={ac}: predicted {predicted(block):,.0f} B, measured {measured:,.0f} B")
    assert predicted(block) == pytest.approx(measured, rel=0.03)
    if ac != "full":  # the prompt's keys and values, and (without AC) Wan's fp32 norms, are what tell the cases apart
        assert predicted(dataclasses.replace(block, cross_tokens=0)) != pytest.approx(measured, rel=0.03)
    if ac == "none" and e == 2:
        assert predicted(dataclasses.replace(block, norm="adaln_zero")) != pytest.approx(measured, rel=0.03)


# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' and -14B-Diffusers' transformer/config.json, written out here (independently of
# recipes/video/sizing.py's RELEASED): (heads, ffn_dim, layers).
WAN_RELEASES = {"wan2_1_1_3b": (12, 8960, 30), "wan2_1_14b": (40, 13824, 40)}


@pytest.mark.parametrize(
    "recipe, params, tokens", [("wan2_1_1_3b", 1_418_996_800, 32760), ("wan2_1_14b", 14_288_491_584, 75600)]
)
def test_wan_presets_are_the_releases_sized_without_their_folders(recipe, params, tokens):
    """recipe=wan2_1_* with model.init_from absent here: the transformer counted equals diffusers'
    WanTransformer3DModel built on the meta device from the release's published config; 81 frames through the VAE's
    4x/8x and 1x2x2 patches are 21 x 30 x 52 tokens at 480x832 and 21 x 45 x 80 at 720x1280; beside the engine, on the
    fly, umt5-xxl (transformers' UMT5EncoderModel on the meta device from google/umt5-xxl's config) in bf16 and
    diffusers' default AutoencoderKLWan (the release's) in fp32; on a cache, the VAE without its encoder and
    quant_conv (recipes/video/train.py drops them)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from recipes.video.sizing import memory_spec as video_spec

    heads, ffn, layers = WAN_RELEASES[recipe]
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        reference = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=heads,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=ffn,
            num_layers=layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        )
        umt5 = UMT5EncoderModel(
            UMT5Config(
                vocab_size=256384,
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                feed_forward_proj="gated-gelu",
            )
        )
        vae = AutoencoderKLWan()
    buffers = 2 * sum(b.numel() for b in reference.buffers())
    fly = video_spec(compose([f"recipe={recipe}", "run.dry_run=true"]))
    assert fly.total_params == n(reference) == params and (fly.seq, fly.layers) == (tokens, layers)
    assert fly.layer_params == n(reference.blocks[0]) and fly.block.cross_tokens == 512
    assert fly.unsharded_bytes == 2 * n(umt5) + 4 * n(vae) + buffers
    cached = video_spec(compose([f"recipe={recipe}", "run.dry_run=true", "data.latents=/nonexistent/cache"]))
    assert cached.unsharded_bytes == 4 * (n(vae) - n(vae.encoder) - n(vae.quant_conv)) + buffers
    assert "UMT5 (5.68B) in bf16" in fly.note and "training holds no UMT5" in cached.note


@pytest.mark.parametrize("recipe, layout", [("wan2_1_1_3b", (4, 2, 3, "none")), ("wan2_1_14b", (2, 4, 3, "full"))])
def test_wan_presets_run_the_layout_the_planner_ranks_first(capsys, recipe, layout):
    """configs/recipe/wan2_1_*.yaml run the layout `scripts/plan.py recipe=... cluster.gpus=8` ranks first on 80 GB
    H100s (dp, cp, ZeRO stage, AC): the 14B's 75,600 tokens a clip need cp=4 (40 heads: cp 2, 4 or 8 divide them)."""
    assert plan_script.main([f"recipe={recipe}", "cluster.gpus=8", "--json"]) == 0
    best = next(r for r in json.loads(capsys.readouterr().out)["layouts"] if r["fits"])
    preset = compose([f"recipe={recipe}"])
    p = preset.parallel
    assert (8 // p.cp, p.cp, p.zero_stage, preset.toggles.activation_checkpointing) == layout
    assert (best["dp"], best["cp"], best["zero_stage"], best["ac"]) == layout
