"""Every command in the ```bash blocks of README.md and docs/*.md runs, in DOCS order, on this CPU machine.

Each command is run as written, with only what makes it tiny appended (few steps, small eval) and
its `outputs/...` and `data/my_*` paths moved into a temp dir; `outputs/<recipe>/<run>` stands for
that recipe's latest run here. What a user brings (`~/models/<Name>`, `~/data/<name>`) is a tiny offline
fixture from tests/fixtures/ at that place in a temp HOME, and the `~` paths run as printed: a word that
starts with `~` is expanded as the shell does, a `key=~/...` reaches the CLI as it is (the shell leaves it).
A command that cannot run on a CPU machine is listed in NOT_RUN (the one list of what is not run) with the test
that covers the same path; a command that is neither run nor listed fails the test, so a new command in the README
or a docs page cannot go untested unnoticed. A command printed again on a later page (the README's quickstarts
repeat their topic page's commands) runs once, where it is first printed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from common.distributed import free_port
from data import tiny_bases as fixtures
from tests.conftest import REPO
from tests.fixtures import grpo, llm, vlm
from tests.support.launcher import launch_env, run_python

pytestmark = pytest.mark.integration

# Appended to a training command of each family: the run shrinks, the code path stays the same.
TINY = {
    "dit": [
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "diffusion.sample_every=0",
        "diffusion.sample_steps=2",
        "diffusion.samples_per_class=1",
        "diffusion.eval_samples_per_class=1",
    ],
    "vlm": ["trainer.max_steps=2", "trainer.log_every=1", "vlm.eval_samples=4", "vlm.max_new_tokens=4"],
    "llm": ["trainer.max_steps=2", "trainer.log_every=1"],
    "t2i": [
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "diffusion.sample_steps=2",
        "diffusion.eval_samples_per_class=1",
    ],
    "video": [
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "trainer.micro_batch_size=4",
        "diffusion.sample_steps=2",
        "trainer.eval=false",  # the eval (a classifier fit on real clips): tests/integration/test_video.py runs it
    ],
}
COMMON = ["trainer.progress_bar=false", "checkpoint.every=0"]
# A GPU recipe (dit_xl2, vlm_7b, ...) on its user's parts, here on the tiny stand-ins: CPU toggles and
# small micro-batches; the datasets of the README's data/my_* folders sit in the temp dir.
CPU = ["toggles=default"]
GPU_RECIPE = {"vlm": ["trainer.micro_batch_size=4", "data.num_workers=1"], "dit": [], "llm": [], "t2i": [], "video": []}
DATASETS = {"data=images": "data/my_images"}
GPU_NODE_NPROC = 2  # a README torchrun of a whole GPU node (more than 4 ranks) runs on 2 here

# Other scripts: what makes each one small (appended like the training overrides).
SCRIPT_ARGS = {
    "scripts/eval_dit.py": ["--per-class", "1", "--steps", "2"],
    "scripts/eval_t2i.py": ["--per-digit", "1", "--steps", "2"],
    "scripts/sample_dit.py": ["steps=2", "per_class=1"],
    "scripts/serve.py": ["serve.dry_run=true"],
    "scripts/preference_demo.py": ["--max-new-tokens", "4"],  # the servers themselves: tests/integration/test_serve.py
}
BENCH_TESTED = {"overhead", "ac"}  # scripts/bench.py's sections that tests/integration/test_bench.py runs

# What a user brings, as the README names it -> a builder of the tiny stand-in (called with that path in HOME).
FIXTURES = {
    # Heads of 32 like the real model's 64 and unlike the fixture's default 16, which vLLM's CPU build refuses
    # (scripts/serve.py says so before starting it): the README serves this folder with serve.engine=vllm.
    "~/models/Llama-3.2-1B": lambda d: llm.write_llama_folder(d, num_attention_heads=2, num_key_value_heads=2),
    "~/models/Qwen3-30B-A3B": lambda d: llm.write_moe_folder(d, "qwen3_moe"),
    "~/models/clip-vit-large-patch14-336": vlm.write_clip,
    "~/models/vicuna-7b-v1.5": vlm.write_llama,
    "~/models/llava-1.5-7b-hf": vlm.write_llava_hf,
    "~/models/Qwen2.5-VL-7B-Instruct": fixtures.make_qwen2_5_vl,
    "~/data/llava": vlm.write_llava_data,
    # Conversations with digits as images and drawn as videos (MP4 files and frame files), a few broken ones among them.
    # (prepare_llava's default 64 train shards: the default 640 conversations.)
    "~/data/my_vlm": lambda d: vlm.add_video_records(vlm.write_llava_data(d, n_pretrain=8), "llava_instruct.json", 8),
    "~/models/sd-vae-ft-mse": fixtures.make_vae,
    "~/data/my_images": fixtures.make_image_folder,
    "~/data/corpus": llm.write_corpus,
    "~/data/chat.jsonl": llm.write_chat,
    "~/data/prompts.jsonl": grpo.write_prompts,
    "~/data/captioned": fixtures.make_caption_folder,
    "~/data/clips": fixtures.make_clip_folder,
}

# The pages whose ```bash blocks run, in this order: the README first, then docs/ in an order where a page's
# commands come after the ones that build what they use (outputs/align, outputs/tiny-sd3, data/my_text, the DiT
# export's ONNX graph, ...). Every docs/*.md is in it (test_every_docs_page_is_run).
DOCS = [
    "README.md",
    "docs/training.md",
    "docs/data.md",
    "docs/dit.md",
    "docs/text-to-image.md",
    "docs/video.md",
    "docs/llm.md",
    "docs/lora.md",
    "docs/preference.md",
    "docs/long-context.md",
    "docs/vlm.md",
    "docs/serving.md",
    "docs/deploy.md",
    "docs/rl.md",
    "docs/profiling.md",
    "docs/planner.md",
    "docs/cluster.md",
    "docs/benchmarks.md",
    "docs/architecture.md",
]

# Commands that cannot run here, each with the place that runs the same code path: the one list of them.
NOT_RUN = {
    "export KILN_API_KEY": "sets a shell variable for the commands after it",
    "export PATH=": "sets a shell variable for the commands after it",
    "make test": "this test runs inside it",
    "make serve-env": "installs vLLM's environment: CI's .ci/run builds it, "
    "tests/integration/test_serve_vllm.py serves from it",
    "pip install": "installs an environment (CI's .ci/run installs the CPU one with make)",
    "python3 -m venv": "installs an environment (CI's .ci/run installs the CPU one with make)",
    "curl": "needs a live server: tests/integration/test_serve.py sends the same requests",
    "sbatch": "needs a SLURM cluster: tests/integration/test_slurm.py submits train.sbatch to a real one",
    "scripts/slurm/local_cluster.sh": "installs and starts SLURM as root: "
    "the fixture of tests/integration/test_slurm.py",
    "scripts/serve_gpu.sh": "needs a CUDA GPU and vLLM: tests/unit/test_serve_config.py checks its command lines",
    "scripts/bench.py --only serving": "trains llm_tiny and starts a server for minutes: make bench runs this section",
    "scripts/build_trt_engine.sh": "needs TensorRT's trtexec: "
    "tests/unit/test_trt_build.py runs it with stand-in trtexecs",
    "make gpu-check": "needs a CUDA GPU (without one: one line, exit 2, tests/unit/test_gpu_check.py)",
    "outputs/dit_2b/": "needs a trained dit_2b (a GPU run): the same export on dit_tiny runs above",
    "outputs/qwen_finetune/export": "needs the Qwen2.5-VL fine-tune above, which runs here as a dry run "
    "(TRAINED_ELSEWHERE): tests/integration/test_serve_vllm_qwen.py trains the same finetune=lora run "
    "(vlm.train_projector=false) over such an export and serves both through scripts/serve.py on vLLM",
    "recipe=llm_8b_128k": "needs 8 GPUs: its dry run is tests/unit/test_memory_planner.py's (against "
    "the plan), its path (cp x FSDP) on llm_tiny tests/distributed/test_llm_context_parallel.py",
}


# Training commands whose whole path another test trains (the command as the README prints it -> that test): here
# they run as a dry run in one process (the config composes and validates, the files it names are read, the model
# is built on the meta device: what a typo or a wrong path breaks), not trained a second time. A README edit that
# changes such a command makes it train here again until it is listed anew.
TRAINED_ELSEWHERE = {
    "python scripts/train.py recipe=dit_tiny": "make demo, the README's first command, runs it",
    "python scripts/train.py --nproc_per_node 2 recipe=dit_tiny "
    "parallel.zero_stage=3": "tests/distributed/test_zero_stages.py",
    "python scripts/train.py recipe=dit_tiny diffusion.objective=flow": "tests/integration/test_dit_latent.py (flow)",
    "python scripts/train.py recipe=vlm_tiny model.init_from=outputs/align "
    "run.dir=outputs/ft": "tests/integration/test_vlm.py (align -> finetune)",
    "python scripts/train.py --nproc_per_node 4 recipe=llm_tiny parallel.tp=2 "
    "trainer.micro_batch_size=4": "tests/distributed/test_llm_layouts.py (tp2 x dp2)",
    "python scripts/train.py --nproc_per_node 4 recipe=llm_tiny parallel.tp=2 parallel.pp=2 "
    "parallel.pp_schedule=1f1b": "tests/distributed/test_llm_pipeline.py (tp2 x pp2)",
    "python scripts/train.py recipe=llm_tiny data=text_shards "
    "data.root=data/my_text": "tests/integration/test_llm_user_data.py",
    "python scripts/train.py recipe=llm_tiny data=chat_shards "
    "data.root=data/my_chat": "tests/integration/test_llm_user_data.py",
    "python scripts/train.py recipe=vlm_tiny finetune=lora model.init_from=outputs/align export.merge_lora=true "
    "run.dir=outputs/vlm_lora": "tests/integration/test_vlm_lora.py",
    "python scripts/train.py recipe=moe_tiny run.dir=outputs/moe": "tests/integration/test_moe_tiny.py",
    "python scripts/train.py --nproc_per_node 8 recipe=vlm_7b model.init_from=~/models/llava-1.5-7b-hf "
    "data.root=data/my_llava_instruct run.dir=outputs/llava_more": "tests/integration/test_vlm_llava.py "
    "(llava-hf continued, on vlm_tiny)",
    "python scripts/train.py --nproc_per_node 8 recipe=vlm_7b model.init_from=~/models/Qwen2.5-VL-7B-Instruct "
    "data.root=data/my_qwen_instruct data.min_pixels=200704 data.max_pixels=1003520 "
    "run.dir=outputs/qwen_finetune": "tests/integration/test_vlm_qwen_train.py (on vlm_tiny)",
    "python scripts/train.py recipe=vlm_tiny model.init_from=outputs/tiny-qwen2.5-vl data=llava "
    "data.root=data/my_qwen_instruct": "tests/integration/test_vlm_qwen_train.py (its base: conftest's qwen_world)",
    "python scripts/train.py recipe=llm_tiny data=prompt_shards data.root=data/my_prompts "
    "model.init_from=outputs/llm_tiny/<run>/export grpo.enabled=true reward.functions=[common.rewards:exact_match] "
    "grpo.num_generations=4 grpo.max_completion_length=32 trainer.micro_batch_size=2": "tests/integration/"
    "test_grpo_loop.py (GRPO on llm_tiny's export, its samples from vLLM's CPU build)",
    "python scripts/train.py recipe=video_tiny model.init_from=outputs/tiny-wan": "tests/integration/test_video.py "
    "(video_tiny on moving-digit clips and a tiny Wan 2.1 pipeline, exported and sampled against WanPipeline)",
    "python scripts/train.py recipe=dit_tiny profile.enabled=true "
    "run.dir=outputs/prof": "tests/integration/test_profile_report.py",
    "python scripts/train.py --nproc_per_node 2 recipe=llm_tiny "
    "parallel.cp=2": "tests/distributed/test_llm_context_parallel.py (cp=2 against one process)",
    "python scripts/train.py --nproc_per_node 2 recipe=dit_tiny "
    "parallel.cp=2": "tests/distributed/test_dit_context_parallel.py (cp=2 against one process, ZeRO-2 and ZeRO-3)",
    "python scripts/train.py --nproc_per_node 2 recipe=t2i_tiny model.init_from=outputs/tiny-sd3 "
    "parallel.cp=2": "tests/distributed/test_t2i_zero.py (cp=2 against one rank)",
    "python scripts/train.py --nproc_per_node 2 recipe=vlm_tiny "
    "parallel.cp=2": "tests/distributed/test_vlm_zero2.py (cp=2 against dp=2)",
    "python scripts/train.py --nproc_per_node 2 recipe=video_tiny model.init_from=outputs/tiny-wan parallel.cp=2 "
    "parallel.zero_stage=3 toggles.activation_checkpointing=full": "tests/distributed/test_video_context_parallel.py "
    "(cp=2 under ZeRO-3 against one rank)",
}


def readme_commands(text: str) -> list[list[str]]:
    """The argv of every command in the ```bash blocks: `\\` continuations joined, comments dropped,
    `a && b` split into two commands."""
    commands = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            command: list[str] = []
            for token in [*shlex.split(line, comments=True), "&&"]:
                if token != "&&":
                    command.append(token)
                elif command:
                    commands.append(command)
                    command = []
    return commands


def ranks_and_arguments(argv: list[str]) -> tuple[int, str, list[str]]:
    """(ranks, script, its key=value arguments) of a training command: `python scripts/train.py --nproc_per_node N
    ...` (Kiln's launcher), `torchrun --nproc_per_node N scripts/train.py ...`, or one process."""
    script = next((i for i, a in enumerate(argv) if a.endswith(".py")), 1)
    nproc = int(argv[argv.index("--nproc_per_node") + 1]) if "--nproc_per_node" in argv else 1
    args = argv[script + 1 :]
    if args[:1] == ["--nproc_per_node"]:
        args = args[2:]
    return nproc, argv[script], args


def not_run_reason(argv: list[str]) -> str | None:
    line = " ".join(argv)
    return next((why for key, why in NOT_RUN.items() if key in line), None)


class Session:
    """Runs README commands in order, remembering each recipe's latest run for `<run>`."""

    def __init__(self, tmp: Path):
        self.tmp, self.latest, self.count, self.built = tmp, {}, 0, set()
        self.home = tmp / "home"  # the commands' HOME: the user's ~/models and ~/data

    def fixture(self, placeholder: str) -> None:
        """Build the stand-in for `~/models/<Name>` (...) where the README says it is, in self.home."""
        if placeholder not in self.built:
            target = self.home / placeholder.removeprefix("~/")
            target.parent.mkdir(parents=True, exist_ok=True)
            FIXTURES[placeholder](target)
            self.built.add(placeholder)

    def path(self, token: str) -> str:
        """A user's folders: built in HOME, and a word's leading `~` is HOME, as the shell makes it (a `~` after
        `key=` is left to the CLI, as the shell leaves it); outputs/... and data/my_... -> the temp dir;
        outputs/<recipe>/<run>... -> that recipe's latest run."""
        for placeholder in FIXTURES:
            if placeholder in token:
                self.fixture(placeholder)
        if token == "~" or token.startswith("~/"):
            token = f"{self.home}{token[1:]}"
        if token.startswith("data/my_") or "=data/my_" in token:
            token = token.replace("data/my_", f"{self.tmp}/data/my_")

        def run_dir(match: re.Match) -> str:  # outputs/<recipe>/<run> -> that recipe's latest run
            assert match[1] in self.latest, f"{token}: no {match[1]} run earlier in the README"
            return str(self.latest[match[1]])

        # Every outputs/... in the token (serve.lora={a:outputs/x,b:outputs/y} has two).
        token = re.sub(r"(?<![\w/.])outputs/(\w+)/<run>", run_dir, token)
        return re.sub(r"(?<![\w/.])outputs/", f"{self.tmp / 'outputs'}/", token)

    def dataset_args(self, args: list[str]) -> list[str]:
        """A dataset whose default data.root is a README data/my_* folder: that folder, in the temp dir."""
        if any(a.startswith("data.root=") for a in args):
            return args
        return [*args, *(f"data.root={self.tmp}/{root}" for key, root in DATASETS.items() if key in args)]

    def train_args(self, args: list[str]) -> list[str]:
        recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), "dit_tiny")
        if "--cfg" in args or "run.dry_run=true" in args:
            return args
        args = self.dataset_args(args)
        family = OmegaConf.load(REPO / "configs" / "recipe" / f"{recipe}.yaml").recipe.family  # moe_tiny: llm
        size = recipe.rsplit("_", 1)[1]
        if size != "tiny":
            args = [*args, *CPU, *GPU_RECIPE[family]]
        self.count += 1
        if "profile.enabled=true" in args or "profile=trace" in args:
            args = [*args, "profile.wait=0", "profile.warmup=0", "profile.active=1"]  # the 2 steps: traced
        run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("run.dir=")), None)
        extra = [*TINY[family], *COMMON]
        if run_dir is None:
            run_dir = str(self.tmp / "outputs" / recipe / f"readme{self.count}")
            extra.append(f"run.dir={run_dir}")
        if Path(run_dir).parent == self.tmp / "outputs" / recipe:  # outputs/<recipe>/<run>: runs in the default place
            self.latest[recipe] = Path(run_dir)
        return [*args, *extra]

    def command(self, argv: list[str]) -> list[str]:
        if " ".join(argv) in TRAINED_ELSEWHERE:  # a dry run of the same arguments, one process
            _, script, args = ranks_and_arguments(argv)
            return [sys.executable, script, *self.dataset_args([self.path(a) for a in args]), "run.dry_run=true"]
        argv = [self.path(a) for a in argv]
        if argv[0] == "make":
            # The Makefile passes ARGS to the command behind the target.
            extra = {
                "demo": self.train_args(["recipe=dit_tiny"])[1:],
                "bench": ["--quick", "--only", "overhead", "--out", str(self.tmp / "bench")],
            }
            # -o install: this environment is already installed (make would otherwise check it, and
            # rebuild it when pyproject.toml is newer than its stamp).
            return ["make", "-o", "install", *argv[1:], f"PY={sys.executable}", f"ARGS={shlex.join(extra[argv[1]])}"]
        nproc, script, args = ranks_and_arguments(argv)
        if nproc > 1 or argv[0] == "torchrun":
            nproc = nproc if nproc <= 4 else GPU_NODE_NPROC
            if argv[0] == "torchrun":
                launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
                return [sys.executable, *launch, script, *self.train_args(args)]
            # Kiln's launcher (scripts/train.py --nproc_per_node N): run_python forks its N ranks preloaded.
            return [sys.executable, script, "--nproc_per_node", str(nproc), *self.train_args(args)]
        assert argv[0] in ("python", "python3"), f"a README command this test does not know how to run: {argv}"
        script = argv[1]
        if script == "scripts/train.py":
            return [sys.executable, script, *self.train_args(argv[2:])]
        if script == "scripts/bench.py":
            # A section the command names on its own (pipeline, ...), quick; else the overhead section only:
            # tests/integration/test_bench.py runs overhead and ac in their quick mode.
            named = set(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else set()
            if named <= BENCH_TESTED:
                return [sys.executable, *argv[1:], "--only", "overhead", "--out", str(self.tmp / "bench")]
            quick = [] if "--quick" in argv else ["--quick"]
            return [sys.executable, *argv[1:], *quick, "--out", str(self.tmp / "bench")]
        if script == "-m":  # a dataset builder (python -m data.<builder> ...)
            return [sys.executable, *self.dataset_args(argv[1:])]
        return [sys.executable, *argv[1:], *SCRIPT_ARGS.get(script, [])]


def docs_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every command of the DOCS pages in order, each command once: where it is first printed."""
    seen, commands = set(), []
    for page in DOCS:
        for argv in readme_commands((REPO / page).read_text()):
            if " ".join(argv) not in seen:
                seen.add(" ".join(argv))
                commands.append((page, argv))
    return commands


PAGE_COMMANDS = docs_commands()
COMMANDS = [argv for _, argv in PAGE_COMMANDS]


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Session:
    return Session(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("argv", COMMANDS, ids=[f"{page}: {' '.join(c)}" for page, c in PAGE_COMMANDS])
def test_readme_command_runs(argv, session):
    reason = not_run_reason(argv)
    if reason:
        pytest.skip(f"not run here: {reason}")
    cmd = session.command(argv)
    ranks = "torch.distributed.run" in cmd or "--nproc_per_node" in cmd
    env = launch_env(2 if ranks else 1, PYTHONPATH=str(REPO), HOME=str(session.home))
    if argv[:2] == ["python", "-c"]:
        # A one-liner in a fresh interpreter, as a user's shell starts it: what the libraries print when imported
        # shows there (a preloaded fork imported them already), and it prints nothing but Kiln's lines.
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        noise = [line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("kiln:")]
        assert proc.returncode != 0 or not noise, "\n".join(noise)
    else:
        proc = run_python(cmd, env=env, timeout=900)  # forked from the preloaded server (tests/support/launcher.py)
    assert proc.returncode == 0, (
        f"docs command failed ({proc.returncode}): {' '.join(argv)}\nran: {shlex.join(cmd)}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]


def test_every_readme_command_is_run_or_accounted_for():
    """The parser sees the pages' commands, and each is either run above or listed in NOT_RUN."""
    assert len(COMMANDS) > 20
    session = Session(Path("/nonexistent"))
    session.latest = {r: Path("/x") for r in ("dit_tiny", "vlm_tiny", "llm_tiny")}
    session.built = set(FIXTURES)
    for argv in COMMANDS:
        if not_run_reason(argv) is None:
            session.command(argv)  # raises for a command this test cannot run
    assert os.path.exists(REPO / "Makefile")


SETUP = ["make demo", "make test"]  # the README's set-up: its first ```bash block
ACTIVATE = "source .venv/bin/activate"


