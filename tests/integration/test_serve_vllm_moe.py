"""vLLM's CPU build (.venv-serve) serving the export of a moe_tiny run (a Qwen3MoeForCausalLM folder: 8
experts, top-2, q/k norm) through scripts/serve.py: greedy completions equal transformers' `generate` on the
same folder token for token, in float32."""

from __future__ import annotations

import pytest

from common.tools.serving import running_server, serve_env
from tests.fixtures.runs import MOE_16_STEPS
from tests.integration.test_serve_vllm import IDS, NEW_TOKENS, PROMPTS, reference, token_ids

openai = pytest.importorskip("openai", reason="needs the serve extra: pip install -e '.[serve]'")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(serve_env() is None, reason="needs vLLM's environment: make serve-env (.venv-serve)"),
]


def test_vllm_serves_a_moe_export_like_transformers(trained, tmp_path):
    export = trained(MOE_16_STEPS) / "export"  # test_moe_tiny's run
    with running_server(
        export,
        "serve.engine=vllm",
        "serve.dtype=float32",
        "serve.max_model_len=128",
        "serve.cpu_kvcache_gib=1",
        "serve.enforce_eager=true",
        log_path=tmp_path / "serve.log",
        startup_s=420,
    ) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        answers = [
            token_ids(
                client.completions.create(model="moe_tiny", prompt=p, max_tokens=NEW_TOKENS, temperature=0, **IDS)
            )
            for p in PROMPTS
        ]
    assert "Qwen3MoeForCausalLM" in (tmp_path / "serve.log").read_text()
    assert answers == reference(export, PROMPTS, chat=False)
