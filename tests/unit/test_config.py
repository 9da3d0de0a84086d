"""Every shipped config composes and validates; user mistakes fail with one line, nothing written."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from common.errors import ConfigError
from scripts.kiln.launch import compose
from tests.conftest import REPO, TRAIN
from tests.support.launcher import run_python

RECIPES = sorted(p.stem for p in (REPO / "configs" / "recipe").glob("*.yaml"))
# A group option whose schema is a family's (configs/<group>/<option>.yaml's first default) composes with
# that family's tiny recipe; the others with every family's.
SCHEMA_RECIPES = {
    "dit_schema": ["dit_tiny"],
    "vlm_schema": ["vlm_tiny"],
    "llm_schema": ["llm_tiny"],
    "t2i_schema": ["t2i_tiny"],
    "video_schema": ["video_tiny"],
    "zero_schema": ["dit_tiny", "vlm_tiny", "t2i_tiny", "video_tiny"],
}


def _schema(option: Path) -> str | None:
    import yaml

    defaults = (yaml.safe_load(option.read_text()) or {}).get("defaults") or [None]
    return defaults[0] if isinstance(defaults[0], str) else None


GROUP_OPTIONS = [
    (group.name, p.stem, recipe)
    for group in sorted((REPO / "configs").iterdir())
    # family-specific; finetune=lora needs a base checkpoint (tests/unit/test_lora_config.py composes it)
    if group.is_dir() and group.name not in ("recipe", "model", "diffusion", "vlm", "finetune")
    for p in sorted(group.glob("*.yaml"))
    for recipe in SCHEMA_RECIPES.get(_schema(p), ["dit_tiny", "vlm_tiny", "llm_tiny"])
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes(recipe):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.recipe.name == recipe
    assert cfg.recipe.family in ("dit", "vlm", "llm", "t2i", "video")


@pytest.mark.parametrize("group,option,recipe", GROUP_OPTIONS)
def test_every_group_option_composes(group, option, recipe):
    cfg = compose([f"recipe={recipe}", f"{group}={option}"])
    assert cfg is not None


def test_each_family_has_only_its_own_parallel_and_data_keys():
    """The root schema is not the union of the families': ZeRO is the DeepSpeed recipes', tp/pp/ep the LLM's,
    image sizes and latents the DiT's, packing the VLM's (the LLM always packs), eval_docs the LLM's."""
    keys = {r: compose([f"recipe={r}"]) for r in ("dit_tiny", "vlm_tiny", "llm_tiny")}
    fields = {
        r: ({f.name for f in dataclasses.fields(c.parallel)}, {f.name for f in dataclasses.fields(c.data)})
        for r, c in keys.items()
    }
    # parallel.cp (and cp_method) is every family's key, one meaning: the sequence split over cp ranks.
    every = {"dp", "timeout_s", "cp", "cp_method"}
    assert fields["dit_tiny"][0] == fields["vlm_tiny"][0] == every | {"zero_stage"}
    assert fields["llm_tiny"][0] == every | {"tp", "pp", "ep", "pp_schedule", "pp_microbatches"}
    common = {"name", "root", "build", "build_hint", "num_workers", "shuffle_buffer", "max_corrupt_shards"}
    assert fields["dit_tiny"][1] == common | {"image_size", "latents"}
    # Qwen-VL's pixel budget and video sampling; the loader's plan of micro-batches by the samples' sizes
    assert fields["vlm_tiny"][1] == common | {
        "packing",
        "max_seq_len",
        "min_pixels",
        "max_pixels",
        "video_fps",
        "max_frames",
        "pack_buffer",
    }
    assert fields["llm_tiny"][1] == common | {"max_seq_len", "eval_docs"}


def test_recipe_is_a_delta_over_the_defaults():
    tiny, big = compose(["recipe=dit_tiny"]), compose(["recipe=dit_2b"])
    assert tiny.model.num_layers == 4 and big.model.num_layers == 28
    assert big.parallel.zero_stage == 2 and big.toggles.precision == "bf16"
    assert big.toggles.activation_checkpointing == "full"


