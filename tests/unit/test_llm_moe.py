"""MoE in Kiln's LLM on one process: the grouped-GEMM experts equal a plain loop over experts; tiny random
Mixtral, Qwen3-MoE and Qwen2-MoE checkpoints load through model.init_from's path with logits and the
load-balancing loss equal to transformers'; the export is the source tensor for tensor; bad model.moe values
and unsupported checkpoints stop with one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.errors import ConfigError
from recipes.llm import weights
from recipes.llm.hf_adapter import to_hf_config, to_hf_state_dict
from recipes.llm.model import GroupedExperts, LlamaArgs, MoE, MoEArgs, Transformer, permute_tokens
from recipes.llm.moe_losses import load_balancing_loss, model_router_sums, z_loss
from recipes.llm.train import llama_args
from scripts.kiln.launch import compose
from tests.fixtures.llm import write_moe_folder

# qwen3_moe_norm: the same Qwen3-MoE with norm_topk_prob on (the fixture's is off); mixtral always renormalizes.
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_norm": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen2_moe": ("qwen2_moe", {}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: write_moe_folder(root / name, variant, **overrides) for name, (variant, overrides) in VARIANTS.items()
    }


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def loaded(folder: Path) -> tuple[Transformer, LlamaArgs]:
    """The model as the trainer builds it for one rank: meta, materialized empty, then read from disk."""
    args = llama_args(compose(["recipe=moe_tiny", f"model.init_from={folder}"]), vocab_size=0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers()
    weights.load_weights(model, args, folder)
    return model.eval(), args


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def test_grouped_experts_equal_a_loop_over_experts():
    """One torch._grouped_mm per projection over rows sorted by expert == each (token, choice) through its
    expert's three nn.Linear-style matmuls, forward and gradients; an expert without tokens included."""
    torch.manual_seed(0)
    num_experts, dim, hidden, tokens, top_k = 5, 16, 24, 37, 2
    experts = GroupedExperts(dim, hidden, num_experts)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(tokens, dim, requires_grad=True)
    chosen = torch.randint(0, num_experts - 1, (tokens, top_k))  # expert 4 gets no token
    chosen[:, 1] = (chosen[:, 0] + 1) % (num_experts - 1)
    x_sorted, order, counts = permute_tokens(x, chosen, num_experts)
    assert counts.tolist() == torch.bincount(chosen.flatten(), minlength=num_experts).tolist() and counts[4] == 0
    got = torch.empty(tokens * top_k, dim).index_copy(0, order, experts(x_sorted, counts)).view(tokens, top_k, dim)

    want = torch.stack(
        [
            torch.stack(
                [
                    F.linear(F.silu(F.linear(x[t], experts.w1[e])) * F.linear(x[t], experts.w3[e]), experts.w2[e])
                    for e in chosen[t].tolist()
                ]
            )
            for t in range(tokens)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    upstream = torch.randn_like(want)
    grads = torch.autograd.grad((got * upstream).sum(), [x, experts.w1, experts.w2, experts.w3])
    expected = torch.autograd.grad((want * upstream).sum(), [x, experts.w1, experts.w2, experts.w3])
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", VARIANTS)
def test_checkpoint_logits_aux_loss_and_export_match_transformers(folders, name, tmp_path):
    from transformers import AutoModelForCausalLM

    source = folders[name]
    model, args = loaded(source)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    # Right padding on row 1: its real tokens do not see it (causal), and both aux losses leave it out.
    mask = torch.ones(2, 48, dtype=torch.long)
    mask[1, 30:] = 0
    with torch.no_grad():
        ours = model(tokens)
        layers = moe_layers(model)
        aux, aux_masked = (load_balancing_loss(model_router_sums(layers, m)) for m in (None, mask.flatten()))
        theirs = reference(input_ids=tokens, output_router_logits=True)
        theirs_masked = reference(input_ids=tokens, attention_mask=mask, output_router_logits=True)
    error = (ours - theirs.logits).abs().max().item()
    aux_error = max(abs(aux - theirs.aux_loss).item(), abs(aux_masked - theirs_masked.aux_loss).item())
    print(
        f"{name}: max |logits - transformers| = {error:.2e}; "
        f"aux {aux.item():.6f}, |aux - transformers| = {aux_error:.2e}"
    )
    assert error <= 1e-5 and aux_error <= 1e-6
    assert not torch.isclose(aux, aux_masked)  # the mask matters

    # Round trip with no training: the source's tensors, bit for bit, and its config.json.
    out = tmp_path / "export"
    weights.write_hf_folder(model.state_dict(), args, out, tokenizer=weights.load_tokenizer(source), source=source)
    want, got = tensors(source), tensors(out)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    # Without a source the config is derived from the model (to_hf_config): transformers loads it the same.
    derived = tmp_path / "derived"
    weights.write_hf_folder(model.state_dict(), args, derived, tokenizer=weights.load_tokenizer(source))
    assert json.loads((derived / "config.json").read_text())["architectures"] == reference.config.architectures
    with torch.no_grad():
        for folder in (out, derived):
            again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            assert torch.equal(again(input_ids=tokens).logits, theirs.logits), folder.name


def test_renormalization_is_what_distinguishes_the_two_qwen3_moe(folders):
    """The fixtures share their weights (same seed): only norm_topk_prob differs, and it changes the logits."""
    (on, _), (off, _) = loaded(folders["qwen3_moe_norm"]), loaded(folders["qwen3_moe"])
    tokens = torch.randint(0, 384, (1, 16), generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(on.state_dict().values(), off.state_dict().values()))
    with torch.no_grad():
        assert (on(tokens) - off(tokens)).abs().max() > 1e-3


def test_z_loss_is_the_mean_squared_logsumexp_over_layers_and_tokens():
    args = LlamaArgs(
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        vocab_size=50,
        ffn_dim=64,
        qk_norm=True,
        moe=MoEArgs(num_experts=4, top_k=2, ffn_dim=16),
    )
    model = Transformer(args)
    model.init_weights(seed=0)
    model(torch.randint(0, 50, (2, 10)))
    layers = moe_layers(model)
    logits = torch.cat([m.routing.logits for m in layers])
    torch.testing.assert_close(z_loss(model_router_sums(layers)), torch.logsumexp(logits, -1).square().mean())


def test_dense_layers_keep_their_names():
    """A dense model's FQNs are the Llama's (its checkpoints unchanged); MoE layers name theirs moe.*."""
    dense = LlamaArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=50, ffn_dim=64)
    layer0 = {k for k in Transformer(dense).state_dict() if k.startswith("layers.0.")}
    assert layer0 == {
        f"layers.0.{k}.weight"
        for k in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
            "attention_norm",
            "ffn_norm",
        )
    }
    moe = LlamaArgs(
        dim=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        vocab_size=50,
        ffn_dim=64,
        qk_norm=True,
        moe=MoEArgs(num_experts=4, top_k=2, ffn_dim=16, first_dense_layers=1),
    )
    sd = Transformer(moe).state_dict()
    assert "layers.0.feed_forward.w1.weight" in sd and sd["layers.1.moe.experts.w1"].shape == (4, 16, 32)
    hf_keys = to_hf_state_dict(sd, moe)
    assert (
        "model.layers.1.mlp.experts.3.gate_proj.weight" in hf_keys and "model.layers.0.mlp.gate_proj.weight" in hf_keys
    )
    assert type(to_hf_config(moe)).__name__ == "Qwen3MoeConfig"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.moe.top_k=9", "model.moe.top_k=9 must be between 1 and model.moe.num_experts=8"),
        ("model.moe.ffn_dim=100", "model.moe.ffn_dim=100 must be a multiple of 8"),
        ("model.moe.first_dense_layers=4", "leave no MoE layer among model.n_layers=4"),
        ("model.moe.interval=0", "model.moe.interval=0 must be >= 1"),
        ("model.moe.aux_loss_coef=-1", "model.moe.aux_loss_coef=-1.0 must be >= 0"),
        ("parallel.tp=2", "parallel.tp=2 with model.moe.num_experts=8"),
        ("parallel.ep=3", "parallel.ep=3 must divide model.moe.num_experts=8"),
        ("toggles.compile=true", "toggles.compile=true with model.moe.num_experts>0 needs toggles.precision=bf16"),
        (
            "parallel.dp=2 parallel.ep=2 toggles.activation_checkpointing=selective",
            "toggles.activation_checkpointing=selective with parallel.ep=2 is not supported yet",
        ),
        ("parallel.dp=2 parallel.ep=4", "parallel.ep=4 must divide the 2 data-parallel ranks"),
        ("recipe=llm_tiny parallel.ep=2", "parallel.ep=2 needs an MoE model"),
        ("model.qk_norm=false", "no Hugging Face architecture to export to"),
        ("toggles.precision=fp8", "grouped GEMM has no fp8 path"),
    ],
)
def test_moe_config_mistakes_are_one_line(override, needle):
    with pytest.raises(ConfigError) as exc:
        compose(["recipe=moe_tiny", *override.split()])
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


