"""OpenAI's images API for a diffusion export: `POST /v1/images/generations`, on FastAPI + uvicorn; the machinery
the class-conditional DiT's server (recipes/dit/serve.py: the prompt is a class name), the text-to-image one
(recipes/t2i/serve.py: the prompt is text) and the text-to-video one (recipes/video/serve.py: the same API at
`POST /v1/videos/generations`, MP4 clips) share. A recipe's server is a `ServedImages`: what a prompt conditions
on, the starting noise a seed gives, one sampling call for a batch, and its `Media` (the route, the output format
and its encoder: PNG images, or MP4 videos).

`n`, `size` (the export's own "WxH" only), `response_format=b64_json` and `output_format=png` (a video server:
mp4) are OpenAI's fields, and
`seed`, `guidance_scale` and `num_inference_steps` are extra fields (`extra_body` in the openai client). Each request
draws its starting noise from its own seed, so a seeded request returns the same images whatever else shares its
batch. Requests that arrive together share one denoising loop: the batcher waits `batch_wait_ms` after the first,
then runs every waiting request with the same number of steps, up to `max_batch_images` images (classifier-free
guidance doubles the model's batch). Per-request guidance scales ride along in the same batch. Every batch is logged
with its size.

Also `GET /v1/models` and `GET /health`. With an API key, /v1 answers 401 without `Authorization: Bearer <key>`.
scripts/serve.py starts this for a DiT, text-to-image or video export (scripts/kiln/serving.py picks the recipe's server
and its backend).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import json
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, ValidationError

from common.diffusion.sampling import to_uint8

MAX_STEPS = 1000
MAX_PROMPT_CHARS = 32000  # OpenAI's own limit (gpt-image-1); a model's server may refuse shorter ones


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    """An OpenAI-style error response."""
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


class RequestError(Exception):
    """A request the server refuses: `status` (4xx) with this message, naming the field `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def png_bytes(image: torch.Tensor) -> bytes:
    """One image [C, S, S] in [-1, 1] as a PNG."""
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image[None])[0]).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class Media:
    """What a server answers with: its noun (its route `/v1/<noun>/generations`, its messages and log), the one
    `output_format` it writes, how one sample becomes that file's bytes, and the fields every response adds."""

    noun: str
    output_format: str
    encode: Callable[[torch.Tensor], bytes]
    fields: dict = field(default_factory=dict)

    @property
    def route(self) -> str:
        return f"/v1/{self.noun}/generations"


IMAGES = Media("images", "png", png_bytes)


class ServedImages(Protocol):
    """What a recipe's images (or videos) server serves (recipes/dit/serve.py, recipes/t2i/serve.py,
    recipes/video/serve.py)."""

    media: Media  # IMAGES, or the family's own (MP4 videos)
    size: str  # "WxH": the one size it draws
    sample_steps: int  # the defaults of num_inference_steps and guidance_scale (the export's kiln.json)
    guidance_scale: float
    card: dict  # extra fields of its /v1/models entry

    def condition(self, prompt: str) -> Any:
        """What `prompt` conditions on (a class id, the text itself); a RequestError for one the model cannot take."""

    def noise(self, n: int, seed: int) -> torch.Tensor:
        """The starting noise of n images of one request, drawn from `seed`."""

    def draw(self, conditions: list, noise: torch.Tensor, steps: int, guidance_scale: torch.Tensor) -> torch.Tensor:
        """Samples in [-1, 1] (images [N, C, S, S], clips [N, C, F, H, W]), one per condition, from their noise and
        guidance scales."""


class PromptSampled:
    """A ServedImages whose conditions are the prompts themselves, drawn by a prompt sampler (`self.sampler`:
    noise(n, seed), and prompts -> samples from given noise): the text-to-image and video servers."""

    sampler: Any

    def noise(self, n: int, seed: int) -> torch.Tensor:
        return self.sampler.noise(n, seed)

    def draw(self, prompts: list[str], noise: torch.Tensor, steps: int, guidance_scale: torch.Tensor) -> torch.Tensor:
        return self.sampler(prompts, noise=noise, steps=steps, guidance_scale=guidance_scale)


@dataclass
class Job:
    """One request: n images of one condition."""

    condition: Any
    n: int
    seed: int
    steps: int
    guidance_scale: float
    future: asyncio.Future = field(repr=False, default=None)


class Batcher:
    """Collects jobs that arrive together and runs them as one sampling batch in a worker thread."""

    def __init__(self, model: ServedImages, max_images: int, wait_s: float):
        self.model, self.max_images, self.wait_s = model, max_images, wait_s
        self.noun = model.media.noun
        self.pending: deque[Job] = deque()
        self.wake = asyncio.Event()
        self.batches: list[int] = []  # images per batch run, for the log and tests

    async def submit(self, job: Job) -> torch.Tensor:
        job.future = asyncio.get_running_loop().create_future()
        self.pending.append(job)
        self.wake.set()
        return await job.future

    def take(self) -> list[Job]:
        """The oldest job and the waiting ones with its step count, up to max_images images."""
        first = self.pending.popleft()
        batch, images, keep = [first], first.n, deque()
        while self.pending:
            job = self.pending.popleft()
            if job.steps == first.steps and images + job.n <= self.max_images:
                batch.append(job)
                images += job.n
            else:
                keep.append(job)
        self.pending = keep
        return batch

    def run(self, jobs: list[Job]) -> torch.Tensor:
        conditions = [job.condition for job in jobs for _ in range(job.n)]
        noise = torch.cat([self.model.noise(job.n, job.seed) for job in jobs])
        guidance = torch.tensor([job.guidance_scale for job in jobs for _ in range(job.n)])
        return self.model.draw(conditions, noise, jobs[0].steps, guidance)

    async def loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if not self.pending:
                continue
            await asyncio.sleep(self.wait_s)  # requests sent together arrive a few ms apart
            jobs = self.take()
            start = time.perf_counter()
            try:
                images = await asyncio.to_thread(self.run, jobs)
            except Exception as exc:  # the request fails, the server stays up
                for job in jobs:
                    job.future.set_exception(exc)
            else:
                n = images.shape[0]
                self.batches.append(n)
                print(
                    f"kiln: {self.noun} batch: {n} {self.noun} from {len(jobs)} requests, {jobs[0].steps} steps, "
                    f"{time.perf_counter() - start:.2f} s",
                    flush=True,
                )
                for job, part in zip(jobs, images.split([job.n for job in jobs])):
                    if not job.future.cancelled():
                        job.future.set_result(part)
            if self.pending:
                self.wake.set()


class ImagesRequest(BaseModel):
    """The body of POST /v1/images/generations (and /v1/videos/generations): OpenAI's fields this server honours,
    then Kiln's extras."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    user: str | None = None
    seed: int | None = None
    guidance_scale: float | int | None = None
    num_inference_steps: int | None = None


def parse_job(body: dict, name: str, model: ServedImages, max_images: int) -> Job:
    """A validated Job from a request body, or a RequestError naming the problem."""
    try:
        r = ImagesRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        known = ", ".join(ImagesRequest.model_fields)
        hint = f" (fields: {known})" if first["type"] == "extra_forbidden" else ""
        raise RequestError(f"{where}: {first['msg']}{hint}", where) from None
    noun, media = model.media.noun, model.media
    if r.model not in (None, name):
        raise RequestError(f"The model `{r.model}` does not exist; this server serves `{name}`", "model", 404)
    if not 1 <= r.n <= max_images:
        raise RequestError(
            f"n={r.n}: this server makes 1 to {max_images} {noun} per request (serve.max_batch_images)", "n"
        )
    if not r.prompt.strip():
        raise RequestError("prompt is empty", "prompt")
    if len(r.prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"prompt is {len(r.prompt)} characters; at most {MAX_PROMPT_CHARS}", "prompt")
    if r.size not in (None, "auto", model.size):
        raise RequestError(f"size={r.size!r}: this model makes {model.size} {noun} only", "size")
    if r.response_format not in (None, "b64_json"):
        raise RequestError(
            f"response_format={r.response_format!r}: only b64_json (this server keeps no files)", "response_format"
        )
    if r.output_format not in (None, media.output_format):
        raise RequestError(f"output_format={r.output_format!r}: only {media.output_format}", "output_format")
    if r.seed is not None and not 0 <= r.seed < 2**63:
        raise RequestError(f"seed={r.seed} must be in 0..2**63-1", "seed")
    if r.guidance_scale is not None and not 0 <= r.guidance_scale <= 100:
        raise RequestError(f"guidance_scale={r.guidance_scale} must be in [0, 100]", "guidance_scale")
    if r.num_inference_steps is not None and not 1 <= r.num_inference_steps <= MAX_STEPS:
        raise RequestError(
            f"num_inference_steps={r.num_inference_steps} must be in 1..{MAX_STEPS}", "num_inference_steps"
        )
    return Job(
        condition=model.condition(r.prompt),
        n=r.n,
        seed=secrets.randbits(63) if r.seed is None else r.seed,
        steps=r.num_inference_steps or model.sample_steps,
        guidance_scale=float(model.guidance_scale if r.guidance_scale is None else r.guidance_scale),
    )


def create_app(
    model: ServedImages,
    name: str,
    *,
    api_key: str | None = None,
    max_batch_images: int = 16,
    batch_wait_ms: int = 10,
):
    """The FastAPI app serving `model` as model `name`."""
    batcher = Batcher(model, max_batch_images, batch_wait_ms / 1000)
    media = model.media

    async def lifespan(app):
        worker = asyncio.create_task(batcher.loop())
        yield
        worker.cancel()

    app = FastAPI(title=f"Kiln {media.noun}: {name}", lifespan=lifespan)
    app.state.batcher = batcher
    created = int(time.time())

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(status_code=401, content={"error": "Unauthorized"})
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "kiln", **model.card}],
        }

    @app.post(media.route)
    async def generate(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"the body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        try:
            job = parse_job(body, name, model, max_batch_images)
        except RequestError as exc:
            return error(exc.status, str(exc), exc.param)
        try:
            images = await batcher.submit(job)
        except Exception as exc:  # a failure inside the model: the server's fault, one line
            return error(500, f"sampling failed: {type(exc).__name__}: {exc}", kind="server_error")
        # Encoded off the event loop: a clip's MP4 takes a while, and other requests keep arriving meanwhile.
        files = await asyncio.to_thread(lambda: [media.encode(sample) for sample in images])
        data = [{"b64_json": base64.b64encode(file).decode()} for file in files]
        return {
            "created": int(time.time()),
            "data": data,
            "output_format": media.output_format,
            "size": model.size,
            **media.fields,
        }

    return app


def serve(
    model: ServedImages,
    name: str,
    *,
    host: str,
    port: int,
    api_key: str | None,
    max_batch_images: int,
    batch_wait_ms: int,
    log_level: str = "warning",
) -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    import uvicorn

    app = create_app(model, name, api_key=api_key, max_batch_images=max_batch_images, batch_wait_ms=batch_wait_ms)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
