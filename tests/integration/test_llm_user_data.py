"""llm_tiny on your own data, as a user runs it: prepare_chat / prepare_text with a Llama-3-like tokenizer folder,
then scripts/train.py with data=chat_shards / data=text_shards. Fine-tuning on the chat fixture lowers the loss on
the assistant tokens (the only labelled ones)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import losses, run_train
from tests.fixtures.llm import write_chat, write_corpus, write_llama_tokenizer
from tests.support.launcher import run_python

pytestmark = pytest.mark.integration
FAST = ["recipe=llm_tiny", "trainer.log_every=1", "trainer.progress_bar=false", "checkpoint.final=false"]


def _prepare(module: str, *args: str) -> None:
    proc = run_python([sys.executable, "-m", module, *args], timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_chat_fine_tuning_lowers_the_assistant_loss(tmp_path):
    tokenizer = write_llama_tokenizer(tmp_path / "models" / "Llama-3.2-1B")
    chat = write_chat(tmp_path / "data" / "chat.jsonl")
    root = tmp_path / "my_chat"
    _prepare("data.prepare_chat", "--tokenizer", str(tokenizer), "--input", str(chat), "--out", str(root))
    run = tmp_path / "run"
    run_train([*FAST, "data=chat_shards", f"data.root={root}", "trainer.max_steps=24", f"run.dir={run}"])
    loss = losses(run)
    first, last = loss[1], sum(loss[s] for s in (22, 23, 24)) / 3
    # Random init starts near ln(vocab 512) = 6.2; the answers are learnable, so the loss falls far.
    assert first > 5.0 and last < 0.4 * first, loss
    assert (run / "export" / "tokenizer.json").exists()


def test_text_shards_train(tmp_path):
    tokenizer = write_llama_tokenizer(tmp_path / "models" / "Llama-3.2-1B")
    corpus = write_corpus(tmp_path / "data" / "corpus")
    root = tmp_path / "my_text"
    _prepare("data.prepare_text", "--tokenizer", str(tokenizer), "--input", f"{corpus}/*.txt", "--out", str(root))
    run = tmp_path / "run"
    run_train([*FAST, "data=text_shards", f"data.root={root}", "trainer.max_steps=3", f"run.dir={run}"])
    assert sorted(losses(run)) == [1, 2, 3]