BAD_MOE_CHECKPOINTS = {
    "deepseek": ("mixtral", dict(model_type="deepseek_v3"), "multi-head latent attention and a sigmoid router"),
    "sliding window": ("mixtral", dict(sliding_window=16), "sliding_window=16"),
    "router jitter": ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    "qwen sliding window": ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window=True"),
    "o_proj bias": ("qwen3_moe", dict(attention_bias=True), "attention_bias=True"),
    "dense layers not first": ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    "unaligned experts": ("qwen2_moe", dict(moe_intermediate_size=30), "must be a positive multiple of 8"),
}


@pytest.mark.parametrize("case", BAD_MOE_CHECKPOINTS)
def test_unsupported_moe_checkpoints_stop_with_one_line(folders, case, tmp_path):
    name, changes, needle = BAD_MOE_CHECKPOINTS[case]
    folder = tmp_path / "model"
    shutil.copytree(folders[name], folder)
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError) as exc:
        weights.checkpoint_args(folder)
    line = str(exc.value)
    assert line.startswith(f"model.init_from={folder}: ") and needle in line and "\n" not in line, line


def test_dense_qk_norm_is_qwen3():
    """model.qk_norm without MoE is dense Qwen3: to_hf_config gives a Qwen3Config whose model has Kiln's logits."""
    from transformers import Qwen3ForCausalLM

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, qk_norm=True)
    model = Transformer(args)
    model.init_weights(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    reference = Qwen3ForCausalLM(to_hf_config(args)).eval()
    missing, unexpected = reference.load_state_dict(to_hf_state_dict(model.state_dict(), args), strict=False)
    assert not missing and not unexpected
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.eval()(tokens) - reference(input_ids=tokens).logits).abs().max() <= 1e-5


def test_expert_parallel_regroups_received_rows_by_local_expert():
    """Rows arrive per source rank, then local expert: rank 0 sent 1 row to expert 0 and 2 to expert 1, rank 1
    sent 3 rows to expert 0. Expert 0's rows come first, in source-rank order."""
    from recipes.llm.expert_parallel import expert_major_order

    order = expert_major_order(torch.tensor([[1, 2], [3, 0]]), total=6)
    assert order.tolist() == [0, 3, 4, 5, 1, 2]
    assert expert_major_order(torch.zeros(2, 3, dtype=torch.long), total=0).tolist() == []


def test_expert_load_against_hand_counts():
    from recipes.llm.moe_losses import expert_load

    counts = torch.tensor([[4.0, 4, 4, 4], [16, 0, 0, 0], [6, 2, 0, 0]])
    max_load, entropy = expert_load(counts)
    torch.testing.assert_close(max_load, torch.tensor([1.0, 4.0, 3.0]))
    p = torch.tensor([0.75, 0.25])
    torch.testing.assert_close(
        entropy,
        torch.stack([torch.tensor(1.0), torch.tensor(0.0), -(p * p.log()).sum() / torch.log(torch.tensor(4.0))]),
    )
