"""scripts/serve.py's config, engine choice and engine command lines (no server started)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from common.errors import ConfigError, UserError
from scripts.kiln.serving import (
    ServeSection,
    build_hub_cache,
    check_export,
    choose_engine,
    choose_image_engine,
    compose,
    default_served_name,
    plan,
    transformers_command,
    vllm_command,
)
from tests.conftest import REPO
from tests.support.launcher import run_python

SERVE = str(REPO / "scripts" / "serve.py")


@pytest.fixture
def export(tmp_path):
    """A run folder as llm_tiny leaves it: config.yaml + export/ (a tokenizer, config, weights)."""
    (tmp_path / "config.yaml").write_text("recipe:\n  name: llm_tiny\n  family: llm\n")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"0")
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture(autouse=True)
def _no_vllm_environment(monkeypatch):
    """These tests spell out the commands of a machine without .venv-serve (`make serve-env` builds it on the
    test machine too); the ones about that environment make their own."""
    monkeypatch.setenv("KILN_SERVE_VENV", "/nonexistent/venv-serve")


def fake_serve_env(folder, build: str):
    """A stand-in .venv-serve: its python and the stamp `make serve-env` writes."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    (folder / ".kiln-installed").write_text(build + "\n")
    return folder


def _serve(*args, tmp="/nonexistent", fresh=False, **env):
    """scripts/serve.py, forked preloaded (tests/support/launcher.py), or in a `fresh` interpreter of its own (what
    it prints at import shows there); its per-server scratch state (a dry run writes some) goes under `tmp`."""
    base = {k: v for k, v in os.environ.items() if k not in ("KILN_API_KEY", "VLLM_API_KEY")}
    cmd, env = [sys.executable, SERVE, *args], {**base, "TMPDIR": str(tmp), **env}
    if fresh:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    return run_python(cmd, env=env, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "serve.model is required"),
        (["serve.model=/nonexistent/export"], "no such folder"),
        (["serve.model=x", "serve.prot=1"], "unknown config key 'serve.prot'"),
    ],
)
def test_user_mistakes_end_in_one_line_and_exit_2(args, message):
    proc = _serve(*args, fresh=not args)  # one in a fresh interpreter: no import-time output either
    assert proc.returncode == 2
    assert proc.stderr.startswith("kiln: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1 and not proc.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        ("serve.engine=tgi", "serve.engine='tgi' is not allowed"),
        ("serve.dtype=fp8", "serve.dtype='fp8' is not allowed"),
        ("serve.port=abc", "bad value for 'serve.port'"),
        ("serve.port=0", "serve.port=0 must be in 1..65535"),
        ("serve.served_model_name=a@b", "serve.served_model_name='a@b'"),
        ("serve.gpu_memory_utilization=1.5", "serve.gpu_memory_utilization=1.5 must be in (0, 1]"),
        ("serve.cb_num_blocks=-1", "serve.cb_num_blocks=-1 must be >= 0"),
        ("serve.api_key_env=sk-live-123", "serve.api_key_env must be the name of an environment variable"),
    ],
)
def test_bad_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        compose(["serve.model=x", override])
    assert "sk-live-123" not in str(info.value)  # a key pasted as the variable's name is not echoed


def test_folders_that_are_not_llm_or_vlm_exports(export, tmp_path):
    with pytest.raises(UserError, match="is a run folder; serve its export"):
        check_export(str(export.parent))
    dit = tmp_path / "dit"
    (dit / "transformer").mkdir(parents=True)
    with pytest.raises(UserError, match=r"not a complete DiT export \(missing kiln.json, transformer/config.json"):
        check_export(str(dit))
    (export / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"missing \*.safetensors weights"):
        check_export(str(export))


def test_served_name_defaults_to_the_recipe_then_the_folder(export, tmp_path):
    assert default_served_name(export) == "llm_tiny"
    (export.parent / "config.yaml").unlink()
    assert default_served_name(export) == export.parent.name
    assert default_served_name(tmp_path / "my-model") == "my-model"


@pytest.mark.parametrize(
    "cuda, vllm, engine, why",
    [
        (True, True, "vllm", "CUDA device and vllm available"),
        (True, False, "transformers", "vllm not installed"),
        (False, True, "transformers", "no CUDA device"),
        (False, False, "transformers", "no CUDA device and vllm not installed"),
    ],
)
def test_auto_takes_vllm_only_with_cuda_and_vllm(cuda, vllm, engine, why):
    why = why if engine == "vllm" else f"no vLLM environment (make serve-env), {why}"
    assert choose_engine("auto", cuda=cuda, vllm=vllm) == (engine, f"auto: {why}")
    assert choose_engine("transformers", cuda=True, vllm=True) == ("transformers", "requested")


