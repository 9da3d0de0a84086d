"""moe_tiny in one process: the MoE recipe trains on the pydoc corpus with a falling loss, logs its load-balancing
and z losses on their own, and exports a Qwen3MoeForCausalLM folder that transformers loads and runs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metrics
from tests.fixtures.runs import MOE_16_STEPS

pytestmark = pytest.mark.integration


def test_moe_tiny_trains_logs_its_aux_losses_and_exports(trained):
    import torch
    from transformers import AutoModelForCausalLM

    run, proc = trained.run(MOE_16_STEPS)  # test_serve_vllm serves its export
    records = metrics(run)
    assert sorted(records) == [4, 8, 12, 16]
    assert records[16]["loss"] < records[4]["loss"] - 0.5, {s: r["loss"] for s, r in records.items()}
    for r in records.values():
        # E * sum_e f_e P_e is top_k (2) when routing is uniform, and larger when it is not.
        assert 1.9 < r["aux_loss"] < 8 and r["z_loss"] > 0, r
        # The expert load of each MoE layer (layer 0 is dense): max/mean in [1, 8 experts], entropy in [0, 1].
        layers = [r[f"moe.layer{i}.max_load"] for i in (1, 2, 3)]
        assert all(1 <= x <= 8 for x in layers) and r["moe.max_load"] == max(layers), r
        assert all(0 < r[f"moe.layer{i}.load_entropy"] <= 1 for i in (1, 2, 3)) and "moe.layer0.max_load" not in r
    worst = max(r["moe.max_load"] for r in records.values())
    assert "kiln: MoE expert load: worst max/mean" in proc.stdout
    print(f"worst logged max/mean load {worst:.2f}; {proc.stdout.split('kiln: MoE expert load: ')[1].splitlines()[0]}")
    assert json.loads((run / "export" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.mlp_only_layers, c.norm_topk_prob) == (8, 2, [0], True)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(16)[None]).logits).all()
    assert (run / "samples" / "generation.txt").is_file()
