"""vLLM itself (its CPU build in .venv-serve, `make serve-env`) serving a Qwen2.5-VL export through scripts/serve.py,
with a finetune=lora adapter over it, asked with the official openai client and compared with an independent
reference: transformers' `generate` on the same folder (peft's PeftModel for the adapter), greedy, in float32.

One engine (eager, ~40-70 s to start on CI's 2 cores) serves both: the export of test_vlm_qwen_train's run (the
suite's cached run, tests/fixtures/vlm.py qwen_run_args) and, as `serve.lora`, the adapter of a 2-step finetune=lora
run over that export with the merger frozen (vlm.train_projector=false: vLLM takes no fully trained module in an
adapter). The request holds two images of different sizes, so each takes its own number of image tokens.

The reference's inputs come from transformers' own Qwen2_5_VLProcessor, loaded from the export by AutoProcessor in
.venv-serve (it needs torchvision, which the training env lacks: PITFALLS.md), as vLLM loads it: the export is a
complete processor folder. Its generate runs in the training env's transformers.
"""

from __future__ import annotations

import base64
import json
import subprocess

import numpy as np
import pytest

from common.tools.serving import running_server, serve_env, serve_venv
from tests.fixtures.runs import qwen_lora
from tests.fixtures.vlm import qwen_run_args

openai = pytest.importorskip("openai", reason="needs the serve extra: pip install -e '.[serve]'")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(serve_env() is None, reason="needs vLLM's environment: make serve-env (.venv-serve)"),
]

VLLM = [
    "serve.engine=vllm",
    "serve.dtype=float32",
    "serve.max_model_len=128",
    "serve.cpu_kvcache_gib=1",
    "serve.enforce_eager=true",
]
QUESTION = "Compare the two pictures."
SIZES = [(56, 84), (112, 56)]  # (width, height): 2x3 and 4x2 merged patches at the run's pixel budget
# Answers of 8 tokens: both engines keep <|im_end|> from ending one sooner (vLLM's min_tokens, transformers'
# min_new_tokens), so the trained model's short answers still compare over 8 tokens.
NEW_TOKENS = 8
ADAPTER = "qwen_lora"

VIDEO = (4, 56, 84)  # frames, height, width: 2 x 2x3 merged patches (temporal patches of 2 frames)
VIDEO_FPS = 2.0
VIDEO_QUESTION = "Describe the image."

# In .venv-serve (transformers' Qwen2.5-VL processor needs torchvision, PITFALLS.md): the export's processor
# (AutoProcessor), its chat template and the model inputs it makes of (1) the two images and QUESTION, (2) a short
# video and VIDEO_QUESTION. The video is written there too (OpenCV): FFV1, lossless, so vLLM decodes exactly the
# frames the reference is given.
PROCESS = """
import json, sys
import cv2
import numpy as np
from PIL import Image
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

folder, out, images = sys.argv[1], sys.argv[2], sys.argv[3:]
question, video_question, (t, h, w), fps = json.loads(sys.stdin.read())
processor = AutoProcessor.from_pretrained(folder, local_files_only=True)


def prompt(kind, n, text):
    content = [{"type": kind}] * n + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


pictures = [Image.open(p) for p in images]
two = processor(text=[prompt("image", len(pictures), question)], images=pictures, return_tensors="np")
np.savez(out + "/images.npz", **two)
frames = np.random.default_rng(1).integers(0, 256, (t, h, w, 3), dtype=np.uint8)
writer = cv2.VideoWriter(out + "/video.avi", cv2.VideoWriter_fourcc(*"FFV1"), fps, (w, h))
for frame in frames:
    writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
writer.release()
video = processor(
    text=[prompt("video", 1, video_question)],
    videos=[frames],
    video_metadata=[VideoMetadata(total_num_frames=t, fps=fps)],
    return_tensors="np",
)
np.savez(out + "/video.npz", **video)
print(json.dumps([type(processor).__name__, type(processor.video_processor).__name__]))
"""


@pytest.fixture(scope="module")
def runs(qwen_world, trained):
    """(the full fine-tune's export, the LoRA run's adapter folder over it)."""
    export = trained(qwen_run_args(qwen_world)) / "export"
    return export, trained(qwen_lora(qwen_world, export)) / "export"


@pytest.fixture(scope="module")
def media_job(runs, tmp_path_factory):
    """The .venv-serve process that writes the video and the processor's inputs, started before the engine (whose
    start is mostly waiting) and collected by `media`: (process, folder, image files)."""
    from PIL import Image

    export, _ = runs
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    images = [folder / f"image{i}.png" for i in range(len(SIZES))]
    for path, (w, h) in zip(images, SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    (folder / "process.py").write_text(PROCESS)
    (folder / "job.json").write_text(json.dumps([QUESTION, VIDEO_QUESTION, VIDEO, VIDEO_FPS]))
    # Its output to files: a pipe nobody reads while the engine starts could fill and stall it.
    with open(folder / "job.json") as job, open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [str(serve_venv() / "bin" / "python"), str(folder / "process.py"), str(export), str(folder)]
            + [str(p) for p in images],
            stdin=job,
            stdout=out,
            stderr=err,
        )
    yield proc, folder, images
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def media(media_job):
    """{"images": the two PNG files, "video": the video file, "image_inputs" / "video_inputs": the export's
    processor's model inputs for each request ({name: tensor}, made in .venv-serve)}."""
    import torch

    proc, folder, images = media_job
    proc.wait(timeout=300)
    stdout, stderr = (folder / "out.txt").read_text(), (folder / "err.txt").read_text()
    assert proc.returncode == 0, stderr[-2000:]
    # The export is a complete processor folder: AutoProcessor builds Qwen's processor, video processor included.
    assert json.loads(stdout.splitlines()[-1]) == ["Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"]
    tensors = {
        k: {n: torch.from_numpy(v) for n, v in np.load(folder / f"{k}.npz").items()} for k in ("images", "video")
    }
    return {
        "images": images,
        "video": folder / "video.avi",
        "image_inputs": tensors["images"],
        "video_inputs": tensors["video"],
    }


