"""model.init_from under tp=2, pp=2, dp=2 (FSDP2) and cp=2 on 2 gloo ranks: step-0 logits equal transformers'
on the same checkpoint, the export right after loading (under cp=2: after a step at lr 0) is the source bit for bit,
tied embeddings stay tied while training under PP; and the whole CLI round trip (train with lr 0, end-of-run export,
scripts/export.py, generate) on a tied, llama3-scaled checkpoint split over 2 pipeline stages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_train
from tests.fixtures.llm import compare_export, rank_logits, tensors, write_llama_folder, write_token_dataset
from tests.support.launcher import spawn_ranks

pytestmark = pytest.mark.distributed
VARIANTS = ("tied", "gqa")
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": [], "cp2": ["parallel.cp=2", "optim.lr=0"]}
# Layouts that train one step at lr 0 before exporting: under cp the step runs the split attention (the keys and
# values gathered over cp, their gradients reduce-scattered back) and FSDP over dp x cp, and must change no bit.
STEP_AT_LR0 = {"cp2"}
BATCH, SEQ = 2, 48
GLOBAL_DOCS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from")
    models = {v: write_llama_folder(root / v, v) for v in VARIANTS}
    # Both variants share the tokenizer (same corpus and vocabulary): one dataset serves both.
    return {**models, "data": write_token_dataset(root / "data", models["tied"])}


def overrides(folder: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=llm_tiny",
        f"model.init_from={folder}",
        f"data.root={data}",
        "data.build=[]",
        "data.num_workers=0",
        "data.max_seq_len=64",
        "trainer.progress_bar=false",
        f"run.dir={run_dir}",
        *extra,
    ]


def _load_forward_export(folders: dict, run_root: str) -> dict:
    """Per variant and layout: max |logits - transformers'| on this rank, and (rank 0) whether the export
    written right after loading (STEP_AT_LR0: after one training step at lr 0) equals the source tensor for tensor."""
    import torch.distributed as tdist
    from transformers import LlamaForCausalLM

    from common.distributed import init_distributed
    from common.profiling import StepTimer
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    dist, out = init_distributed(), {}
    for variant in VARIANTS:
        folder = Path(folders[variant])
        reference = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokens = torch.randint(0, reference.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = reference(tokens).logits
        for layout, extra in LAYOUTS.items():
            run_dir = Path(run_root) / f"{variant}_{layout}"
            trainer = LLMTrainer(compose(overrides(folder, Path(folders["data"]), run_dir, *extra)), dist, run_dir)
            logits = rank_logits(trainer, tokens)
            result = {"error": None if logits is None else (logits - expected).abs().max().item()}
            if layout in STEP_AT_LR0:
                stats = trainer.train_step(iter(trainer.state.loader), StepTimer()).values
                result["step"] = {"tokens": int(stats["tokens"]), "grad_norm": stats["grad_norm"]}
            export = trainer.export()
            if dist.is_main:
                result |= compare_export(folder, export)
            trainer.state.loader.close()
            out[f"{variant}/{layout}"] = result
            tdist.barrier()
    return out


def test_parity_and_lossless_export_in_every_layout(folders, tmp_path):
    ranks = spawn_ranks(_load_forward_export, ({k: str(v) for k, v in folders.items()}, str(tmp_path)), 2, tmp_path)
    for key in ranks[0]:
        errors = [r[key]["error"] for r in ranks if r[key]["error"] is not None]
        print(f"{key}: max |logits - transformers| = {max(errors):.2e} on {len(errors)} rank(s)")
        assert errors and max(errors) <= 1e-5, key
        assert ranks[0][key]["same_keys"] and ranks[0][key]["bitwise"], key
        if key.split("/")[1] in STEP_AT_LR0:
            step = ranks[0][key]["step"]  # a real step: tokens trained, gradients not zero, and no bit moved
            assert step["tokens"] > 0 and step["grad_norm"] > 0, key


def _tied_training(folders: dict, run_root: str) -> dict:
    """Tied embeddings trained 3 steps under dp=2 and under pp=2 (same global batch): the per-step losses,
    and under PP the largest difference between the two stages' copies of the shared weight."""
    import torch.distributed as tdist

    from common.distributed import init_distributed
    from common.profiling import StepTimer
    from recipes.llm.train import LLMTrainer
    from scripts.kiln.launch import compose

    dist, out = init_distributed(), {}
    for layout, extra in {
        "dp2": [f"trainer.micro_batch_size={GLOBAL_DOCS // 2}"],
        "pp2": ["parallel.pp=2", f"trainer.micro_batch_size={GLOBAL_DOCS}"],
    }.items():
        run_dir = Path(run_root) / layout
        cfg = compose(
            overrides(
                Path(folders["tied"]), Path(folders["data"]), run_dir, "optim.lr=1e-2", "optim.warmup_steps=0", *extra
            )
        )
        trainer = LLMTrainer(cfg, dist, run_dir)
        batches = iter(trainer.state.loader)
        out[layout] = [trainer.train_step(batches, StepTimer()).values["loss"] for _ in range(3)]
        trainer.state.loader.close()
        if layout == "pp2":
            model = trainer.model
            mine = (model.tok_embeddings or model.output).weight.detach()
            copies = [torch.empty_like(mine) for _ in range(2)]
            tdist.all_gather(copies, mine, group=trainer.mesh["pp"].get_group())
            out["copies_differ_by"] = (copies[0] - copies[1]).abs().max().item()
    return out


def test_tied_embeddings_stay_tied_under_pipeline_parallelism(folders, tmp_path):
    result = spawn_ranks(_tied_training, ({k: str(v) for k, v in folders.items()}, str(tmp_path)), 2, tmp_path)[0]
    print(f"losses dp2 {result['dp2']}, pp2 {result['pp2']}")
    assert result["pp2"] == pytest.approx(result["dp2"], rel=1e-5)
    assert result["pp2"][-1] < result["pp2"][0]
    assert result["copies_differ_by"] == 0.0


def test_cli_round_trip_pp2(folders, tmp_path):
    """torchrun pp=2, one step at lr 0: the end-of-run export and scripts/export.py's are the source bit
    for bit, with its config, generation config and tokenizer; greedy generate matches the source's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, run_dir = folders["tied"], tmp_path / "run"
    run_train(
        overrides(
            source,
            folders["data"],
            run_dir,
            "parallel.pp=2",
            "trainer.max_steps=1",
            "optim.lr=0",
            f"trainer.micro_batch_size={GLOBAL_DOCS}",
        ),
        nproc=2,
    )
    again = tmp_path / "again"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export.py"), str(run_dir), "--out", str(again)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    want = tensors(source)
    for export in (run_dir / "export", again):
        got = tensors(export)
        assert got.keys() == want.keys() and "lm_head.weight" not in got  # tied: one tensor
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
        for name in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        ):
            assert (export / name).read_bytes() == (source / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "export")
    prompt = tokenizer("The with statement", return_tensors="pt")
    outputs = []
    for folder in (source, run_dir / "export"):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        outputs.append(
            model.generate(
                **prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )[0].tolist()
        )
    assert outputs[0] == outputs[1] and len(outputs[0]) == prompt["input_ids"].shape[1] + 16
