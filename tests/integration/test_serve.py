"""scripts/serve.py on CPU (transformers serve, continuous batching; vLLM's CPU build: test_serve_vllm.py) in front
of freshly trained llm_tiny and vlm_tiny exports, driven by the official openai client: chat (streamed and not),
completions, models, health, images, 16 concurrent requests, malformed requests."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

from scripts.kiln.serving import http as _http
from scripts.kiln.serving import running_server
from tests.conftest import run_train
from tests.fixtures.runs import LLM_SERVED

pytestmark = pytest.mark.integration

FAST = ["trainer.progress_bar=false", "trainer.eval=false", "checkpoint.final=false", "trainer.log_every=5"]


@contextmanager
def serving(export, log_path, *overrides, startup_s=180):
    with running_server(export, *overrides, log_path=log_path, startup_s=startup_s) as base:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(trained, tmp_path_factory):
    export = trained(LLM_SERVED) / "export"  # test_serve_vllm serves it with vLLM
    with serving(export, tmp_path_factory.mktemp("llm") / "serve.log", "serve.engine=transformers") as (base, client):
        yield base, client, "llm_tiny"  # the default served name: the run's recipe


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    run = tmp_path_factory.mktemp("vlm")
    run_train(["recipe=vlm_tiny", "trainer.max_steps=30", "trainer.micro_batch_size=16", f"run.dir={run}", *FAST])
    with serving(
        run / "export", run / "serve.log", "serve.engine=transformers", "serve.served_model_name=kiln/vlm-tiny"
    ) as (base, client):
        yield base, client, "kiln/vlm-tiny"


def test_health_and_models_list_the_served_name(llm):
    base, client, name = llm
    assert _http(f"{base}/health") == (200, '{"status":"ok"}')
    assert [m.id for m in client.models.list().data] == [name]


def test_chat_streamed_and_not(llm):
    _, client, name = llm
    messages = [{"role": "user", "content": "The with statement"}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text
    used = reply.usage.completion_tokens
    assert 0 < used <= 12 and reply.choices[0].finish_reason == ("length" if used == 12 else "stop")

    chunks = list(
        client.chat.completions.create(model=name, messages=messages, max_tokens=12, temperature=0, stream=True)
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2  # really streamed, token by token
    assert "".join(pieces) == text  # greedy: the same answer either way
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_completion(llm):
    _, client, name = llm
    reply = client.completions.create(model=name, prompt="The import system", max_tokens=10, temperature=0)
    assert isinstance(reply.choices[0].text, str) and reply.choices[0].text
    assert 0 < reply.usage.completion_tokens <= 10 and reply.usage.prompt_tokens > 0


def test_sixteen_concurrent_requests_are_all_answered(llm):
    """Each of 16 concurrent requests gets its own reply, generated to its end: the 16 tokens asked for (finish
    reason `length`), or fewer ending in the model's end-of-sequence token (`stop`; a 20-step model may end a reply
    at once, with empty text)."""
    _, client, name = llm

    def ask(i):
        reply = client.chat.completions.create(
            model=name, max_tokens=16, temperature=0, messages=[{"role": "user", "content": f"Topic {i}: the"}]
        )
        choice = reply.choices[0]
        return reply.id, choice.message.content, reply.usage.completion_tokens, choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert len({rid for rid, *_ in answers}) == 16
    ended = [(n, why) for _, text, n, why in answers if isinstance(text, str)]
    assert len(ended) == 16 and all((n, why) == (16, "length") or (0 < n < 16 and why == "stop") for n, why in ended), (
        answers
    )


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(llm):
    base, client, name = llm
    url = f"{base}/v1/chat/completions"
    assert _http(url, b"{not json")[0] == 422
    assert _http(url, json.dumps({"model": name, "messages": [], "bogus": 1}).encode())[0] == 422
    wrong = _http(url, json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode())
    assert wrong[0] == 400 and name in wrong[1]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    # transformers serve 5.23 answers a body without "messages" with a 500 (an uncaught KeyError),
    # not a 4xx; it is still an error and must not take the server down.
    assert _http(url, json.dumps({"model": name}).encode())[0] >= 400
    reply = client.chat.completions.create(model=name, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert reply.choices[0].message.content and _http(f"{base}/health")[0] == 200


def _digit_data_url(index: int) -> str:
    from data.prepare_digits import encode_png, load_source_digits

    images, _ = load_source_digits()  # the VLM's own data: 8x8 grayscale digits as PNG
    return "data:image/png;base64," + base64.b64encode(encode_png(images[index])).decode()


def test_vlm_answers_about_an_image(vlm):
    _, client, name = vlm
    assert [m.id for m in client.models.list().data] == [name]
    question = {"type": "text", "text": "What digit is this?"}
    image = {"type": "image_url", "image_url": {"url": _digit_data_url(0)}}
    with_image = client.chat.completions.create(
        model=name, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [image, question]}]
    )
    text_only = client.chat.completions.create(
        model=name, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [question]}]
    )
    answer = with_image.choices[0].message.content
    assert isinstance(answer, str) and answer.strip()
    # The image reached the model: its 16 image tokens are in the prompt.
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + 16

    stream = client.chat.completions.create(
        model=name, max_tokens=8, temperature=0, stream=True, messages=[{"role": "user", "content": [image, question]}]
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


@pytest.mark.gpu
def test_vllm_serves_the_llm_export(trained, tmp_path):
    pytest.importorskip("vllm", reason="needs vllm (its own venv: pip install -e '.[serve-gpu]')")
    with serving(
        trained(LLM_SERVED) / "export",
        tmp_path / "serve.log",
        "serve.engine=vllm",
        "serve.gpu_memory_utilization=0.3",
        startup_s=600,
    ) as (_, client):
        assert [m.id for m in client.models.list().data] == ["llm_tiny"]
        reply = client.chat.completions.create(
            model="llm_tiny", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "The with statement"}]
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
        with ThreadPoolExecutor(16) as pool:
            texts = list(
                pool.map(
                    lambda i: (
                        client.completions.create(model="llm_tiny", prompt=f"Topic {i}", max_tokens=8).choices[0].text
                    ),
                    range(16),
                )
            )
        assert len(texts) == 16 and all(isinstance(t, str) for t in texts)