@pytest.fixture(scope="module")
def server(runs, media_job, tmp_path_factory):
    export, adapter = runs
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(export, *VLLM, f"serve.lora={{{ADAPTER}:{adapter}}}", log_path=log, startup_s=420) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def reference(export, inputs, adapter=None) -> tuple[list[int], list[int], list[float]]:
    """transformers' greedy answer (prompt ids, generated ids, their log-probabilities) on the processor's inputs
    (`generate`'s raw logits, as vLLM's logprobs are), with peft's PeftModel over the export where an adapter is
    given."""
    import torch
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(export, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        g = model.eval().generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = g.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(g.logits, ids)]
    return inputs["input_ids"][0].tolist(), ids, logprobs


def data_url(path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def ask(client, model: str, parts: list[dict], question: str) -> tuple[list[int], list[int], list[float]]:
    """vLLM's greedy answer to the media `parts` and the question: (prompt ids, generated ids, their
    log-probabilities)."""
    r = client.chat.completions.create(
        model=model,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True, "min_tokens": NEW_TOKENS},
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
    )
    choice = r.choices[0]
    prompt = (r.model_extra or {}).get("prompt_token_ids") or choice.model_extra["prompt_token_ids"]
    return list(prompt), list(choice.model_extra["token_ids"]), [t.logprob for t in choice.logprobs.content]


def ask_images(client, model: str, media):
    parts = [{"type": "image_url", "image_url": {"url": data_url(p, "image/png")}} for p in media["images"]]
    return ask(client, model, parts, QUESTION)


def test_two_images_answer_like_transformers_generate(server, runs, media):
    export, _ = runs
    inputs = media["image_inputs"]
    prompt, ids, logprobs = ask_images(server, "vlm_tiny", media)
    ref_prompt, ref_ids, ref_logprobs = reference(export, inputs)
    pad = json.loads((export / "config.json").read_text())["image_token_id"]
    grids = inputs["image_grid_thw"].tolist()
    assert grids == [[1, 6, 4], [1, 4, 8]] and prompt.count(pad) == (24 + 32) // 4  # each image its own tokens
    print(f"vLLM {ids} {logprobs}\ntransformers {ref_ids} {ref_logprobs}")
    assert (prompt, ids) == (ref_prompt, ref_ids)
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4, rel=0)
    # The images reach the answer: with their pixels mirrored it moves by far more than the tolerance above.
    _, _, mirrored = reference(export, {**inputs, "pixel_values": inputs["pixel_values"].flip(0)})
    assert max(abs(a - b) for a, b in zip(mirrored, ref_logprobs)) > 1e-3


def test_the_lora_adapter_answers_like_peft_over_the_export(server, runs, media):
    export, adapter = runs
    inputs = media["image_inputs"]
    prompt, ids, logprobs = ask_images(server, ADAPTER, media)
    ref_prompt, ref_ids, ref_logprobs = reference(export, inputs, adapter)
    _, base_ids, base_logprobs = reference(export, inputs)
    print(f"vLLM+LoRA {ids} {logprobs}\npeft {ref_ids} {ref_logprobs}\nbase {base_ids}")
    # Not vacuous: the adapter moves the answer's log-probabilities by far more than the tolerance.
    assert max(abs(a - b) for a, b in zip(ref_logprobs, base_logprobs)) > 1e-2
    assert (prompt, ids) == (ref_prompt, ref_ids)
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4, rel=0)


def test_a_short_video_answers_like_transformers_generate(server, runs, media):
    """A 4-frame video at 2 fps (vLLM's CPU build decodes it with OpenCV, all frames): the same prompt (12 video
    tokens) and answer as transformers on the processor's inputs for the same frames. Its log-probabilities agree to
    ~4e-4, not ~1e-6 as the images' do (measured: vLLM decodes the very frames, and transformers' processor called
    with vLLM's video metadata gives the same pixel values, grid and second_per_grid_ts; a 2-frame video, one temporal
    patch, agrees to ~1e-6 and a 6-frame one to ~5e-4: the gap is in how the two run several temporal patches)."""
    export, _ = runs
    inputs = media["video_inputs"]
    parts = [{"type": "video_url", "video_url": {"url": data_url(media["video"], "video/x-msvideo")}}]
    prompt, ids, logprobs = ask(server, "vlm_tiny", parts, VIDEO_QUESTION)
    ref_prompt, ref_ids, ref_logprobs = reference(export, inputs)
    pad = json.loads((export / "config.json").read_text())["video_token_id"]
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 6]] and prompt.count(pad) == 2 * 4 * 6 // 4
    print(f"vLLM {ids} {logprobs}\ntransformers {ref_ids} {ref_logprobs}")
    assert (prompt, ids) == (ref_prompt, ref_ids)
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3, rel=0)
