"""vLLM itself (its CPU build in .venv-serve, `make serve-env`) serving the Qwen-VL generations Kiln trains
(recipes/vlm/archs.py QWEN_ARCHS: Qwen2.5-VL and Qwen3-VL) through scripts/serve.py, with a finetune=lora adapter over
each export, asked with the official openai client and compared with an independent reference: transformers'
`generate` on the same folder (peft's PeftModel for the adapter), greedy, in float32.

One engine per architecture (eager, ~40-70 s to start on CI's 2 cores) serves all its cases: the export of
test_vlm_qwen_train's run (the suite's cached run, tests/fixtures/vlm.py qwen_run_args on conftest's qwen_world /
qwen3_world) and, as `serve.lora`, the adapter of a 2-step finetune=lora run over that export with the merger(s)
frozen (vlm.train_projector=false: vLLM takes no fully trained module in an adapter). One request holds two images of
different sizes, so each takes its own number of image tokens; another a short video.

The reference's inputs come from transformers' own processor (Qwen2_5_VLProcessor / Qwen3VLProcessor), loaded from
the export by AutoProcessor in .venv-serve (it needs torchvision, which the training env's CPU torch lacks), as vLLM
loads it: the export is a complete processor folder. Its generate runs in the training env's transformers.
"""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from recipes.vlm.archs import QWEN_ARCHS
from scripts.kiln.serving import running_server, serve_venv
from tests.fixtures.runs import qwen_lora
from tests.fixtures.vllm import NEEDS_VLLM, VLLM_EAGER, data_url, greedy, openai_client
from tests.fixtures.vlm import qwen_run_args

pytestmark = NEEDS_VLLM

QUESTION = "Compare the two pictures."
SIZES = [(2, 3), (4, 2)]  # (width, height) in image tokens (the arch's unit: 28 or 32 px): 6 and 8 merged patches
# Answers of 8 tokens: both engines keep <|im_end|> from ending one sooner (vLLM's min_tokens, transformers'
# min_new_tokens), so the trained model's short answers still compare over 8 tokens.
NEW_TOKENS = 8
ADAPTER = "qwen_lora"
# What AutoProcessor builds from each export (processor, video processor): transformers' classes of the release.
PROCESSORS = {
    "qwen2_5_vl": ["Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"],
    "qwen3_vl": ["Qwen3VLProcessor", "Qwen3VLVideoProcessor"],
}

VIDEO = (4, 2, 3)  # frames, height and width in image tokens: 2 temporal patches of 2 frames
VIDEO_FPS = 2.0  # 4 frames at 2 fps: Qwen3VLVideoProcessor's own sampling (2 fps, at least 4 frames) keeps all 4
VIDEO_QUESTION = "Describe the image."

