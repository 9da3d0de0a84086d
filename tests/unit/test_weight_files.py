"""Weight folders a run starts from (common/weights.py): a safetensors file cut short or damaged stops every family's
launch (full and LoRA) and the DiT server with one line naming the file, before anything is written; the fingerprint
of a LoRA run's base tells same-shaped weights apart, read from samples of every tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import ConfigError
from tests.conftest import kiln_error, load_script
from tests.fixtures.llm import write_llama_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One base per family: a Llama (bf16, in 40 KB shards with an index), a dit_tiny transformer on 16x16 digits
    saved by diffusers, a llava-hf folder."""
    from recipes.dit.model import build_model
    from scripts.kiln.launch import compose
    from tests.fixtures import vlm as fx

    root = tmp_path_factory.mktemp("weights")
    build_model(compose(["recipe=dit_tiny"]).model, 16).save_pretrained(root / "dit")
    return {"llm": write_llama_folder(root / "llm", "gqa"), "dit": root / "dit", "vlm": fx.write_llava_hf(root / "vlm")}


def cut_short(path):
    """What an interrupted download or copy leaves: the header intact, the tensor data cut."""
    path.write_bytes(path.read_bytes()[:-100])


DAMAGE = {  # what happened to the file, the line's words
    "data cut short": (cut_short, "is cut short: its header describes"),
    "header cut short": (lambda p: p.write_bytes(p.read_bytes()[:40]), "is cut short: its header alone is"),
    "empty": (lambda p: p.write_bytes(b""), "is cut short (0 bytes: not even a safetensors header)"),
    "an error page": (lambda p: p.write_bytes(b"<html>404 Not Found</html>"), "is not a safetensors file"),
    "bytes appended": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), "is damaged: it holds"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_read_header_checks_the_file_against_its_header(case, tmp_path):
    from common.weights import read_header

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(300, 7), "b": torch.zeros(3, dtype=torch.bfloat16)}, path)
    _, tensors, _ = read_header(path, "model.init_from=x")
    with safe_open(path, framework="pt") as f:  # the reference: safetensors' own reading
        assert {k: (v["dtype"], v["shape"]) for k, v in tensors.items()} == {
            k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()
        }
    damage, needle = DAMAGE[case]
    damage(path)
    with pytest.raises(ConfigError) as err:
        read_header(path, "model.init_from=x")
    assert str(err.value).startswith(f"model.init_from=x: {path} ") and needle in str(err.value), err.value


FAMILIES = {  # recipe, finetune, base
    "llm full": ("llm_tiny", "full", "llm"),
    "llm lora": ("llm_tiny", "lora", "llm"),
    "dit full": ("dit_tiny", "full", "dit"),
    "dit lora": ("dit_tiny", "lora", "dit"),
    "vlm full": ("vlm_tiny", "full", "vlm"),
    "vlm lora": ("vlm_tiny", "lora", "vlm"),
}


@pytest.mark.parametrize("case", FAMILIES)
def test_a_base_file_cut_short_stops_the_launch_with_one_line(folders, case, tmp_path, capsys):
    recipe, finetune, family = FAMILIES[case]
    base = shutil.copytree(folders[family], tmp_path / "base")
    victim = sorted(base.glob("*.safetensors"))[-1]
    cut_short(victim)
    capsys.readouterr()
    run = tmp_path / "run"
    argv = [f"recipe={recipe}", f"finetune={finetune}", f"model.init_from={base}", f"run.dir={run}"]
    line = kiln_error(argv, capsys)
    assert f"{victim} is cut short: its header describes" in line, line
    assert not run.exists()


def test_the_dit_server_refuses_an_export_with_a_file_cut_short(folders, tmp_path, capsys):
    """scripts/serve.py on a DiT export whose transformer weights are cut short: one line, exit 2 (the dry run too)."""
    export = tmp_path / "export"
    shutil.copytree(folders["dit"], export / "transformer")
    (export / "scheduler").mkdir()
    for name in ("kiln.json", "scheduler/scheduler_config.json"):
        (export / name).write_text("{}")
    victim = next((export / "transformer").glob("*.safetensors"))
    cut_short(victim)
    with pytest.raises(SystemExit) as exit_:
        load_script("serve").main([f"serve.model={export}", "serve.dry_run=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"kiln: error: serve.model={export}: {victim} is cut short"), err


def test_the_fingerprint_tells_same_shaped_weights_apart(folders, tmp_path):
    """A copy of a base has its fingerprint; a twin of the same names, dtypes and shapes (a base and its -Instruct
    release) has another, though its headers -- all the fingerprint read before -- are the base's."""
    from common.weights import fingerprint, header_fingerprint

    base = folders["llm"]
    copy = shutil.copytree(base, tmp_path / "copy")
    twin = write_llama_folder(tmp_path / "twin", "gqa", seed=1)
    assert header_fingerprint(twin) == header_fingerprint(base)
    assert fingerprint(copy) == fingerprint(base) != fingerprint(twin)


def test_a_fine_tune_of_a_large_tensor_changes_its_sampled_fingerprint(tmp_path):
    """A tensor above SAMPLE_CHUNKS x SAMPLE_BYTES is read in samples: a fine-tune (every element moved a little) or
    an edit of its last element changes the fingerprint, as an edit of a small tensor (read whole) does."""
    from common.weights import SAMPLE_BYTES, SAMPLE_CHUNKS, fingerprint

    weight, norm = torch.randn(1024, 1024), torch.ones(64)
    assert weight.nbytes > 4 * SAMPLE_CHUNKS * SAMPLE_BYTES

    def saved(name, **tensors):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"weight": weight, "norm": norm, **tensors}, folder / "model.safetensors")
        return fingerprint(folder)

    edited = weight.clone()
    edited.view(-1)[-1] += 1
    prints = [
        saved("base"),
        saved("fine_tuned", weight=weight + 1e-4 * torch.randn_like(weight)),
        saved("last_element", weight=edited),
        saved("norm", norm=norm * 1.01),
    ]
    assert len(set(prints)) == len(prints), prints
