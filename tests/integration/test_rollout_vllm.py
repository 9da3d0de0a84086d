"""The rollout engine (common/rollout: vLLM's CPU build in its own process) on llm_tiny's export: G samples per
prompt whose log-probs equal transformers' on the same tokens, the trainer's weights pushed into the running engine
in place (the engine's probe log-probs then equal the trainer's own, Kiln's model, and no longer the old weights'),
and a push broken on purpose stopped with one line. Under LoRA (a second engine, LoRA enabled, on the same export):
a sync sends the adapter only (the PEFT folder the export writes), which the engine then scores through, and an
adapter that did not take (the old one still in use, a tensor left out) stops with one line. One engine start (~45 s
on 2 cores) for the whole-weights tests, one for the LoRA tests.

Independent references: transformers' LlamaForCausalLM on the same weights and tokens (the samples, the probe after
a sync), and peft's PeftModel over it for an adapter; the trainer's side is Kiln's own Transformer (with peft's LoRA
layers), as the RL trainer holds it. All in float32.
"""

from __future__ import annotations

import pytest
import torch

from common.config import LoRAConfig
from common.errors import WeightSyncError
from common.lora import apply_lora, write_adapter_folder
from common.rollout.client import PROBE_BOUND, RolloutEngine, token_logprobs
from recipes.llm import weights
from recipes.llm.config import LORA_TARGETS
from recipes.llm.hf_adapter import to_hf_state_dict
from recipes.llm.lora import peft_adapter
from recipes.llm.model import Transformer
from scripts.kiln.serving import serve_venv
from tests.fixtures.runs import LLM_SERVED
from tests.fixtures.vllm import NEEDS_VLLM

pytestmark = NEEDS_VLLM

# The gap between the engine's log-probs and transformers' / Kiln's on the same fp32 weights: measured 1.2e-6 at
# most on llm_tiny (docs/rl.md; `pytest -s` prints it); asserted here with ~10x room. The run's check (PROBE_BOUND)
# allows more, for larger models and longer probes; a sync that did not take moved the probe by 0.2.
SAME = 1e-5
PROBE = [1, *range(40, 100, 2)]  # 31 tokens: BOS, then ids of the 2048-token tokenizer
LORA = LoRAConfig(rank=8, alpha=16.0, targets=list(LORA_TARGETS))  # every linear, as finetune=lora's default


@pytest.fixture(scope="module")
def export(trained):
    return trained(LLM_SERVED) / "export"  # test_serve and test_serve_vllm serve the same run's export