@pytest.mark.parametrize("build", ["cpu", "gpu"], ids=["cpu_build", "gpu_build"])  # not "gpu": the GPU marker
def test_auto_takes_the_vllm_environment_even_without_cuda(build, export, tmp_path, monkeypatch):
    venv = fake_serve_env(tmp_path / "venv", build)
    monkeypatch.setenv("KILN_SERVE_VENV", str(venv))
    assert choose_engine("auto", cuda=False, vllm=False) == ("vllm", f"auto: vLLM's {build.upper()} build in {venv}")
    launch = plan(ServeSection(model=str(export), port=8003, dtype="float32", cpu_kvcache_gib=3, dry_run=True))
    # Its OpenAI server module (the CPU build's `vllm` script cannot find its own distribution).
    assert launch.argv[:5] == [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(export),
    ]
    assert launch.argv[launch.argv.index("--dtype") + 1] == "float32"
    assert launch.env == ({"VLLM_CPU_KVCACHE_SPACE": "3"} if build == "cpu" else {})
    # LLaVA exports: vLLM's, on the CPU build too once it has torchvision (make serve-env installs it); a CPU
    # environment without it (built before) goes to transformers serve, saying how to rebuild.
    engine, why = choose_engine("auto", env=build, multimodal=True)
    assert engine == ("transformers" if build == "cpu" else "vllm")
    assert build == "gpu" or "rm -r .venv-serve; make serve-env" in why
    site = venv / "lib" / "python3.11" / "site-packages" / "torchvision"
    site.mkdir(parents=True)
    (site / "__init__.py").touch()
    assert choose_engine("auto", env=build, multimodal=True)[0] == "vllm"


def test_vllm_command_line(export, tmp_path):
    s = ServeSection(
        model=str(export),
        host="0.0.0.0",
        port=8001,
        tensor_parallel_size=4,
        max_model_len=4096,
        dtype="bfloat16",
        gpu_memory_utilization=0.85,
    )
    template = tmp_path / "chat_template.jinja"
    assert vllm_command(s, export, "llm_tiny", template) == [
        "vllm",
        "serve",
        str(export),
        "--served-model-name",
        "llm_tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--tensor-parallel-size",
        "4",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.85",
        "--max-model-len",
        "4096",
        "--chat-template",
        str(template),
    ]
    # max_model_len=0 leaves it to vLLM (the model's max_position_embeddings); no template when the export has one
    assert "--max-model-len" not in vllm_command(ServeSection(model="x"), export, "n", None)
    assert "--chat-template" not in vllm_command(ServeSection(model="x"), export, "n", None)
    # serve.enforce_eager: vLLM without torch.compile
    assert "--enforce-eager" not in vllm_command(ServeSection(model="x"), export, "n", None)
    assert vllm_command(ServeSection(model="x", enforce_eager=True), export, "n", None)[-1] == "--enforce-eager"


