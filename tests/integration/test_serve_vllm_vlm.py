"""vLLM itself (its CPU build in .venv-serve, `make serve-env`) serving Kiln's LLaVA export through scripts/serve.py,
asked with the official openai client about images sent as `image_url` data URLs, and compared with an independent
reference: `LlavaForConditionalGeneration.generate` with the export's processor on the same image and prompt,
greedy, in float32.

The export is a vlm_tiny run started from pretrained-part fixtures (a CLIP folder and a Llama folder with a chat
template). The tiny random model's greedy answers look alike from image to image, so the log-probabilities are
compared too: they match to ~1e-6, far below how much they move between two images.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest

from scripts.kiln.serving import http, running_server
from tests.conftest import run_train
from tests.fixtures.vllm import NEEDS_VLLM, VLLM_EAGER, ask, data_url, greedy, openai_client

pytestmark = NEEDS_VLLM

QUESTION = "What digit is this?"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from data import prepare_llava
    from tests.fixtures import vlm as fx

    root = tmp_path_factory.mktemp("llava")
    raw = fx.write_llava_data(root / "raw", n_pretrain=8, n_instruct=32, n_images=16)
    prepare_llava.build_llava(
        root / "data",
        json_path=raw / "llava_instruct.json",
        images=raw / "images",
        train_shards=1,
        val_shards=1,
        val_fraction=0.1,
    )
    clip = fx.write_clip(root / "clip")
    # vLLM's CPU attention kernels take head sizes of 32 and up: the LLM gets 2 heads of 32 (the fixture's 4 of 16).
    # The CLIP tower's 16 are fine (vLLM runs it with torch's SDPA).
    llama = fx.write_llama(root / "llama", chat_template=True, num_attention_heads=2)
    run_train(
        [
            "recipe=vlm_tiny",
            "data=llava",
            f"data.root={root / 'data'}",
            "data.num_workers=0",
            "data.max_seq_len=256",
            f"vlm.vision_from={clip}",
            f"vlm.language_from={llama}",
            "trainer.micro_batch_size=8",
            "trainer.max_steps=3",
            "trainer.progress_bar=false",
            "trainer.eval=false",
            "checkpoint.final=false",
            "optim.warmup_steps=1",
            "optim.lr=1e-2",
            f"run.dir={root / 'run'}",
        ]
    )
    return root / "run" / "export"


@pytest.fixture(scope="module")
def server(export):
    with running_server(export, *VLLM_EAGER, log_path=export.parent / "serve.log", startup_s=420) as base:
        yield base, openai_client(base), export


def digit(i: int):
    """sklearn's digit i as a 32x32 RGB image (the tower's size: the processor's resize and crop keep it as is)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    pixels = np.round(load_digits().images[i] * 255 / 16).astype(np.uint8)
    return Image.fromarray(np.kron(pixels, np.ones((4, 4), np.uint8))).convert("RGB")


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image(png: bytes) -> list[dict]:
    """A chat's content part for the image file `png`."""
    return [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}]


def reference(export, images) -> list[tuple[list[int], list[int], list[float]]]:
    """transformers' greedy answer per image: (prompt ids, generated ids, their log-probabilities). The prompt is
    the export's chat template on `<image>` + newline + the question, where vLLM puts an image part of a chat
    whose template takes text content."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(export)
    model = LlavaForConditionalGeneration.from_pretrained(export, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": f"<image>\n{QUESTION}"}], add_generation_prompt=True, tokenize=False
    )
    out = []
    for image in images:
        inputs = processor(text=prompt, images=[image], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            g = model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=processor.tokenizer.eos_token_id,
            )
        ids = g.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(g.logits, ids)]
        out.append((inputs["input_ids"][0].tolist(), ids, logprobs))
    return out


def test_image_answers_equal_transformers_generate(server):
    _, client, export = server
    images = [digit(0), digit(7)]
    answers = [greedy(client, "vlm_tiny", image(png(i)), QUESTION, NEW_TOKENS) for i in images]
    expected = reference(export, images)
    for (prompt, ids, logprobs), (ref_prompt, ref_ids, ref_logprobs) in zip(answers, expected):
        assert (prompt, ids) == (ref_prompt, ref_ids)  # the image's 16 tokens included
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4, rel=0)
    # The image reaches the model: its two answers' log-probabilities differ by more than the tolerance above.
    assert max(abs(a - b) for a, b in zip(answers[0][2], answers[1][2])) > 1e-4


def test_an_image_that_does_not_decode_gets_a_4xx_and_the_server_stays_up(server):
    base, client, _ = server
    with pytest.raises(openai.BadRequestError, match="(?i)image"):
        ask(client, "vlm_tiny", image(b"\x89PNG\r\n\x1a\n this is not an image"), QUESTION, NEW_TOKENS)
    assert http(f"{base}/health")[0] == 200
    assert ask(client, "vlm_tiny", image(png(digit(1))), QUESTION, NEW_TOKENS).choices[0].message.content is not None
