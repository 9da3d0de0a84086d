"""vLLM itself (its CPU build in .venv-serve, `make serve-env`) serving Kiln's LLM exports through
scripts/serve.py, driven by the official openai client and compared with an independent reference:
transformers' `generate` on the same folder (and peft's PeftModel for the adapters), greedy, in float32.

Two engines, each started once (a start is ~60 s on CI's 2 cores) and each covering several cases:
- an llm_tiny run that started from a Hugging Face Llama folder (model.init_from, whose tokenizer has a chat
  template), on vLLM's default torch.compile path, with two LoRA adapters over it (`serve.lora`: PEFT folders
  written by peft itself, random non-zero B, so the test does not depend on how Kiln trains them);
- a moe_tiny export (a Qwen3MoeForCausalLM folder: 8 experts, top-2, q/k norm) from Kiln's own initialisation:
  a base LM, so scripts/serve.py hands vLLM a plain-text chat template; eager (serve.enforce_eager), behind an
  API key.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import openai
import pytest

from scripts.kiln.serving import BASE_LM_CHAT_TEMPLATE, http, running_server
from tests.conftest import run_train
from tests.fixtures.llm import write_llama_folder, write_token_dataset
from tests.fixtures.runs import MOE_16_STEPS
from tests.fixtures.vllm import NEEDS_VLLM, openai_client

pytestmark = NEEDS_VLLM

FAST = ["trainer.progress_bar=false", "trainer.eval=false", "checkpoint.final=false", "trainer.max_steps=3"]
VLLM = ["serve.engine=vllm", "serve.dtype=float32", "serve.max_model_len=128", "serve.cpu_kvcache_gib=1"]
KEY = "kiln-test-key"
PROMPTS = ["The with statement", "A class definition", "Exceptions are raised"]
NEW_TOKENS = 12


class Served(NamedTuple):
    url: str
    client: object  # openai.OpenAI
    export: Path
    name: str  # the served model's name
    log: Path


@contextmanager
def vllm_server(export, log, api_key=None, *extra):
    env = {"KILN_API_KEY": api_key} if api_key else {}
    with running_server(export, *VLLM, *extra, log_path=log, startup_s=420, env=env) as base:
        yield base, openai_client(base, api_key or "unused")


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


def write_adapter(base, out, seed: int, targets: list[str]):
    """A PEFT LoRA folder over `base` with random A and B (B scaled up so the adapter changes greedy answers)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base),
        LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(hf_export):
    return {
        "attn": write_adapter(hf_export, hf_export.parent / "attn", 1, ["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": write_adapter(hf_export, hf_export.parent / "mlp", 2, ["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def hf_server(hf_export, adapters):
    lora = ",".join(f"{name}:{folder}" for name, folder in adapters.items())
    log = hf_export.parent / "serve.log"
    with vllm_server(hf_export, log, None, f"serve.lora={{{lora}}}") as (base, client):
        yield Served(base, client, hf_export, "llm_tiny", log)


@pytest.fixture(scope="module")
def moe_server(trained, tmp_path_factory):
    export = trained(MOE_16_STEPS) / "export"  # test_moe_tiny's run
    log = tmp_path_factory.mktemp("moe") / "serve.log"
    # Eager (serve.enforce_eager): the hf server runs vLLM's default torch.compile path, this one the other.
    with vllm_server(export, log, KEY, "serve.enforce_eager=true") as (base, client):
        yield Served(base, client, export, "moe_tiny", log)


@pytest.fixture(params=["hf_server", "moe_server"])
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
    client, export, name = server.client, server.export, server.name
    answers = [
        token_ids(client.completions.create(model=name, prompt=p, max_tokens=NEW_TOKENS, temperature=0, **IDS))
        for p in PROMPTS
    ]
    assert answers == reference(export, PROMPTS, chat=False)


def test_chat_equals_transformers_generate_with_the_chat_template(server):
    client, export, name = server.client, server.export, server.name
    answers = [
        token_ids(
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": p}], max_tokens=NEW_TOKENS, temperature=0, **IDS
            )
        )
        for p in PROMPTS
    ]
    assert answers == reference(export, PROMPTS, chat=True)


def test_streaming_gives_the_same_text(hf_server):
    client = hf_server.client
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
    client = hf_server.client

    def ask(i: int) -> str:
        return (
            client.completions.create(model="llm_tiny", prompt=f"{PROMPTS[i % 3]} {i}", max_tokens=8, temperature=0)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len(answers) == 16 and all(isinstance(a, str) for a in answers)


def test_a_key_guards_the_server(moe_server):
    base, client, name = moe_server.url, moe_server.client, moe_server.name
    body = json.dumps({"model": name, "prompt": "The", "max_tokens": 2}).encode()
    assert http(f"{base}/v1/completions", body)[0] == 401  # no key
    keyless = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model=name, prompt="The", max_tokens=2)
    assert client.completions.create(model=name, prompt="The", max_tokens=2).choices[0].text is not None


def test_the_moe_export_runs_as_qwen3_moe(moe_server):
    assert "Qwen3MoeForCausalLM" in moe_server.log.read_text()


def test_bad_requests_get_a_4xx_and_the_server_stays_up(hf_server):
    base, client = hf_server.url, hf_server.client
    status, text = http(f"{base}/v1/completions", b"{not json")
    assert 400 <= status < 500 and text, (status, text)
    with pytest.raises(openai.NotFoundError, match="llm_tin"):  # an unknown model name
        client.completions.create(model="llm_tin", prompt="The", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="(?i)context|length|too long|maximum"):
        client.completions.create(model="llm_tiny", prompt="The with statement " * 100, max_tokens=2)
    assert http(f"{base}/health")[0] == 200
    assert client.completions.create(model="llm_tiny", prompt="The", max_tokens=2).choices[0].text is not None


def peft_reference(base, adapter) -> list[list[int]]:
    """Greedy continuations of PROMPTS by peft's PeftModel over transformers' LlamaForCausalLM."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


def test_each_adapter_answers_like_peft_over_the_same_base(hf_server, adapters):
    client, export, name = hf_server.client, hf_server.export, hf_server.name
    assert {m.id for m in client.models.list().data} >= {name, "attn", "mlp"}
    base = [generated for _, generated in reference(export, PROMPTS, chat=False)]
    for adapter, folder in adapters.items():
        expected = peft_reference(export, folder)
        assert expected != base, adapter  # not vacuous: each adapter changes the greedy answers
        asked = [
            client.completions.create(model=adapter, prompt=p, max_tokens=NEW_TOKENS, temperature=0, **IDS)
            for p in PROMPTS
        ]
        served = [token_ids(answer)[1] for answer in asked]
        assert served == expected, adapter


def test_an_unknown_adapter_is_a_404(hf_server):
    client = hf_server.client
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