def test_dry_run_prints_the_vllm_command_without_vllm(export, tmp_path):
    proc = _serve(f"serve.model={export}", "serve.engine=vllm", "serve.dry_run=true", "serve.port=9001", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip().splitlines()[-1]
    assert command.startswith(f"kiln: vllm serve {export} --served-model-name llm_tiny --host 127.0.0.1 --port 9001")
    assert f"--chat-template {tmp_path}/" in command  # the base LM export has none


def test_transformers_command_and_its_one_model_cache(export, tmp_path):
    from huggingface_hub import scan_cache_dir

    s = ServeSection(model=str(export), port=8002, cb_num_blocks=32, cb_max_batch_tokens=512)
    cmd = transformers_command(s, "kiln/llm")
    assert cmd[1:5] == ["-m", "transformers.cli.transformers", "serve", "kiln/llm"]
    assert cmd[cmd.index("--port") + 1] == "8002" and "--continuous-batching" in cmd
    assert cmd[cmd.index("--cb-num-blocks") + 1] == "32" and cmd[cmd.index("--cb-max-batch-tokens") + 1] == "512"
    assert "--no-continuous-batching" in transformers_command(ServeSection(continuous_batching=False), "n")

    # What /v1/models lists and from_pretrained resolves offline: one repo, named as served.
    snapshot = build_hub_cache(export, "kiln/llm", tmp_path / "hub", None)
    repos = scan_cache_dir(tmp_path / "hub").repos
    assert [(r.repo_id, sorted(r.refs)) for r in repos] == [("kiln/llm", ["main"])]
    assert (snapshot / "model.safetensors").resolve() == (export / "model.safetensors").resolve()


def test_plan_for_the_cpu_engine(export, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where state_dir puts the per-server cache
    launch = plan(ServeSection(model=str(export), engine="transformers"))
    assert launch.name == "llm_tiny" and launch.engine == "transformers"
    assert launch.env["HF_HUB_OFFLINE"] == "1" and (launch.cwd / "hub").is_dir()
    # the base LM gets a plain-text chat template next to its symlinked files
    snapshot = next((launch.cwd / "hub" / "models--llm_tiny" / "snapshots").iterdir())
    assert (snapshot / "chat_template.jinja").exists() and (snapshot / "config.json").is_symlink()
    assert not launch.notes[1:]
    ignored = plan(ServeSection(model=str(export), engine="transformers", max_model_len=128))
    assert ignored.notes[0] == "serve.max_model_len not used by engine=transformers"
    with pytest.raises(ConfigError, match="needs serve.engine=vllm"):
        plan(ServeSection(model=str(export), engine="transformers", tensor_parallel_size=2))


def test_gpu_launch_scripts(export, tmp_path):
    scripts = [REPO / "scripts" / "serve_gpu.sh", REPO / "scripts" / "slurm" / "serve.sbatch"]
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # A stand-in for srun that runs its command here, so the batch script runs end to end (dry run).
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    env = {
        "PATH": f"{srun.parent}:/usr/bin:/bin",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_ID": "7",
        "TMPDIR": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "0,1",
        "KILN_PYTHON": sys.executable,
        "KILN_API_KEY": SECRET_KEY,
        "KILN_SERVE_VENV": os.environ["KILN_SERVE_VENV"],
    }  # (the fixture's: no vLLM environment)
    proc = subprocess.run(
        ["bash", str(scripts[1]), f"serve.model={export}", "serve.port=8123", "serve.dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kiln: job 7 serves on http://") and ":8123/v1" in lines[0]
    assert lines[-1].startswith(
        f"kiln: VLLM_API_KEY=******** vllm serve {export} --served-model-name llm_tiny "
        "--host 0.0.0.0 --port 8123 --tensor-parallel-size 2"
    )
    assert SECRET_KEY not in proc.stdout + proc.stderr
    no_gpu = subprocess.run(
        ["bash", str(scripts[0]), f"serve.model={export}", "serve.dry_run=true"],
        capture_output=True,
        text=True,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert no_gpu.returncode == 2 and no_gpu.stderr.startswith("kiln: error: no GPU visible")
    del env["KILN_API_KEY"]  # serve_gpu.sh listens on 0.0.0.0: no key, no server
    open_door = subprocess.run(
        ["bash", str(scripts[0]), f"serve.model={export}", "serve.dry_run=true"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert open_door.returncode == 2 and open_door.stderr.count("\n") == 1
    assert open_door.stderr.startswith(
        "kiln: error: serve.host=0.0.0.0 accepts connections from other machines without "
        "an API key: export KILN_API_KEY=<secret>"
    )


SECRET_KEY = "sk-kiln-test-3f9a1c"


def test_vllm_gets_the_key_in_its_environment_never_on_a_command_line(export, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MY_KEY", SECRET_KEY)
    launch = plan(ServeSection(model=str(export), engine="vllm", host="0.0.0.0", api_key_env="MY_KEY", dry_run=True))
    assert launch.env == {"VLLM_API_KEY": SECRET_KEY}  # vLLM's own variable for --api-key
    assert SECRET_KEY not in " ".join(launch.argv) and "--api-key" not in launch.argv
    assert launch.shown().startswith("VLLM_API_KEY=******** vllm serve ") and SECRET_KEY not in launch.shown()


def test_dry_run_masks_the_key(export, tmp_path):
    proc = _serve(
        f"serve.model={export}",
        "serve.engine=vllm",
        "serve.host=0.0.0.0",
        "serve.dry_run=true",
        tmp=tmp_path,
        KILN_API_KEY=SECRET_KEY,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"kiln: VLLM_API_KEY=******** vllm serve {export} ")
    assert SECRET_KEY not in proc.stdout + proc.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-node-7"])
def test_no_open_door_by_default(export, tmp_path, host):
    proc = _serve(
        f"serve.model={export}", "serve.engine=vllm", f"serve.host={host}", "serve.dry_run=true", tmp=tmp_path
    )
    assert proc.returncode == 2 and not proc.stdout and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(
        f"kiln: error: serve.host={host} accepts connections from other machines without an API key"
    )
    allowed = _serve(
        f"serve.model={export}",
        "serve.engine=vllm",
        f"serve.host={host}",
        "serve.dry_run=true",
        "serve.allow_unauthenticated=true",
        tmp=tmp_path,
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "anyone who reaches" in allowed.stdout and "VLLM_API_KEY" not in allowed.stdout


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_key(export, tmp_path, host):
    proc = _serve(
        f"serve.model={export}", "serve.engine=vllm", f"serve.host={host}", "serve.dry_run=true", tmp=tmp_path
    )
    assert proc.returncode == 0, proc.stderr


def test_cpu_engine_serves_loopback_only(export, tmp_path):
    """transformers serve cannot check a key: beyond loopback it is refused, with a key or without."""
    for env in ({}, {"KILN_API_KEY": SECRET_KEY}):
        proc = _serve(
            f"serve.model={export}",
            "serve.engine=transformers",
            "serve.host=0.0.0.0",
            "serve.dry_run=true",
            tmp=tmp_path,
            **env,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and SECRET_KEY not in proc.stderr
        assert proc.stderr.startswith(
            "kiln: error: serve.host=0.0.0.0 with serve.engine=transformers: transformers "
            "serve has no authentication, so it serves on loopback only"
        )
    allowed = _serve(
        f"serve.model={export}",
        "serve.engine=transformers",
        "serve.host=0.0.0.0",
        "serve.dry_run=true",
        "serve.allow_unauthenticated=true",
        tmp=tmp_path,
    )
    assert allowed.returncode == 0, allowed.stderr


@pytest.fixture
def dit_export(tmp_path):
    """A DiT run folder's export/ as DiTTrainer.export() lays it out (files stubbed: nothing is loaded)."""
    run = tmp_path / "dit_run"
    run.mkdir()
    (run / "config.yaml").write_text("recipe:\n  name: dit_tiny\n  family: dit\n")
    folder = run / "export"
    for name in ("kiln.json", "transformer/config.json", "scheduler/scheduler_config.json"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")
    return folder


def test_dit_engine_choice(dit_export):
    assert choose_image_engine("auto", dit_export, cuda=False) == (
        "torch",
        f"auto: no ONNX file (scripts/export_dit.py {dit_export} writes one for onnxruntime)",
    )
    (dit_export / "onnx").mkdir()
    (dit_export / "onnx" / "model.onnx").write_bytes(b"0")
    assert choose_image_engine("auto", dit_export, cuda=False)[0] == "onnxruntime"
    assert "no TensorRT engine" in choose_image_engine("auto", dit_export, cuda=True)[1]
    assert choose_image_engine("torch", dit_export, cuda=True) == ("torch", "requested")


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_text_engines_refuse_a_dit_export_and_image_engines_an_llm(engine, dit_export, export):
    with pytest.raises(ConfigError, match=f"serve.engine={engine} serves LLM/VLM exports; .* is a DiT export"):
        choose_image_engine(engine, dit_export)
    with pytest.raises(ConfigError, match="serve.engine=onnxruntime serves DiT exports"):
        choose_engine("onnxruntime")


def test_dit_dry_run_and_its_refusals(dit_export, tmp_path):
    proc = _serve(f"serve.model={dit_export}", "serve.dry_run=true", "serve.cb_num_blocks=8", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "as 'dit_tiny'" in proc.stdout and "engine=torch (auto: no ONNX file" in proc.stdout
    assert "images server (recipes/dit/serve.py, in this process): engine=torch max_batch_images=16" in proc.stdout
    assert "serve.cb_num_blocks not used by engine=torch" in proc.stdout
    for args, message in [
        (["serve.dtype=bfloat16"], "serve.dtype=bfloat16: a DiT export serves in its graph's precision"),
        (["serve.host=0.0.0.0"], "without an API key"),
        (["serve.max_batch_images=0"], "serve.max_batch_images=0 must be >= 1"),
    ]:
        proc = _serve(f"serve.model={dit_export}", "serve.dry_run=true", *args, tmp=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = _serve(f"serve.model={dit_export.parent}", "serve.dry_run=true", tmp=tmp_path)
    assert "is a run folder; serve its export" in proc.stderr


@pytest.fixture
def t2i_export(dit_export):
    """A text-to-image export as recipes/t2i/train.py write_pipeline lays it out (files stubbed): a model_index.json
    naming text encoders beside the DiT's parts."""
    index = {"_class_name": "StableDiffusion3Pipeline", "text_encoder": ["transformers", "CLIPTextModelWithProjection"]}
    (dit_export / "model_index.json").write_text(json.dumps(index))
    (dit_export.parent / "config.yaml").write_text("recipe:\n  name: t2i_tiny\n  family: t2i\n")
    return dit_export


def test_a_t2i_export_is_served_on_torch_by_its_own_server(t2i_export):
    assert choose_image_engine("auto", t2i_export, cuda=True) == (
        "torch",
        "auto: a text-to-image export runs on PyTorch",
    )
    for engine, served in (("onnxruntime", "DiT exports"), ("tensorrt", "DiT exports"), ("vllm", "LLM/VLM exports")):
        with pytest.raises(
            ConfigError, match=f"serve.engine={engine} serves {served}; .* text-to-image export: choose auto, torch"
        ):
            choose_image_engine(engine, t2i_export)
    launch = plan(ServeSection(model=str(t2i_export), dry_run=True))
    assert (launch.name, launch.engine) == ("t2i_tiny", "torch")
    assert (
        launch.shown()
        == "images server (recipes/t2i/serve.py, in this process): engine=torch max_batch_images=16 batch_wait_ms=10"
    )
    with pytest.raises(ConfigError, match="serve.dtype=bfloat16: a text-to-image export serves in float32"):
        plan(ServeSection(model=str(t2i_export), dtype="bfloat16"))
    (t2i_export / "kiln.json").unlink()
    with pytest.raises(UserError, match="is not a complete text-to-image export \\(missing kiln.json\\)"):
        check_export(str(t2i_export))


def test_a_t2i_lora_export_is_named_and_its_merged_pipeline_served_instead(tmp_path):
    export = tmp_path / "run" / "export"  # release.py write_lora_export: diffusers' LoRA file and kiln.json
    export.mkdir(parents=True)
    (export / "pytorch_lora_weights.safetensors").write_bytes(b"0")
    (export / "kiln.json").write_text(json.dumps({"diffusers_pipeline": "StableDiffusion3Pipeline", "lora": {}}))
    said = f"serve.model={export} is a text-to-image LoRA export (diffusers' pytorch_lora_weights.safetensors"
    with pytest.raises(UserError, match=re.escape(said)) as err:
        check_export(str(export))
    assert "export.merge_lora=true or scripts/export.py RUN --merge-lora writes it" in str(err.value)
    (export / "merged").mkdir()
    with pytest.raises(UserError, match=re.escape(f"serve its merged pipeline, serve.model={export / 'merged'}")):
        check_export(str(export))


def write_adapter_config(folder, base, r=8):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": r, "base_model_name_or_path": str(base)})
    )
    (folder / "adapter_model.safetensors").write_bytes(b"0")
    return folder


def test_lora_adapters_go_to_vllm_with_their_ranks(export, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_SERVE_VENV", str(fake_serve_env(tmp_path / "venv", "cpu")))
    a = write_adapter_config(tmp_path / "a", export, r=8)
    b = write_adapter_config(tmp_path / "b", export, r=24)
    launch = plan(compose([f"serve.model={export}", f"serve.lora={{math:{a},code:{b}}}"]))
    assert launch.engine == "vllm"
    flags = launch.argv[launch.argv.index("--enable-lora") :]
    assert flags == [
        "--enable-lora",
        "--lora-modules",
        f"math={a}",
        f"code={b}",
        "--max-lora-rank",
        "32",
        "--max-loras",
        "2",
    ]


def test_lora_refusals_are_one_line(export, tmp_path, monkeypatch):
    other = write_adapter_config(tmp_path / "other", tmp_path / "another-base")
    with pytest.raises(UserError, match=r"serve.lora.x=.* was trained on base .*another-base.*serve its own base"):
        plan(compose([f"serve.model={export}", "serve.engine=vllm", "serve.dry_run=true", f"serve.lora={{x:{other}}}"]))
    with pytest.raises(UserError, match="is not a PEFT adapter folder"):
        plan(compose([f"serve.model={export}", "serve.engine=vllm", f"serve.lora={{x:{tmp_path}}}"]))
    ok = write_adapter_config(tmp_path / "ok", export)
    with pytest.raises(UserError, match="serve.lora needs vLLM, and engine=transformers"):
        plan(compose([f"serve.model={export}", f"serve.lora={{x:{ok}}}"]))
    with pytest.raises(ConfigError, match="adapter name 'llm_tiny' must be a model name"):
        compose([f"serve.model={export}", "serve.served_model_name=llm_tiny", f"serve.lora={{llm_tiny:{ok}}}"])
    # A VLM adapter with its projector trained in full (peft's modules_to_save): vLLM would refuse it after starting.
    merger = write_adapter_config(tmp_path / "merger", export)
    config = json.loads((merger / "adapter_config.json").read_text())
    (merger / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["merger"]}))
    with pytest.raises(UserError, match=r"carries merger trained in full .*vlm.train_projector=false"):
        plan(
            compose([f"serve.model={export}", "serve.engine=vllm", "serve.dry_run=true", f"serve.lora={{x:{merger}}}"])
        )


def set_model_config(export, **config):
    (export / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config})
    )


def test_max_model_len_beyond_the_model_is_one_line_before_vllm_starts(export, tmp_path):
    """The README's serve.max_model_len=4096 on llm_tiny (256 positions): vLLM's own check is a pydantic traceback
    once the engine starts; the dry run already says what to set."""
    set_model_config(export, max_position_embeddings=256, hidden_size=128, num_attention_heads=4)
    proc = _serve(
        f"serve.model={export}", "serve.engine=vllm", "serve.max_model_len=4096", "serve.dry_run=true", tmp=tmp_path
    )
    assert proc.returncode == 2 and not proc.stdout and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "kiln: error: serve.max_model_len=4096 is longer than the model takes (256 tokens, "
        "config.json's max_position_embeddings): set serve.max_model_len=256 or less"
    )
    assert (
        _serve(
            f"serve.model={export}", "serve.engine=vllm", "serve.max_model_len=256", "serve.dry_run=true", tmp=tmp_path
        ).returncode
        == 0
    )
    # As vLLM derives the limit: a linear RoPE scaling factor stretches it; llama3's is already in the positions.
    for rope, longest in (
        ({"rope_type": "linear", "factor": 4.0}, 1024),
        ({"rope_type": "llama3", "factor": 8.0}, 256),
    ):
        set_model_config(export, max_position_embeddings=256, rope_scaling=rope)
        plan(ServeSection(model=str(export), engine="vllm", max_model_len=longest, dry_run=True))
        with pytest.raises(UserError, match=f"set serve.max_model_len={longest} or less"):
            plan(ServeSection(model=str(export), engine="vllm", max_model_len=longest + 1, dry_run=True))


@pytest.mark.parametrize("build", ["cpu", "gpu"], ids=["cpu_build", "gpu_build"])  # not "gpu": the GPU marker
def test_vllm_cpu_head_sizes_are_checked_before_it_starts(build, export, tmp_path, monkeypatch):
    """vLLM's CPU build has attention kernels for some head sizes only (16 is not one): it reports healthy, then
    dies on the first request. Checked before it starts: serve.engine=vllm stops with one line, auto takes
    transformers serve and says why; the GPU build and supported sizes are left alone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    venv = fake_serve_env(tmp_path / "venv", build)
    monkeypatch.setenv("KILN_SERVE_VENV", str(venv))
    set_model_config(export, hidden_size=64, num_attention_heads=4, max_position_embeddings=256)  # 16 dimensions
    auto = plan(ServeSection(model=str(export), dry_run=True))
    if build == "cpu":
        with pytest.raises(
            UserError,
            match=r"serve.engine=vllm on CPU cannot serve .*: its attention heads have 16 "
            r"dimensions .* use serve.engine=transformers",
        ):
            plan(ServeSection(model=str(export), engine="vllm", dry_run=True))
        assert auto.engine == "transformers" and "its attention heads have 16 dimensions" in auto.why
        proc = _serve(
            f"serve.model={export}", "serve.engine=vllm", "serve.dry_run=true", tmp=tmp_path, KILN_SERVE_VENV=str(venv)
        )
        assert proc.returncode == 2 and not proc.stdout and proc.stderr.count("\n") == 1
        assert proc.stderr.startswith("kiln: error: serve.engine=vllm on CPU cannot serve")
    else:
        assert auto.engine == "vllm" and plan(ServeSection(model=str(export), engine="vllm", dry_run=True))
    for config in (
        dict(hidden_size=64, num_attention_heads=2),
        dict(hidden_size=64, num_attention_heads=8, head_dim=80),
        # LLaVA: its language model's heads (the vision tower runs on SDPA)
        dict(text_config=dict(hidden_size=128, num_attention_heads=4), vision_config={}),
    ):
        set_model_config(export, **config)
        assert plan(ServeSection(model=str(export), engine="vllm", dry_run=True)).engine == "vllm"


def test_served_name_is_the_recipe_for_folders_under_the_export(export, dit_export, tmp_path):
    """A LoRA run's export/merged (and scripts/export.py's exports/step_N) are the run's recipe; a DiT export's
    kiln.json names it wherever the folder is."""
    for folder in (export / "merged", export.parent / "exports" / "step_2"):
        folder.mkdir(parents=True)
        assert default_served_name(folder) == "llm_tiny"
    merged = dit_export / "merged"
    merged.mkdir()
    (merged / "kiln.json").write_text(json.dumps({"recipe": "dit_tiny", "step": 4}))
    assert default_served_name(merged) == "dit_tiny"
    moved = tmp_path / "elsewhere"
    shutil.copytree(merged, moved)
    assert default_served_name(moved) == "dit_tiny"


def test_an_adapter_folder_is_named_and_what_to_serve_instead(export, tmp_path):
    adapter = write_adapter_config(tmp_path / "run" / "export", export)
    with pytest.raises(
        UserError,
        match=re.escape(
            f"serve.model={adapter} is a LoRA adapter (adapter_config.json), "
            f"not a model: serve its base with it (scripts/serve.py "
            f"serve.model={export} 'serve.lora={{adapter:{adapter}}}'"
        ),
    ):
        check_export(str(adapter))
    (adapter / "merged").mkdir()
    with pytest.raises(UserError, match=re.escape(f"or use its merged model, serve.model={adapter / 'merged'}")):
        check_export(str(adapter))
    # A DiT's adapter (its base a diffusers transformer folder): the merged export, for the server and sample_dit.
    base = tmp_path / "dit_base" / "transformer"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"_class_name": "DiTTransformer2DModel"}))
    dit = write_adapter_config(tmp_path / "dit_run" / "export", base)
    proc = _serve(f"serve.model={dit}", "serve.dry_run=true", tmp=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(
        f"kiln: error: serve.model={dit} is a LoRA adapter (adapter_config.json), not a "
        "whole DiT export: use its merged model (export.merge_lora=true"
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sample_dit.py"), str(dit)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"sample_dit: error: {dit} is a LoRA adapter (adapter_config.json), not a whole DiT")


def test_a_qwen3_vl_export_without_its_video_processor_is_noted(export, tmp_path, monkeypatch):
    """Without video_preprocessor_config.json transformers gives a Qwen3-VL folder Qwen2VLVideoProcessor, whose
    videos vLLM's Qwen3-VL refuses (measured: a 400 for every video request; test_serve_vllm_qwen): one note at start.
    A Qwen2.5-VL export (that is its class) and a Qwen3-VL export naming its own get none."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def video_notes():
        return [n for n in plan(ServeSection(model=str(export), engine="vllm", dry_run=True)).notes if "video" in n]

    set_model_config(export, model_type="qwen3_vl", vision_config={})
    (note,) = video_notes()
    assert note.startswith("the qwen3_vl export has no video_preprocessor_config.json") and "\n" not in note
    (export / "processor_config.json").write_text(json.dumps({"video_processor": {}}))
    assert not video_notes()
    (export / "processor_config.json").unlink()
    (export / "video_preprocessor_config.json").write_text("{}")
    assert not video_notes()
    set_model_config(export, model_type="qwen2_5_vl", vision_config={})
    (export / "video_preprocessor_config.json").unlink()
    assert not video_notes()


def test_a_vlm_that_transformers_serve_cannot_load_here_is_one_line_before_it_starts(qwen_world, tmp_path):
    """A Qwen2.5-VL folder and no vLLM environment: auto falls back to transformers serve, which died ~7 s in with
    ~60 lines ending in `ImportError: Qwen2VLVideoProcessor requires the Torchvision library` (the processor needs a
    video processor, which needs torchvision; the training env has none). Now refused before it starts:
    one line saying what is missing and what to do."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: transformers serve loads the processor")
    proc = _serve(f"serve.model={qwen_world['qwen']}", tmp=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not proc.stdout and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    line = proc.stderr.strip()
    assert line.startswith(f"kiln: error: transformers serve cannot load {qwen_world['qwen']} here: ")
    assert "Qwen2VLVideoProcessor requires the Torchvision library" in line and "make serve-env" in line


def test_triton_writes_a_model_repository_and_refuses_what_it_cannot_serve(dit_export, export, tmp_path, monkeypatch):
    """serve.engine=triton: the repository written from the export, the tritonserver command line; each refusal is
    one line (the repository's models run in the real server in tests/integration/test_serve_triton.py)."""
    monkeypatch.setenv("KILN_TRITON_VENV", str(tmp_path / "no-triton"))
    info = {"image_size": 16, "num_classes": 10, "null_class": 10, "sample_steps": 5, "guidance_scale": 2.0}
    (dit_export / "kiln.json").write_text(json.dumps(info))
    (dit_export / "transformer" / "config.json").write_text(json.dumps({"in_channels": 1, "sample_size": 16}))
    with pytest.raises(UserError, match="onnx/model.onnx is missing: python scripts/export_dit.py"):
        plan(ServeSection(model=str(dit_export), engine="triton", dry_run=True))
    (dit_export / "onnx").mkdir()
    (dit_export / "onnx" / "model.onnx").write_bytes(b"0")
    with pytest.raises(UserError, match="serve.engine=triton: Triton's environment is not built .*make triton-env"):
        plan(ServeSection(model=str(dit_export), engine="triton"))
    plan(ServeSection(model=str(dit_export), engine="triton", dry_run=True, served_model_name="other"))
    launch = plan(ServeSection(model=str(dit_export), engine="triton", dry_run=True, max_batch_images=8, port=8123))
    assert (launch.engine, launch.name, launch.api) == ("triton", "dit_tiny", "/v2")
    repo = dit_export / "triton"
    assert launch.argv[0] == "env" and launch.argv[2].endswith("pytriton/tritonserver/bin/tritonserver")
    assert {f"--model-repository={repo}", "--http-port=8123", "--http-address=127.0.0.1"} <= set(launch.argv)
    assert sorted(p.name for p in repo.iterdir()) == ["dit_tiny", "dit_tiny_denoiser"]  # none left from "other"
    sampler, denoiser = (repo / m / "config.pbtxt" for m in ("dit_tiny", "dit_tiny_denoiser"))
    assert "max_batch_size: 8" in sampler.read_text() and "max_batch_size: 16" in denoiser.read_text()
    assert "dynamic_batching { max_queue_delay_microseconds: 10000 }" in sampler.read_text()
    assert 'name: "image", data_type: TYPE_FP32, dims: [1, 16, 16]' in sampler.read_text()
    assert 'backend: "onnxruntime"' in (repo / "dit_tiny_denoiser" / "configs" / "gpu.pbtxt").read_text()
    assert (repo / "dit_tiny_denoiser" / "1" / "model.onnx").resolve() == dit_export / "onnx" / "model.onnx"
    shim = (repo / "dit_tiny" / "1" / "model.py").read_text()
    assert "SamplerModel as TritonPythonModel" in shim and repr(str(REPO)) in shim
    for model, message in [
        (export, f"serve.engine=triton serves DiT exports; {export} is a Hugging Face LLM/VLM export"),
        (dit_export, "serve.host=0.0.0.0 with serve.engine=triton: Triton's HTTP endpoint checks no API key"),
    ]:
        proc = _serve(f"serve.model={model}", "serve.engine=triton", "serve.host=0.0.0.0", "serve.dry_run=true")
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    index = {"_class_name": "StableDiffusion3Pipeline"}
    (dit_export / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="serve.engine=triton serves DiT exports; .* is a text-to-image export"):
        plan(ServeSection(model=str(dit_export), engine="triton", dry_run=True))


def write_gguf_header(path, chat_template: str | None = None):
    """A GGUF file with metadata only (no tensors), written by llama.cpp's own gguf package."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llamacpp_serves_the_gguf_with_the_key_in_its_environment(export, tmp_path, monkeypatch):
    """serve.engine=llamacpp: llama.cpp's server (scripts/llamacpp_server.py, run by .venv-llamacpp's Python) on the
    export's gguf/ file, named after the run's recipe; the API key in its environment (masked when printed), never on
    its command line; a file without a chat template (a base LM's) gets the plain one the other engines get; each
    refusal is one line (the real server answers in tests/integration/test_gguf_llamacpp.py)."""
    from scripts.kiln.serving import BASE_LM_CHAT_TEMPLATE

    monkeypatch.setenv("KILN_LLAMACPP_VENV", str(tmp_path / "no-llamacpp"))
    with pytest.raises(UserError, match=f"serve.engine=llamacpp serves a GGUF file and {export} has none"):
        plan(ServeSection(model=str(export), engine="llamacpp", dry_run=True))
    gguf_file = write_gguf_header(export / "gguf" / "model-f16.gguf")
    with pytest.raises(UserError, match="serve.engine=llamacpp: llama.cpp's environment is not built .*make llamacpp"):
        plan(ServeSection(model=str(export), engine="llamacpp"))
    monkeypatch.setenv("KILN_API_KEY", "sekret")
    with monkeypatch.context() as patch:  # where state_dir puts the per-server chat template
        patch.setattr(tempfile, "tempdir", str(tmp_path))
        launch = plan(ServeSection(model=str(export), engine="llamacpp", dry_run=True, host="0.0.0.0", threads=1))
    assert (launch.engine, launch.name, launch.api, launch.env) == (
        "llamacpp",
        "llm_tiny",
        "/v1",
        {"LLAMA_API_KEY": "sekret"},
    )
    assert launch.argv[:2] == [
        str(tmp_path / "no-llamacpp" / "bin" / "python"),
        str(REPO / "scripts" / "llamacpp_server.py"),
    ]
    flags = dict(zip(launch.argv[2::2], launch.argv[3::2]))
    assert {k: flags[k] for k in ("--model", "--alias", "--host", "--threads", "--ctx-size")} == {
        "--model": str(gguf_file),
        "--alias": "llm_tiny",
        "--host": "0.0.0.0",
        "--threads": "1",
        "--ctx-size": "0",
    }
    assert flags["--chat-template-file"].startswith(str(tmp_path))
    assert open(flags["--chat-template-file"]).read() == BASE_LM_CHAT_TEMPLATE
    assert "sekret" not in launch.shown() and launch.shown().startswith("LLAMA_API_KEY=******** ")
    llama3 = write_gguf_header(tmp_path / "chat" / "model.gguf", chat_template="{{ messages }}")
    launch = plan(ServeSection(model=str(llama3), engine="llamacpp", dry_run=True, served_model_name="chat-model"))
    assert "--chat-template-file" not in launch.argv and launch.name == "chat-model"
    write_gguf_header(export / "gguf" / "model-q8_0.gguf")
    for overrides, message in [
        ([f"serve.model={export}"], "holds 2 GGUF files (model-f16.gguf, model-q8_0.gguf): name one"),
        ([f"serve.model={gguf_file}", "serve.dtype=bfloat16"], "serve.dtype=bfloat16: llama.cpp runs the GGUF file's"),
        ([f"serve.model={export}/config.json"], "serve.engine=llamacpp serves a .gguf file; "),
        ([f"serve.model={gguf_file}", "serve.host=0.0.0.0"], "serve.host=0.0.0.0 accepts connections from other"),
    ]:
        proc = _serve(*overrides, "serve.engine=llamacpp", "serve.dry_run=true", tmp=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