# In .venv-serve (transformers' Qwen-VL processors need torchvision, which only that env has): the export's processor
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
# The decoded frames' indices, as vLLM's loader gives them: Qwen3VLProcessor's timestamp texts are computed from them.
video = processor(
    text=[prompt("video", 1, video_question)],
    videos=[frames],
    video_metadata=[VideoMetadata(total_num_frames=t, fps=fps, frames_indices=list(range(t)))],
    return_tensors="np",
)
np.savez(out + "/video.npz", **video)
print(json.dumps([type(processor).__name__, type(processor.video_processor).__name__]))
"""


@pytest.fixture(scope="module", params=list(QWEN_ARCHS))
def runs(request, trained):
    """(the full fine-tune's export, the LoRA run's adapter folder over it, the arch's model_type), one architecture
    at a time: pytest finishes one param's tests (and stops its engine) before the next one's start."""
    world = request.getfixturevalue("qwen_world" if request.param == "qwen2_5_vl" else "qwen3_world")
    export = trained(qwen_run_args(world)) / "export"
    return export, trained(qwen_lora(world, export)) / "export", request.param


@pytest.fixture(scope="module")
def media_job(runs, tmp_path_factory):
    """The .venv-serve process that writes the video and the processor's inputs, started before the engine (whose
    start is mostly waiting) and collected by `media`: (process, folder, image files)."""
    from PIL import Image

    export, _, arch = runs
    unit = QWEN_ARCHS[arch].unit
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    images = [folder / f"image{i}.png" for i in range(len(SIZES))]
    for path, (w, h) in zip(images, SIZES):
        Image.fromarray(rng.integers(0, 256, (h * unit, w * unit, 3), dtype=np.uint8)).save(path)
    (folder / "process.py").write_text(PROCESS)
    frames, h, w = VIDEO
    (folder / "job.json").write_text(json.dumps([QUESTION, VIDEO_QUESTION, (frames, h * unit, w * unit), VIDEO_FPS]))
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
def media(runs, media_job):
    """{"images": the two PNG files, "video": the video file, "image_inputs" / "video_inputs": the export's
    processor's model inputs for each request ({name: tensor}, made in .venv-serve)}."""
    import torch

    proc, folder, images = media_job
    proc.wait(timeout=300)
    stdout, stderr = (folder / "out.txt").read_text(), (folder / "err.txt").read_text()
    assert proc.returncode == 0, stderr[-2000:]
    # The export is a complete processor folder: AutoProcessor builds the generation's processor, with a video
    # processor (whose class the video test checks).
    processor, video_processor = json.loads(stdout.splitlines()[-1])
    assert processor == PROCESSORS[runs[2]][0]
    tensors = {
        k: {n: torch.from_numpy(v) for n, v in np.load(folder / f"{k}.npz").items()} for k in ("images", "video")
    }
    return {
        "images": images,
        "video": folder / "video.avi",
        "image_inputs": tensors["images"],
        "video_inputs": tensors["video"],
        "video_processor": video_processor,
    }


@pytest.fixture(scope="module")
def server(runs, media_job, tmp_path_factory):
    export, adapter, _ = runs
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    lora = f"serve.lora={{{ADAPTER}:{adapter}}}"
    with running_server(export, *VLLM_EAGER, lora, log_path=log, startup_s=420) as base:
        yield openai_client(base)


def reference(export, inputs, adapter=None) -> tuple[list[int], list[int], list[float]]:
    """transformers' greedy answer (prompt ids, generated ids, their log-probabilities) on the processor's inputs
    (`generate`'s raw logits, as vLLM's logprobs are), with peft's PeftModel over the export where an adapter is
    given. The release's class (Qwen2_5_VL... / Qwen3VLForConditionalGeneration) from the export's config."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
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


def ask(client, model: str, parts: list[dict], question: str):
    return greedy(client, model, parts, question, NEW_TOKENS, min_tokens=NEW_TOKENS)


def ask_images(client, model: str, media):
    urls = [data_url(p.read_bytes(), "image/png") for p in media["images"]]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return ask(client, model, parts, QUESTION)


def test_two_images_answer_like_transformers_generate(server, runs, media):
    export, _, _ = runs
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
    export, adapter, _ = runs
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
    """A 4-frame video at 2 fps (vLLM's CPU build decodes it with OpenCV, all frames): the same prompt (its video
    tokens; Qwen3-VL's timestamp text per temporal patch) and answer as transformers on the processor's inputs for the
    same frames. How large the frames are resized is the export's video processor's (Qwen3-VL's budget spans the
    clip): both sides read it from the export. Qwen2.5-VL's log-probabilities agree to ~4e-4, not ~1e-6 as the
    images' do (measured: vLLM decodes the very frames, and transformers' processor called with vLLM's video metadata
    gives the same pixel values, grid and second_per_grid_ts; a 2-frame video, one temporal patch, agrees to ~1e-6 and
    a 6-frame one to ~5e-4: the gap is in how the two run several temporal patches)."""
    export, _, arch = runs
    # Kiln's export names its video processor (video_preprocessor_config.json): without it a Qwen3-VL export gets
    # the image processor's Qwen2VLVideoProcessor, which has no frame rate, and vLLM answers its videos with a 400.
    assert media["video_processor"] == PROCESSORS[arch][1]
    inputs = media["video_inputs"]
    parts = [{"type": "video_url", "video_url": {"url": data_url(media["video"].read_bytes(), "video/x-msvideo")}}]
    prompt, ids, logprobs = ask(server, "vlm_tiny", parts, VIDEO_QUESTION)
    ref_prompt, ref_ids, ref_logprobs = reference(export, inputs)
    pad = json.loads((export / "config.json").read_text())["video_token_id"]
    (grid,) = inputs["video_grid_thw"].tolist()
    assert grid[0] == VIDEO[0] // 2 and prompt.count(pad) == math.prod(grid) // 4  # all 4 frames: 2 temporal patches
    print(f"vLLM {ids} {logprobs}\ntransformers {ref_ids} {ref_logprobs}")
    assert (prompt, ids) == (ref_prompt, ref_ids)
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3, rel=0)