@pytest.fixture(scope="module")
def engine(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("rollout") / "engine.log"
    with RolloutEngine(export, python=serve_venv() / "bin" / "python", log_path=log, probe=PROBE) as running:
        yield running


@pytest.fixture(scope="module")
def policy(export):
    """The trainer's model: Kiln's Transformer with the export's weights, float32 (the tests perturb it in place)."""
    args = weights.checkpoint_args(export)
    model = Transformer(args)
    weights.load_weights(model, args, export)
    return model.eval(), args


@pytest.fixture(scope="module")
def hf_model(export):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()


def hf_state(policy) -> dict[str, torch.Tensor]:
    model, args = policy
    return to_hf_state_dict(model.state_dict(), args)


def kiln_logprobs(policy, ids: list[int]) -> torch.Tensor:
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        return token_logprobs(policy[0](ids_t[None])[0], ids_t)


def hf_logprobs(hf_model, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """transformers' log-probs of ids[1:] on `state` (the weights the engine should hold)."""
    hf_model.load_state_dict(state, strict=True)
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        return token_logprobs(hf_model(ids_t[None]).logits[0], ids_t)


def perturb(policy, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy[0].parameters():
            p.add_(0.05 * torch.randn_like(p))


def test_generate_gives_g_samples_with_transformers_logprobs(engine, policy, hf_model):
    prompts = [[1, 300, 301, 302], "The with statement"]
    settings = dict(n=4, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    groups = engine.generate(prompts, **settings)
    assert [len(g.samples) for g in groups] == [4, 4]
    assert groups[0].prompt_token_ids == prompts[0]
    state = hf_state(policy)
    gaps = []
    for group in groups:
        texts = set()
        for s in group.samples:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 8
            want = hf_logprobs(hf_model, state, group.prompt_token_ids + s.token_ids)[len(group.prompt_token_ids) - 1 :]
            # vLLM's raw log-probs: the model's own distribution, whatever temperature and top_p sampled from it.
            gaps.append(torch.tensor(s.logprobs).sub(want).abs().max().item())
            texts.add(tuple(s.token_ids))
        assert len(texts) > 1  # G samples, not one sample G times
    print(f"rollout: engine start {engine.start_s:.1f} s; samples' log-probs vs transformers' max gap {max(gaps):.2g}")
    assert max(gaps) <= SAME
    again = engine.generate(prompts, **settings)  # the request's seed: the same samples
    assert [[s.token_ids for s in g.samples] for g in again] == [[s.token_ids for s in g.samples] for g in groups]
    # Stop strings: the same samples, cut before the first occurrence of a string one of them contains.
    text = groups[1].samples[0].text
    stop = text[len(text) // 2 :][:3]
    cut = engine.generate(prompts[1:], **settings, stop=[stop])[0].samples
    assert stop and cut[0].finish_reason == "stop"
    for full, short in zip(groups[1].samples, cut):
        if stop in full.text:
            assert (short.text, short.finish_reason) == (full.text[: full.text.index(stop)], "stop")
        else:
            assert short.token_ids == full.token_ids


def test_a_sync_moves_the_running_engine_onto_the_trainers_weights(engine, policy, hf_model):
    before = torch.tensor(engine.score(PROBE))
    assert before.sub(kiln_logprobs(policy, PROBE)).abs().max().item() <= SAME  # the export's weights at start
    perturb(policy, seed=1)
    trainer = kiln_logprobs(policy, PROBE)
    assert trainer.sub(before).abs().max().item() > 0.1  # the new weights score the probe differently
    state = hf_state(policy)
    report = engine.sync(state, trainer)
    print(
        f"rollout sync: {report.bytes:,} bytes; write {report.write_s * 1e3:.1f} ms, in-place load "
        f"{report.load_s * 1e3:.1f} ms, probe check {report.check_s * 1e3:.1f} ms; gap to Kiln's {report.gap:.2g}"
    )
    assert report.gap <= SAME
    assert report.bytes >= sum(t.numel() * 4 for t in state.values())
    after = torch.tensor(engine.score(PROBE))
    assert after.sub(hf_logprobs(hf_model, state, PROBE)).abs().max().item() <= SAME  # transformers agrees
    assert after.sub(before).abs().max().item() > 0.1


def test_a_sync_that_did_not_take_stops_with_one_line(engine, policy):
    perturb(policy, seed=2)
    state = hf_state(policy)
    trainer = kiln_logprobs(policy, PROBE)
    skipped = {k: v for k, v in state.items() if k != "model.layers.1.mlp.down_proj.weight"}
    # vLLM keeps the layer's old tensor (its log says "Failed to load weights"): the probe sees it.
    with pytest.raises(WeightSyncError) as raised:
        engine.sync(skipped, trainer)
    message = str(raised.value)
    print(f"rollout broken sync: {message}")
    assert "\n" not in message and "did not take the trainer's weights" in message
    assert f"bound {PROBE_BOUND:g}" in message
    assert engine.sync(state, trainer).gap <= SAME  # the whole state again: the engine catches up, in place


# ---- LoRA: the adapter moves, the base stays ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_engine(export, tmp_path_factory):
    log = tmp_path_factory.mktemp("rollout-lora") / "engine.log"
    python = serve_venv() / "bin" / "python"
    with RolloutEngine(export, python=python, log_path=log, probe=PROBE, lora_rank=LORA.rank) as running:
        yield running


@pytest.fixture(scope="module")
def lora_policy(export):
    """The trainer's finetune=lora model: Kiln's Transformer on the export with peft's adapters on every linear."""
    args = weights.checkpoint_args(export)
    model = Transformer(args)
    weights.load_weights(model, args, export)
    return apply_lora(model, LORA).eval(), args


def new_adapter(lora_policy, export, seed: int):
    """Draw the policy's adapter afresh (B non-zero: it changes the probe) and return it as a sync sends it."""
    model, args = lora_policy
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.05)
    return peft_adapter(model.state_dict(), args, LORA, str(export))


def test_a_lora_sync_sends_the_adapter_only_and_the_engine_scores_it(lora_engine, lora_policy, export, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = torch.tensor(lora_engine.score(PROBE))  # no adapter yet: the base
    adapter, config = new_adapter(lora_policy, export, seed=3)
    trainer = kiln_logprobs(lora_policy, PROBE)
    assert trainer.sub(base).abs().max().item() > 0.05  # the adapter scores the probe differently
    report = lora_engine.sync(adapter, trainer, config)
    write_adapter_folder(tmp_path / "adapter", adapter, config)  # the export's writer, the same folder
    size = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    whole = (export / "model.safetensors").stat().st_size
    print(
        f"rollout LoRA sync: {report.bytes:,} bytes (the base: {whole:,}); write {report.write_s * 1e3:.1f} ms, "
        f"adapter load {report.load_s * 1e3:.1f} ms, probe check {report.check_s * 1e3:.1f} ms; gap {report.gap:.2g}"
    )
    assert report.gap <= SAME
    assert report.bytes == size  # the adapter's bytes: the base is not sent
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.tensor(PROBE)
    with torch.no_grad():
        want = token_logprobs(peft_model(ids[None]).logits[0], ids)
    assert torch.tensor(lora_engine.score(PROBE)).sub(want).abs().max().item() <= SAME  # peft agrees
    adapter, config = new_adapter(lora_policy, export, seed=4)  # the next sync's adapter replaces this one
    assert lora_engine.sync(adapter, kiln_logprobs(lora_policy, PROBE), config).gap <= SAME


def test_a_lora_sync_that_did_not_take_stops_with_one_line(lora_engine, lora_policy, export):
    adapter, config = new_adapter(lora_policy, export, seed=5)
    trainer = kiln_logprobs(lora_policy, PROBE)
    # The old adapter still in use: the new folder under the id the engine holds, which vLLM does not read again.
    lora_engine.adapter_id -= 1
    with pytest.raises(WeightSyncError) as stale:
        lora_engine.sync(adapter, trainer, config)
    # An adapter tensor left out: vLLM refuses the folder and keeps the adapter it has.
    left_out = {k: v for k, v in adapter.items() if k != "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"}
    with pytest.raises(WeightSyncError) as partial:
        lora_engine.sync(left_out, trainer, config)
    for raised in (stale, partial):
        message = str(raised.value)
        print(f"rollout broken LoRA sync: {message}")
        assert "\n" not in message and "did not take the trainer's" in message
    assert lora_engine.sync(adapter, trainer, config).gap <= SAME  # the whole adapter under a new id: taken
