"""vLLM (its CPU build in .venv-serve) serving two LoRA adapters over one base through scripts/serve.py
(`serve.lora={name:folder,...}`), driven by the openai client. Reference: peft's `PeftModel` over
transformers' LlamaForCausalLM on the same folders, greedy, float32. The adapters are PEFT folders
written by peft itself (random, non-zero B), so the test does not depend on how Kiln trains them."""

from __future__ import annotations

import pytest

from common.tools.serving import running_server, serve_env
from tests.fixtures.llm import write_llama_folder

openai = pytest.importorskip("openai", reason="needs the serve extra: pip install -e '.[serve]'")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(serve_env() is None, reason="needs vLLM's environment: make serve-env (.venv-serve)"),
]

PROMPTS = ["The with statement", "A class definition"]
NEW_TOKENS = 10
IDS = {"extra_body": {"return_token_ids": True}}


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
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    # vLLM's CPU attention takes head sizes of 32 and up: 2 heads of 32.
    base = write_llama_folder(root / "base", "tied", num_attention_heads=2, num_key_value_heads=2)
    return base, {
        "attn": write_adapter(base, root / "attn", 1, ["q_proj", "k_proj", "v_proj", "o_proj"]),
        "mlp": write_adapter(base, root / "mlp", 2, ["gate_proj", "up_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def client(folders):
    base, adapters = folders
    lora = ",".join(f"{name}:{folder}" for name, folder in adapters.items())
    with running_server(
        base,
        "serve.engine=vllm",
        "serve.dtype=float32",
        "serve.max_model_len=128",
        "serve.cpu_kvcache_gib=1",
        "serve.served_model_name=base",
        f"serve.lora={{{lora}}}",
        log_path=base.parent / "serve.log",
        startup_s=420,
    ) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def reference(base, adapter=None) -> list[list[int]]:
    """Greedy continuations of PROMPTS by transformers (and peft, with an adapter)."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
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


def served(client, model: str) -> list[list[int]]:
    return [
        list(
            client.completions.create(model=model, prompt=p, max_tokens=NEW_TOKENS, temperature=0, **IDS)
            .choices[0]
            .model_extra["token_ids"]
        )
        for p in PROMPTS
    ]


def test_each_adapter_answers_like_peft_and_the_base_like_the_base(client, folders):
    base, adapters = folders
    assert {m.id for m in client.models.list().data} >= {"base", "attn", "mlp"}
    expected = {"base": reference(base), **{name: reference(base, folder) for name, folder in adapters.items()}}
    # Not vacuous: each adapter changes the greedy answers.
    assert expected["attn"] != expected["base"] and expected["mlp"] != expected["base"]
    for model, tokens in expected.items():
        assert served(client, model) == tokens, model


def test_an_unknown_adapter_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