def test_readme_activates_the_environment_its_commands_run_in():
    """After `make demo` / `make test` (two commands, and no more), the README says once, right after them, how a
    shell gets their environment; in a fresh shell that activation gives `python` the environment `make` installed
    (torch imports), the one whose interpreter runs the README's `python ...` commands above (sys.executable)."""
    text = (REPO / "README.md").read_text()
    setup = re.search(r"```bash\n(.*?)```", text, re.S)
    assert [" ".join(c) for c in readme_commands(setup[0])] == SETUP
    following = text[setup.end() :].strip().split("\n\n")[0]  # the paragraph right after the set-up commands
    assert f"`{ACTIVATE}`" in following, following
    assert text.count(ACTIVATE) == 1, "the README says how to activate the environment once"
    if not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip("no .venv here (make install creates it)")
    shell = "source .venv/bin/activate && python -c 'import sys, torch; print(sys.prefix)'"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin"}  # a fresh login's
    proc = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", shell], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    prefix = proc.stdout.strip().splitlines()[-1]
    assert os.path.realpath(prefix) == os.path.realpath(sys.prefix), (prefix, sys.prefix)
    assert os.path.realpath(prefix) == os.path.realpath(REPO / ".venv"), prefix


def test_the_readme_t2i_sizes_fit_the_demo_pipeline(tmp_path):
    """A reader's text-to-image pipeline is the demo's tiny one (the first t2i command builds it): every size the
    README and docs/ build caption shards at, or train t2i_tiny at, fits it (a size it cannot take stops the run)."""
    from recipes.t2i.weights import check_image_size

    folder = fixtures.make_sd3_pipeline(tmp_path / "tiny-sd3")  # as the README's first t2i command builds it
    sizes = [int(c[c.index("--image-size") + 1]) for c in COMMANDS if "data.prepare_captions" in c and "--input" in c]
    sizes += [int(a.split("=")[1]) for c in COMMANDS if "recipe=t2i_tiny" in c for a in c if "data.image_size=" in a]
    assert sizes
    for size in sizes:
        check_image_size(folder, size)


def test_every_docs_page_is_run():
    """Every docs/*.md page is in DOCS (a new page's commands run), and every page in DOCS exists."""
    pages = {"README.md", *(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))}
    assert sorted(DOCS) == sorted(pages), set(DOCS) ^ pages
    assert len(DOCS) == len(set(DOCS))


def test_the_lists_name_commands_and_tests_that_exist():
    """NOT_RUN stays short and each of its entries matches a printed command, so does each TRAINED_ELSEWHERE entry,
    and every test file the lists name as covering a command exists."""
    lines = [" ".join(argv) for argv in COMMANDS]
    assert len(NOT_RUN) <= 16, "NOT_RUN is the short list of what cannot run on CPU"
    assert [key for key in NOT_RUN if not any(key in line for line in lines)] == []
    assert [key for key in TRAINED_ELSEWHERE if key not in lines] == []
    named = re.findall(r"tests/[\w/]+\.py", " ".join([*NOT_RUN.values(), *TRAINED_ELSEWHERE.values()]))
    assert named
    assert [path for path in named if not (REPO / path).is_file()] == []
