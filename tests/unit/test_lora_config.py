"""finetune=lora's keys and checks (common/lora.py): `full` is the default; `lora` composes on a base checkpoint with
the family's targets filled in; apply_lora freezes all but the adapter, whose seeded init is the same whoever holds
it; every bad input stops with one line, exit 2, nothing written."""

from __future__ import annotations

import pytest
import torch

from common import lora
from common.errors import ConfigError
from common.toggles import apply_ac
from recipes.llm.model import LlamaArgs, Transformer, TransformerBlock
from scripts.kiln.launch import compose
from tests.conftest import kiln_error
from tests.fixtures.llm import write_llama_folder

PROJECTIONS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_llama_folder(tmp_path_factory.mktemp("base") / "gqa", "gqa")


def test_full_is_the_default_and_lora_composes_on_a_base(base):
    cfg = compose(["recipe=llm_tiny"])
    assert cfg.finetune == "full" and not cfg.export.merge_lora
    cfg = compose(["recipe=llm_tiny", "finetune=lora", f"model.init_from={base}", "lora.rank=4", "lora.alpha=8"])
    assert (cfg.finetune, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == ("lora", 4, 8.0, 0.0)
    assert cfg.lora.targets == PROJECTIONS  # [] = the family's: config.yaml records what ran
    assert compose(
        ["recipe=llm_tiny", "finetune=lora", f"model.init_from={base}", "lora.targets=[wq,wv]", "parallel.pp=2"]
    ).lora.targets == ["wq", "wv"]


BAD = {
    "no base": ([], "finetune=lora trains an adapter on a base checkpoint: set model.init_from="),
    "rank 0": (["lora.rank=0", "BASE"], "lora.rank=0 must be > 0"),
    "alpha < 0": (["lora.alpha=-1", "BASE"], "lora.alpha=-1.0 must be > 0"),
    "dropout 1": (["lora.dropout=1.0", "BASE"], "lora.dropout=1.0 must be in [0, 1)"),
    "rank not int": (["lora.rank=big", "BASE"], "lora.rank"),
    "unknown target": (["lora.targets=[wq,q_proj]", "BASE"], "lora.targets: 'q_proj' matches no module"),
    "repeated target": (["lora.targets=[wq,wq]", "BASE"], "names a module twice"),
    "tensor parallel": (["parallel.tp=2", "BASE"], "finetune=lora with parallel.tp=2"),
    "unknown method": (["finetune=qlora", "BASE"], "no such finetune (finetune=qlora); choose one of: full, lora"),
    # A full fine-tune would ignore them: lora.rank=8 (the default's value) is as sure a sign that LoRA was meant.
    "lora keys without lora": (
        ["finetune=full", "lora.rank=8", "lora.targets=[wq]"],
        "lora.rank, lora.targets: LoRA "
        "settings, but this run is finetune=full, which would ignore them; add finetune=lora",
    ),
    "lora section without lora": (
        ["finetune=full", "lora={rank:4}"],
        "lora: LoRA settings, but this run is finetune=full",
    ),
    "unknown quantization": (["lora.quantize_base=int8", "BASE"], "lora.quantize_base='int8': choose one of none, nf4"),
    "nf4 without lora": (
        ["finetune=full", "lora.quantize_base=nf4", "BASE"],
        "lora.quantize_base=nf4 quantizes a LoRA run's frozen base: it needs finetune=lora",
    ),
    "nf4 with dp": (["lora.quantize_base=nf4", "parallel.dp=2", "BASE"], "lora.quantize_base=nf4 runs on one GPU"),
    "nf4 with pp": (["lora.quantize_base=nf4", "parallel.pp=2", "BASE"], "this run has dp=1, tp=1, pp=2"),
    "nf4 compiled": (
        ["lora.quantize_base=nf4", "toggles.compile=true", "BASE"],
        "with toggles.compile=true is not supported yet",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_lora_input_stops_with_one_line(base, case, tmp_path, capsys, monkeypatch):
    extra, needle = BAD[case]
    extra = [f"model.init_from={base}" if e == "BASE" else e for e in extra]
    if any(e.startswith(("parallel.tp=", "parallel.dp=", "parallel.pp=")) for e in extra):
        monkeypatch.setenv("WORLD_SIZE", "2")  # a job of 2 ranks: its layout fits them (the layout is checked first)
    finetune = [] if any(e.startswith("finetune=") for e in extra) else ["finetune=lora"]
    line = kiln_error(["recipe=llm_tiny", *finetune, *extra, f"run.dir={tmp_path / 'run'}"], capsys)
    assert needle in line, line
    assert not (tmp_path / "run").exists()


def test_lora_keys_without_finetune_lora_stop_with_one_line(tmp_path, capsys):
    """The issue's command: `recipe=llm_tiny lora.rank=4` trained every weight and exited 0."""
    line = kiln_error(["recipe=llm_tiny", "lora.rank=4", f"run.dir={tmp_path / 'run'}"], capsys)
    assert "lora.rank: LoRA settings, but this run is finetune=full" in line, line
    assert not (tmp_path / "run").exists()


def test_moe_models_refuse_lora(tmp_path, capsys):
    from tests.fixtures.llm import write_moe_folder

    folder = write_moe_folder(tmp_path / "mixtral", "mixtral")
    capsys.readouterr()  # the fixture's progress bars
    line = kiln_error(["recipe=llm_tiny", "finetune=lora", f"model.init_from={folder}"], capsys)
    assert "finetune=lora on an MoE model (model.moe.num_experts=" in line, line


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """What the ZeRO recipes adapt: a dit_tiny transformer on 16x16 digits saved by diffusers (a DiT export's
    transformer/), a llava-hf folder; and a LLaVA's parts (a CLIP tower, a Llama)."""
    from recipes.dit.model import build_model
    from tests.fixtures import vlm as fx

    root = tmp_path_factory.mktemp("bases")
    build_model(compose(["recipe=dit_tiny"]).model, 16).save_pretrained(root / "dit" / "transformer")
    (root / "empty").mkdir()
    return {
        "DIT": root / "dit" / "transformer",
        "LLAVA": fx.write_llava_hf(root / "llava_hf"),
        "CLIP": fx.write_clip(root / "clip"),
        "LLAMA": fx.write_llama(root / "llama"),
        "EMPTY": root / "empty",
    }


def test_zero_recipes_compose_lora_on_their_base(bases):
    cfg = compose(["recipe=dit_tiny", "finetune=lora", f"model.init_from={bases['DIT'].parent}"])
    assert cfg.model.init_from == str(bases["DIT"])  # the transformer folder of a DiTPipeline / export folder
    assert cfg.lora.targets == ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
    cfg = compose(["recipe=vlm_tiny", "finetune=lora", f"model.init_from={bases['LLAVA']}"])
    assert cfg.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


ZERO_BAD = {  # (recipe, overrides: a capitalised name is one of `bases`), the line's words
    "dit: no base": ("dit_tiny", [], "finetune=lora trains an adapter on a DiT checkpoint: set model.init_from="),
    "dit: not a DiT": ("dit_tiny", ["model.init_from=EMPTY"], "no diffusers DiTTransformer2DModel there"),
    "dit: other size": (
        "dit_tiny",
        ["model.init_from=DIT", "data.image_size=8"],
        "is a DiT on 16x16 inputs; this run's are 8x8",
    ),
    "dit: shared embedding": (
        "dit_tiny",
        ["model.init_from=DIT", "model.shared_conditioning=true"],
        "model.shared_conditioning=true with model.init_from",
    ),
    "dit: a key the base sets": (
        "dit_tiny",
        ["model.init_from=DIT", "model.num_layers=3"],
        "model.num_layers=3 disagrees with model.init_from=",
    ),
    "dit: an LLM name": (
        "dit_tiny",
        ["model.init_from=DIT", "lora.targets=[wq]"],
        "lora.targets: 'wq' matches no module the dit recipe's LoRA",
    ),
    "vlm: no base": ("vlm_tiny", [], "finetune=lora trains an adapter on a LLaVA checkpoint: set model.init_from="),
    "vlm: parts, no LLaVA": (
        "vlm_tiny",
        ["vlm.vision_from=CLIP", "vlm.language_from=LLAMA"],
        "set model.init_from=<a llava-hf folder",
    ),
    "vlm: the tower trains": (
        "vlm_tiny",
        ["model.init_from=LLAVA", "vlm.train_vision=true"],
        "vlm.train_vision=true with finetune=lora",
    ),
    "vlm: an LLM name": (
        "vlm_tiny",
        ["model.init_from=LLAVA", "lora.targets=[wq]"],
        "lora.targets: 'wq' matches no module the vlm recipe's LoRA",
    ),
    "vlm: rank 0": ("vlm_tiny", ["model.init_from=LLAVA", "lora.rank=0"], "lora.rank=0 must be > 0"),
}


@pytest.mark.parametrize("case", ZERO_BAD)
def test_bad_zero_recipe_lora_input_stops_with_one_line(bases, case, tmp_path, capsys):
    recipe, extra, needle = ZERO_BAD[case]
    extra = [key + "=" + str(bases.get(value, value)) for key, _, value in (e.partition("=") for e in extra)]
    line = kiln_error([f"recipe={recipe}", "finetune=lora", *extra, f"run.dir={tmp_path / 'run'}"], capsys)
    assert needle in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["dit_tiny", "vlm_tiny"])
def test_families_without_qlora_refuse_it(recipe, capsys):
    line = kiln_error([f"recipe={recipe}", "finetune=lora", "lora.quantize_base=nf4"], capsys)
    assert f"lora.quantize_base=nf4 is not offered by the {recipe[:3]} recipe yet" in line, line


def test_apply_lora_freezes_the_base_and_inits_the_adapter_alike_everywhere():
    cfg = compose(["recipe=llm_tiny"]).lora
    cfg.targets = PROJECTIONS
    model = Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora.apply_lora(model, cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2 and all(lora.is_adapter_key(n) for n in trainable)
    state = model.state_dict()
    assert {lora.base_key(k) for k in state if not lora.is_adapter_key(k)} == before.keys()
    assert (
        "layers.0.attention.wq.base_layer.weight" in state and "layers.1.feed_forward.w2.lora_B.default.weight" in state
    )

    lora.init_adapter(model, seed=3)
    a, b = state["layers.1.attention.wk.lora_A.default.weight"], state["layers.1.attention.wk.lora_B.default.weight"]
    assert a.abs().max() > 0 and b.abs().max() == 0  # B = 0: the adapted model starts as the base
    shapes = {k: v.shape for k, v in state.items() if lora.is_adapter_key(k)}
    alone = lora.adapter_init(
        ["layers.1.attention.wk.lora_A.default.weight"], shapes, seed=3
    )  # a pipeline stage's share
    assert torch.equal(alone["layers.1.attention.wk.lora_A.default.weight"], a)
    # Under activation checkpointing (its wrapper renames the parameters) the adapter starts the same.
    wrapped = Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48))
    lora.apply_lora(wrapped, cfg)
    apply_ac(wrapped, "full", (TransformerBlock,))
    lora.init_adapter(wrapped, seed=3)
    assert "layers.1._checkpoint_wrapped_module.attention.wk.lora_A.default.weight" in dict(wrapped.named_parameters())
    assert torch.equal(wrapped.state_dict()["layers.1.attention.wk.lora_A.default.weight"], a)
    with pytest.raises(ConfigError, match="'w9' matches no linear"):
        cfg.targets = ["w9"]
        lora.apply_lora(Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)), cfg)


