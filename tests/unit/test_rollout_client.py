"""The rollout engine's client (common/rollout/client.py) against a stand-in engine process that speaks the same
JSON lines (no vLLM): the probe check passes within the bound and stops with one line (WeightSyncError) outside it
or on NaN, the pushed file holds the state given, and an engine that dies or refuses a request is one RuntimeError
with its reason. The real engine: tests/integration/test_rollout_vllm.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from common.errors import WeightSyncError
from common.rollout.client import RolloutEngine, token_logprobs

PROBE = [1, 5, 7, 9]
ENGINE_LOGPROBS = [-1.0, -2.0, -3.0]

# Stands in for vLLM's interpreter running vllm_process.py: ready, then an answer per request. It records what
# load_weights was handed (the tensors' names and sums) and dies on "generate" when told to.
FAKE = """#!{python}
import json, os, sys
from safetensors.numpy import load_file  # not torch: the stand-in starts in a blink
if {die_at_start}:
    print("engine: no such model", file=sys.stderr)
    sys.exit(3)
out = sys.stdout
out.write(json.dumps({{"ok": True, "event": "ready"}}) + "\\n"); out.flush()
for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "stop":
        break
    if req["cmd"] == "score":
        answer = {{"ok": True, "logprobs": {logprobs}}}
    elif req["cmd"] == "load_weights":
        state = load_file(req["path"] + "/model.safetensors")
        answer = {{"ok": True, "loaded": {{k: float(v.sum()) for k, v in state.items()}}}}
        open({record!r}, "w").write(json.dumps({{"path": req["path"], **answer["loaded"]}}))
    elif req["cmd"] == "load_adapter":  # vLLM refuses an adapter with a lora_B missing
        files = sorted(os.listdir(req["path"]))
        state = load_file(req["path"] + "/adapter_model.safetensors")
        if len(state) % 2:
            answer = {{"ok": False, "error": "load_adapter: TypeError: unsupported operand type(s)"}}
        else:
            answer = {{"ok": True}}
            sums = {{k: float(v.sum()) for k, v in state.items()}}
            open({record!r}, "w").write(json.dumps({{"id": req["id"], "files": files, **sums}}))
    else:
        answer = {{"ok": False, "error": "generate: ValueError: max_tokens must be at least 1"}}
    out.write(json.dumps(answer) + "\\n"); out.flush()
"""


def fake_engine(tmp_path, die_at_start: bool = False) -> RolloutEngine:
    python = tmp_path / "python"
    record = tmp_path / "loaded.json"
    python.write_text(
        FAKE.format(python=sys.executable, die_at_start=die_at_start, logprobs=ENGINE_LOGPROBS, record=str(record))
    )
    python.chmod(0o755)
    return RolloutEngine(tmp_path / "export", python=python, log_path=tmp_path / "engine.log", probe=PROBE)


def test_token_logprobs_are_the_log_softmax_of_the_next_token():
    torch.manual_seed(0)
    logits, ids = torch.randn(4, 6), torch.tensor([2, 5, 0, 3])
    want = [torch.log(torch.exp(logits[t]) / torch.exp(logits[t]).sum())[ids[t + 1]].item() for t in range(3)]
    assert torch.allclose(token_logprobs(logits, ids), torch.tensor(want), atol=1e-6)


def test_a_sync_within_the_bound_passes_and_the_engine_gets_the_state(tmp_path):
    state = {"model.norm.weight": torch.ones(3), "lm_head.weight": torch.full((2, 3), 2.0)}
    with fake_engine(tmp_path) as engine:
        report = engine.sync(state, [x + 5e-5 for x in ENGINE_LOGPROBS])
    assert report.gap == pytest.approx(5e-5, rel=1e-6)
    assert report.bytes > 4 * 9
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert not Path(loaded.pop("path")).exists()  # the push's folder goes once the engine has loaded it
    assert loaded == {"model.norm.weight": 3.0, "lm_head.weight": 12.0}


@pytest.mark.parametrize("shift", [0.5, float("nan")])
def test_a_sync_outside_the_bound_stops_with_one_line(tmp_path, shift):
    with fake_engine(tmp_path) as engine, pytest.raises(WeightSyncError) as raised:
        engine.sync({"w": torch.zeros(2)}, [x + shift for x in ENGINE_LOGPROBS])
    message = str(raised.value)
    assert "\n" not in message and "did not take the trainer's weights" in message and "bound 0.0001" in message


def test_an_engine_that_dies_or_refuses_is_one_error_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exited \(3\) during start.*engine: no such model"):
        fake_engine(tmp_path, die_at_start=True).start()
    with fake_engine(tmp_path) as engine, pytest.raises(RuntimeError, match="max_tokens must be at least 1"):
        engine.generate([[1, 2]], n=2, max_tokens=0)


def test_a_lora_sync_sends_a_peft_folder_under_a_new_id_and_a_refused_one_stops_in_one_line(tmp_path):
    from common.config import LoRAConfig
    from common.lora import peft_config

    config = peft_config(LoRAConfig(rank=2), ["q_proj"])
    names = [f"base_model.model.model.layers.0.self_attn.q_proj.lora_{p}.weight" for p in "AB"]
    adapter = {names[0]: torch.ones(2, 3), names[1]: torch.full((3, 2), 2.0)}
    record = tmp_path / "loaded.json"
    engine = fake_engine(tmp_path)
    engine.lora_rank = 2
    assert engine.command()[-3:-1] == ["--max-lora-rank", "2"]
    with engine:
        for want_id in (1, 2):  # a new id each sync: vLLM would not read a folder again under an id it holds
            report = engine.sync(adapter, ENGINE_LOGPROBS, config)
            loaded = json.loads(record.read_text())
            assert loaded == {"id": want_id, "files": ["adapter_config.json", "adapter_model.safetensors"]} | {
                names[0]: 6.0,
                names[1]: 12.0,
            }
            assert 4 * 12 < report.bytes < 4 * 12 + 1024  # the adapter's file: its tensors and a short header
        with pytest.raises(WeightSyncError) as raised:
            engine.sync({names[0]: adapter[names[0]]}, ENGINE_LOGPROBS, config)
    message = str(raised.value)
    assert "\n" not in message and "did not take the trainer's adapter" in message and "TypeError" in message
    assert engine.adapter_id == 2  # the refused adapter's id is not the engine's


def test_a_push_without_room_in_shared_memory_goes_to_the_temporary_folder(monkeypatch, tmp_path):
    import shutil
    import tempfile

    from common.rollout.client import weights_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 64 << 20, 0))
    assert weights_folder(1).parent == tmp_path  # a full /dev/shm (or none): the temporary folder
    if Path("/dev/shm").is_dir():
        monkeypatch.undo()
        folder = weights_folder(1)
        shutil.rmtree(folder)
        assert folder.parent == Path("/dev/shm")
