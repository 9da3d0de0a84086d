"""vLLM itself (its CPU build in .venv-serve, `make serve-env`) serving Kiln's LLM exports through
scripts/serve.py, driven by the official openai client and compared with an independent reference:
transformers' `generate` on the same folder, greedy, in float32.

Two exports, one engine each: an llm_tiny run that started from a Hugging Face Llama folder
(model.init_from, whose tokenizer has a chat template) and one from Kiln's own initialisation (a base
LM: scripts/serve.py hands vLLM a plain-text chat template). The second server sits behind an API key.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from common.tools.serving import BASE_LM_CHAT_TEMPLATE, http, running_server, serve_env
from tests.conftest import run_train
from tests.fixtures.llm import write_llama_folder, write_token_dataset
from tests.fixtures.runs import LLM_SERVED

openai = pytest.importorskip("openai", reason="needs the serve extra: pip install -e '.[serve]'")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(serve_env() is None, reason="needs vLLM's environment: make serve-env (.venv-serve)"),
]

FAST = ["trainer.progress_bar=false", "trainer.eval=false", "checkpoint.final=false", "trainer.max_steps=3"]
VLLM = ["serve.engine=vllm", "serve.dtype=float32", "serve.max_model_len=128", "serve.cpu_kvcache_gib=1"]
KEY = "kiln-test-key"
PROMPTS = ["The with statement", "A class definition", "Exceptions are raised"]
NEW_TOKENS = 12


@contextmanager
def vllm_server(export, log, api_key=None, *extra):
    env = {"KILN_API_KEY": api_key} if api_key else {}
    with running_server(export, *VLLM, *extra, log_path=log, startup_s=420, env=env) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key=api_key or "unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # vLLM's CPU attention kernels take head sizes of 32 and up (the fixture's 16: "Unsupported CPU attention
    # configuration"): 2 heads of 32.
    folder = write_llama_folder(root / "llama", "tied", num_attention_heads=2, num_key_value_heads=2)
    data = write_token_dataset(root / "data", folder)
    run_train(
        [
            "recipe=llm_tiny",
            f"model.init_from={folder}",
            f"data.root={data}",
            "data.build=[]",
            "data.num_workers=0",
            "data.max_seq_len=64",
            f"run.dir={root / 'run'}",
            *FAST,
        ]
    )
    return root / "run" / "export"


@pytest.fixture(scope="module")
def own_export(trained):
    return trained(LLM_SERVED) / "export"  # the run test_serve serves with transformers


@pytest.fixture(scope="module")
def hf_server(hf_export):
    with vllm_server(hf_export, hf_export.parent / "serve.log") as (base, client):
        yield base, client, hf_export


@pytest.fixture(scope="module")
def own_server(own_export, tmp_path_factory):
    # Eager (serve.enforce_eager): the hf server above runs vLLM's default torch.compile path, this one the other.
    with vllm_server(own_export, tmp_path_factory.mktemp("own") / "serve.log", KEY, "serve.enforce_eager=true") as (
        base,
        client,
    ):
        yield base, client, own_export


@pytest.fixture(params=["hf_server", "own_server"])
def server(request):
    return request.getfixturevalue(request.param)


def reference(export, prompts: list[str], *, chat: bool) -> list[tuple[list[int], list[int]]]:
    """transformers' greedy continuation of each prompt, as (prompt token ids, generated token ids). A chat
    goes through the export's chat template, or the base-LM template scripts/serve.py gives vLLM."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        if chat:
            template = None if tokenizer.chat_template else BASE_LM_CHAT_TEMPLATE
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                chat_template=template,
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids  # the template has its BOS
        else:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        out.append((ids[0].tolist(), generated[0, ids.shape[1] :].tolist()))
    return out


def token_ids(response) -> tuple[list[int], list[int]]:
    """(prompt, generated) token ids of a vLLM answer asked with return_token_ids (vLLM's extension)."""
    choice = response.choices[0]
    prompt = (response.model_extra or {}).get("prompt_token_ids") or choice.model_extra["prompt_token_ids"]
    return list(prompt), list(choice.model_extra["token_ids"])


IDS = {"extra_body": {"return_token_ids": True}}


def test_completions_equal_transformers_generate_token_for_token(server):
    _, client, export = server
    answers = [
        token_ids(client.completions.create(model="llm_tiny", prompt=p, max_tokens=NEW_TOKENS, temperature=0, **IDS))
        for p in PROMPTS
    ]
    assert answers == reference(export, PROMPTS, chat=False)


def test_chat_equals_transformers_generate_with_the_chat_template(server):
    _, client, export = server
    answers = [
        token_ids(
            client.chat.completions.create(
                model="llm_tiny", messages=[{"role": "user", "content": p}], max_tokens=NEW_TOKENS, temperature=0, **IDS
            )
        )
        for p in PROMPTS
    ]
    assert answers == reference(export, PROMPTS, chat=True)


def test_streaming_gives_the_same_text(hf_server):
    _, client, _ = hf_server
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model="llm_tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="llm_tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and streamed == whole.choices[0].message.content


def test_sixteen_concurrent_requests_are_all_answered(hf_server):
    _, client, _ = hf_server

    def ask(i: int) -> str:
        return (
            client.completions.create(model="llm_tiny", prompt=f"{PROMPTS[i % 3]} {i}", max_tokens=8, temperature=0)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len(answers) == 16 and all(isinstance(a, str) for a in answers)


def test_a_key_guards_the_server(own_server):
    base, client, _ = own_server
    body = json.dumps({"model": "llm_tiny", "prompt": "The", "max_tokens": 2}).encode()
    assert http(f"{base}/v1/completions", body)[0] == 401  # no key
    keyless = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model="llm_tiny", prompt="The", max_tokens=2)
    assert client.completions.create(model="llm_tiny", prompt="The", max_tokens=2).choices[0].text is not None


def test_bad_requests_get_a_4xx_and_the_server_stays_up(hf_server):
    base, client, _ = hf_server
    status, text = http(f"{base}/v1/completions", b"{not json")
    assert 400 <= status < 500 and text, (status, text)
    with pytest.raises(openai.NotFoundError, match="llm_tin"):  # an unknown model name
        client.completions.create(model="llm_tin", prompt="The", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="(?i)context|length|too long|maximum"):
        client.completions.create(model="llm_tiny", prompt="The with statement " * 100, max_tokens=2)
    assert http(f"{base}/health")[0] == 200
    assert client.completions.create(model="llm_tiny", prompt="The", max_tokens=2).choices[0].text is not None