def test_resume_checks_method_adapter_and_base(base, tmp_path, capsys):
    import shutil

    cfg = compose(["recipe=llm_tiny", "finetune=lora", f"model.init_from={base}"])
    meta = lora.checkpoint_meta(cfg, str(base))
    lora.check_resume(meta, cfg, str(base), tmp_path)  # the same: fine
    with pytest.raises(ConfigError, match="is a finetune=full checkpoint; this run is finetune=lora"):
        lora.check_resume({"recipe": "llm_tiny"}, cfg, str(base), tmp_path)
    # Every lora.* key changed on resume: one line with the key, the checkpoint's value and this run's.
    for key, value, words in [
        ("rank", 16, "lora.rank=8, this run asks for 16"),
        ("alpha", 32.0, "lora.alpha=16.0, this run asks for 32.0"),
        ("dropout", 0.1, "lora.dropout=0.0, this run asks for 0.1"),
        ("targets", ["wq"], "lora.targets=['wq', 'wk', 'wv', 'wo', 'w1', 'w2', 'w3'], this run asks for ['wq']"),
        ("quantize_base", "nf4", "lora.quantize_base=none, this run asks for nf4"),
    ]:
        changed = compose(["recipe=llm_tiny", "finetune=lora", f"model.init_from={base}"])
        setattr(changed.lora, key, value)
        with pytest.raises(ConfigError) as err:
            lora.check_resume(meta, changed, str(base), tmp_path)
        assert f"run.resume: {tmp_path} holds an adapter with {words}" in str(err.value), err.value
    # A base of the same names, dtypes and shapes with other weights (a base and its -Instruct twin).
    twin = write_llama_folder(tmp_path / "twin", "gqa", seed=1)
    with pytest.raises(ConfigError, match=f"this run's base {twin} has other weights"):
        lora.check_resume(meta, cfg, str(twin), tmp_path)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    write_llama_folder(tmp_path / "other_weights", "gqa", seed=1, num_hidden_layers=2)
    for f in other.glob("*.safetensors*"):
        f.unlink()
    for f in (tmp_path / "other_weights").glob("*.safetensors*"):
        shutil.copy(f, other / f.name)
    with pytest.raises(ConfigError, match="has other weights"):
        lora.check_resume(meta, cfg, str(other), tmp_path)

    # A checkpoint from before the weights were fingerprinted, its meta.json as written then (rank, alpha, targets and
    # a sha256 of each file's name, size and header): it resumes on its base with a note, not on another shape.
    import hashlib

    headers = hashlib.sha256()
    for path in sorted(base.glob("*.safetensors")):
        data = path.read_bytes()
        headers.update(f"{path.name}:{len(data)}:".encode() + data[8 : 8 + int.from_bytes(data[:8], "little")])
    old = {
        "finetune": "lora",
        "lora": {
            "rank": 8,
            "alpha": 16.0,
            "targets": PROJECTIONS,
            "base": str(base),
            "base_fingerprint": headers.hexdigest(),
        },
    }
    capsys.readouterr()
    lora.check_resume(old, cfg, str(base), tmp_path)
    assert capsys.readouterr().out == (
        f"kiln: note: {tmp_path} records its LoRA base by the safetensors headers only "
        "(a checkpoint from before the weights were fingerprinted): a same-shaped base "
        "with other weights is not detected\n"
    )
    with pytest.raises(ConfigError, match="has other weights"):
        lora.check_resume(old, cfg, str(other), tmp_path)