def test_dataset_builder_argv_follows_the_model():
    """data.build is the builder's argv; the VLM's processor sizes come from the model config."""
    assert compose(["recipe=dit_tiny"]).data.build == ["data.prepare_digits"]
    assert compose(["recipe=llm_tiny"]).data.build == ["data.prepare_text"]
    assert compose(["recipe=vlm_tiny"]).data.build == [
        "data.prepare_vlm_digits",
        "--image-size",
        "16",
        "--patch-size",
        "4",
    ]
    cfg = compose(["recipe=vlm_tiny", "model.image_size=32", "model.vision_patch_size=8"])
    assert cfg.data.build == ["data.prepare_vlm_digits", "--image-size", "32", "--patch-size", "8"]
    assert compose(["recipe=vlm_7b", "data=vlm_digits"]).data.build[2:] == ["336", "--patch-size", "14"]
    assert compose(["recipe=vlm_7b"]).data.build == []  # LLaVA data: a user dataset (data.prepare_llava builds it)
    assert compose(["recipe=dit_tiny", "data.build=[]"]).data.build == []


@pytest.fixture
def notes(monkeypatch, capsys):
    """() -> the `kiln: note:` lines on stderr since the last call; every renamed key is noted afresh (a process
    notes each once: common/compose.py)."""
    import common.compose

    monkeypatch.setattr(common.compose, "_NOTED", set())
    capsys.readouterr()
    return lambda: [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln: note:")]


def test_renamed_keys_reach_the_code_that_reads_them(notes):
    """diffusion.sample_every is the DiT's sample period (no other family draws samples); the VLM's model.max_seq_len
    and model.vision_patch_size are its LLaVA's text max_position_embeddings and vision patch_size."""
    from types import SimpleNamespace

    from recipes.dit.train import DiTTrainer
    from recipes.vlm.model import llava_config

    assert compose(["recipe=dit_tiny"]).diffusion.sample_every == 500  # configs/recipe/dit_tiny.yaml
    cfg = compose(["recipe=dit_tiny", "diffusion.sample_every=3"])
    assert cfg.diffusion.sample_every == 3 and not hasattr(cfg.trainer, "sample_every")
    grids = []
    for step in (5, 6):
        trainer = SimpleNamespace(cfg=cfg, ema=SimpleNamespace(update=lambda: None), state=SimpleNamespace(step=step))
        DiTTrainer.after_step(SimpleNamespace(**vars(trainer), save_samples=grids.append))
    assert grids == ["step_0000006.png"]
    m = compose(["recipe=vlm_tiny", "model.max_seq_len=300", "model.image_size=32", "model.vision_patch_size=8"]).model
    config = llava_config(m, vocab_size=64, image_token_id=63, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert (config.text_config.max_position_embeddings, config.vision_config.patch_size) == (300, 8)
    assert notes() == []


@pytest.mark.parametrize(
    "recipe,old,new",
    [
        ("dit_tiny", "trainer.sample_every=7", "diffusion.sample_every=7"),
        ("vlm_tiny", "model.max_position_embeddings=300", "model.max_seq_len=300"),
        ("vlm_tiny", "model.patch_size=8", "model.vision_patch_size=8"),
    ],
)
def test_an_old_key_composes_as_the_new_one_with_one_note(recipe, old, new, notes):
    """For one release the old spelling of a renamed key is the new one, said once on stderr."""
    extra = ["model.image_size=32"] if recipe == "vlm_tiny" else []
    assert compose([f"recipe={recipe}", *extra, new]) == compose([f"recipe={recipe}", *extra, old])
    assert compose([f"recipe={recipe}", *extra, new]) != compose([f"recipe={recipe}", *extra])  # the value took
    (note,) = notes()
    assert note == (
        f"kiln: note: {old.split('=')[0]} is now {new.split('=')[0]}; the old name is accepted until the next release"
    )


@pytest.mark.parametrize(
    "recipe,old",
    [
        ("llm_tiny", "trainer.sample_every=5"),  # the DiT's rename: the LLM never read it
        ("vlm_tiny", "trainer.sample_every=5"),
        ("dit_tiny", "model.max_position_embeddings=64"),  # the VLM's rename
        ("llm_tiny", "model.patch_size=4"),
    ],
)
def test_an_old_key_of_another_family_is_unknown(recipe, old, capsys, notes):
    from scripts.kiln.launch import main

    with pytest.raises(SystemExit) as exit_:
        main([f"recipe={recipe}", old])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    key = old.split("=")[0]
    assert len(err) == 1 and err[0].startswith(f"kiln: error: unknown config key '{key}'"), err


def test_an_old_runs_config_yaml_reads_with_the_new_keys():
    """scripts/export.py reads a run's config.yaml: one written before the renames holds the old keys."""
    from omegaconf import OmegaConf

    from common.config import rename_saved
    from recipes.registry import recipe_spec

    for recipe, moved in (
        ("dit_tiny", {"diffusion.sample_every": "trainer.sample_every"}),
        (
            "vlm_tiny",
            {"model.max_seq_len": "model.max_position_embeddings", "model.vision_patch_size": "model.patch_size"},
        ),
    ):
        cfg = compose([f"recipe={recipe}"])
        new = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # as launch writes config.yaml
        old = OmegaConf.create(OmegaConf.to_container(new))
        for new_key, old_key in moved.items():
            section, _, leaf = new_key.rpartition(".")
            value = old[section].pop(leaf)
            OmegaConf.update(old, old_key, value, force_add=True)
        assert old != new
        rename_saved(old, recipe_spec(cfg.recipe.family).renamed)
        assert OmegaConf.to_container(old) == OmegaConf.to_container(new)


def test_overrides_are_typed():
    cfg = compose(["recipe=dit_tiny", "trainer.max_steps=7", "optim.lr=0.5"])
    assert cfg.trainer.max_steps == 7 and cfg.optim.lr == 0.5


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.max_stepz=3", "trainer.max_stepz"),
        ("model.num_layerz=2", "model.num_layerz"),
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("toggles.precision=fp9", "toggles.precision"),
        ("parallel.zero_stage=4", "parallel.zero_stage"),
        ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
        ("data.image_size=15", "data.image_size"),
        ("recipe=nope", "no such recipe"),
        ("run.resume=/does/not/exist", "run.resume"),
        ("toggles.attention=flash", "toggles.attention=flash needs toggles.precision=bf16"),
        ("data.build=[data.prepare_digits,--out,/tmp/x]", "data.build"),
        ("data.build=[--seed,1]", "data.build"),
    ],
)
def test_bad_values_raise_config_error(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        compose(["recipe=dit_tiny", override])


# Ulysses (common/ulysses.py) in the DeepSpeed recipes: cp composes with its method recorded (alltoall, the name the
# LLM gives the same exchange); what it cannot split is one line. sd35_medium is checked against model.init_from's
# transformer with no folder needed (the release's shape: 24 heads, 1024 px / 8 / 2 = 4096 tokens); a FluxPipeline's
# refusal: test_t2i_flux. The VLM splits its language model (vlm_tiny: 4 heads, 2 key/value heads).
CP_REFUSALS = {
    "recipe=sd35_medium parallel.cp=8": {
        "parallel.cp=5": "parallel.cp=5 must divide the 24 attention heads (model.init_from's transformer)",
        "parallel.cp=2 data.image_size=1008": "parallel.cp=2 must divide the 3969 patch tokens",  # (1008 / 16)^2
        "parallel.cp=2 data.buckets=true": "parallel.cp=2 with data.buckets=true",
        "parallel.cp_method=allgather": "parallel.cp_method='allgather' is not in the text-to-image recipe",
    },
    "recipe=dit_tiny parallel.cp=2 parallel.zero_stage=3": {
        "parallel.cp=3": "parallel.cp=3 must divide the 4 attention heads (model.num_attention_heads)",
        "parallel.cp=4 data.image_size=10": "parallel.cp=4 must divide the 25 patch tokens",  # (10 / 2)^2
        "parallel.cp=2 toggles.attention=eager": "toggles.attention=eager with parallel.cp=2",
        "parallel.cp_method=allgather": "parallel.cp_method='allgather' is not in the DiT recipe; choose one of",
    },
    "recipe=vlm_tiny parallel.cp=2 parallel.zero_stage=2": {
        "parallel.cp=4": "parallel.cp=4 must divide the language model's 4 attention heads and 2 key/value heads",
        "parallel.cp=2 data.max_seq_len=255": "parallel.cp=2 must divide data.max_seq_len=255 and 8",
        "parallel.cp=2 data.packing=false": "parallel.cp=2 with data.packing=false",
        "parallel.cp=2 toggles.attention=eager": "toggles.attention=eager with parallel.cp=2",
        "parallel.cp_method=allgather": "parallel.cp_method='allgather' is not in the VLM recipe; choose one of",
    },
}


def test_the_vlm_takes_context_parallelism_with_flash():
    """Ulysses wraps the varlen kernel as it wraps SDPA (tests/distributed/test_vlm_context_parallel.py)."""
    cfg = compose("recipe=vlm_tiny parallel.cp=2 toggles.attention=flash toggles.precision=bf16".split())
    assert (cfg.parallel.cp, cfg.toggles.attention) == (2, "flash")


def test_the_llm_declares_its_own_cp_method_default():
    """The shared schema's parallel.cp_method is "" ("the family's default"): composition fills in the first of the
    family's spec's cp_methods (the LLM: allgather, docs/long-context.md) and keeps the one a command line gives."""
    from common.config import ParallelConfig

    assert ParallelConfig().cp_method == ""
    assert compose(["recipe=llm_tiny"]).parallel.cp_method == "allgather"
    assert compose(["recipe=llm_tiny", "parallel.cp_method=alltoall"]).parallel.cp_method == "alltoall"


@pytest.mark.parametrize("accepted", list(CP_REFUSALS), ids=["sd35_medium", "dit_tiny", "vlm_tiny"])
def test_the_deepspeed_recipes_take_context_parallelism(accepted):
    recipe, cp = accepted.split()[0], int(accepted.split()[1].split("=")[1])
    cfg = compose(accepted.split())
    assert (cfg.parallel.cp, cfg.parallel.cp_method) == (cp, "alltoall")
    assert compose([recipe]).parallel.cp_method == "alltoall"  # the family's default (its spec's cp_methods)
    for overrides, needle in CP_REFUSALS[accepted].items():
        with pytest.raises(ConfigError, match=re.escape(needle)):
            compose([recipe, *overrides.split()])


@pytest.mark.parametrize(
    "override,needle",
    [
        ("parallel.pp=8", "needs 8 pipeline stages but model.n_layers=4"),
        ("parallel.tp=4", "parallel.tp=4 must divide model.n_kv_heads=2"),
        ("parallel.zero_stage=2", "unknown config key 'parallel.zero_stage'"),  # the LLM's schema has no ZeRO
        ("parallel=zero2", "FSDP2"),
        ("data=digits", "data=digits is not a dataset of the LLM recipe"),
        ("data.max_seq_len=512", "exceeds model.max_seq_len=256"),
        ("toggles.precision=fp16", "toggles.precision=fp16 is not offered by the LLM recipe"),
        ("toggles.precision=fp8 parallel.tp=2", "the LLM recipe converts to fp8 without tensor parallelism"),
        # Context parallelism: what it does not compose with, and a row that 2*cp chunks do not cut evenly.
        ("parallel.cp=0", "parallel.cp=0 must be >= 1"),
        (
            "parallel.cp_method=ring",
            "parallel.cp_method='ring' is not in the LLM recipe; choose one of: allgather, alltoall",
        ),
        ("parallel.cp=3", "data.max_seq_len=256 must be divisible by 2"),
        (
            "parallel.cp=2 parallel.pp=2 toggles.attention=flash toggles.precision=bf16",
            "parallel.cp=2 with toggles.attention=flash is not supported yet: under parallel.pp>1",
        ),
        # Expert parallelism draws its ranks from dp x cp (common/parallel_dims.py): 4 does not divide 1 x 2.
        (
            "recipe=moe_tiny parallel.dp=1 parallel.cp=2 parallel.ep=4",
            "parallel.ep=4 must divide the 2 data-parallel ranks (parallel.dp x parallel.cp = 1 x 2",
        ),
        # Ulysses splits the heads: cp must divide the key/value heads each tp rank holds (llm_tiny: 2).
        (
            "parallel.cp=4 parallel.cp_method=alltoall",
            "parallel.cp=4 with parallel.cp_method=alltoall needs cp to divide",
        ),
        ("parallel.cp=2 parallel.tp=2 parallel.cp_method=alltoall", "model.n_kv_heads=2 / parallel.tp=2 = 1"),
    ],
)
def test_llm_layout_mistakes(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        compose(["recipe=llm_tiny", *override.split()])


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.max_stepz=3", "max_stepz"),
        ("toggles.attention=flash", "toggles.attention=flash"),
        ("toggles.precision=fp8", "toggles.precision=fp8"),
        ("toggles.precision=fp16", "toggles.precision=fp16"),
        ("parallel.dp=4", "parallel.dp*tp*pp=4*1*1=4 but the job has 1 ranks"),
        ("parallel.tp=2", "unknown config key 'parallel.tp'"),  # the DiT's parallel schema has no tensor parallelism
        ("recipe=llm_tiny toggles.precision=fp16", "toggles.precision=fp16 is not offered by the LLM recipe"),
        ("recipe=llm_tiny toggles.precision=fp8", "toggles.precision=fp8"),
    ],
)
def test_cli_mistakes_print_one_line_and_write_nothing(tmp_path: Path, override, needle):
    """A toggle no recipe or machine can honour stops every recipe the same way: one line, exit 2."""
    import torch

    if torch.cuda.is_available() and "toggles." in override and "not offered" not in needle:
        pytest.skip("hardware checks pass on this machine")
    run_dir = tmp_path / "run"
    proc = run_python([sys.executable, TRAIN, "recipe=dit_tiny", *override.split(), f"run.dir={run_dir}"], timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kiln: error:") and needle in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists()


def test_a_tilde_in_a_path_value_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """The README's spelling, `key=~/...`: the shell leaves a `~` after `key=` alone and Hydra's grammar has no
    unquoted `~`; train.py and serve.py read it as $HOME, in lists, dicts and quotes too."""
    from scripts.kiln.launch import main
    from scripts.kiln.serving import compose as compose_serve
    from tests.fixtures.llm import write_llama_folder

    monkeypatch.setenv("HOME", str(tmp_path))
    write_llama_folder(tmp_path / "models" / "llama")
    assert main(["recipe=llm_tiny", "model.init_from=~/models/llama", "--cfg"]) == 0
    assert f"init_from: {tmp_path}/models/llama\n" in capsys.readouterr().out
    cfg = compose(
        [
            "recipe=dit_xl2",
            "diffusion.vae=~/models/sd-vae-ft-mse",
            "run.dir=~",
            "run.dry_run=true",
            "data.build=[data.prepare_digits,--images,~/d]",
        ]
    )
    assert (cfg.diffusion.vae, cfg.run.dir) == (f"{tmp_path}/models/sd-vae-ft-mse", str(tmp_path))
    assert cfg.data.build == ["data.prepare_digits", "--images", f"{tmp_path}/d"]
    serve = compose_serve(["serve.model=~/models/llama", "serve.lora={a:~/lora/a, b:'~/lora/b'}"])
    assert serve.model == f"{tmp_path}/models/llama"
    assert serve.lora == {"a": f"{tmp_path}/lora/a", "b": f"{tmp_path}/lora/b"}
    assert compose_serve(['serve.model="a~b"']).model == "a~b"  # a `~` inside a word is not a home folder


@pytest.mark.parametrize(
    "argv,argument",
    [
        (["recipe=dit_tiny", "model.num_layers=[2"], "model.num_layers=[2"),
        (["recipe=dit_tiny", "run.dir=a(b)"], "run.dir=a(b)"),
        (["serve.model=a=b"], "serve.model=a=b"),
    ],
)
def test_an_unreadable_argument_is_one_line_naming_it(argv, argument, capsys):
    from scripts.kiln.launch import main as train
    from scripts.serve import main as serve

    with pytest.raises(SystemExit) as exit_:
        (serve if argv[0].startswith("serve.") else train)(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kiln: error: cannot read the argument '{argument}': "), err
