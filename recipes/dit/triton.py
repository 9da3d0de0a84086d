"""A DiT export as a Triton Inference Server model repository (scripts/serve.py serve.engine=triton).

    write_repository(export, repo, name="dit_tiny", sys_path=[...], max_batch=16, wait_us=10000)

writes two models, both in Triton's Python backend on CPU:

    <name>/            the sampler (a BLS model): inputs class_label, seed (INT64 [1]) and the optional steps (INT32
                       [1]) and guidance_scale (FP32 [1]); output image (FP32 [C, S, S] in [-1, 1], a latent model's
                       decoded by its vae/ here). `dynamic_batching`: requests that arrive within wait_us of each other
                       share one sampling loop of up to max_batch images. The loop is Kiln's own sampler
                       (recipes/dit/onnx.py ExportSampler -> common/diffusion/sampling.py), whose model call is a
                       BLS request to the denoiser, so a request's image is the one `scripts/sample_dit.py
                       classes=<class> per_class=1 seed=<seed>` draws on onnxruntime.
    <name>_denoiser/   the ONNX graph (onnx/model.onnx from scripts/export_dit.py) on ONNX Runtime: sample [C, S, S],
                       timestep [1], class_labels [1] -> prediction, batched (twice max_batch rows: CFG's pair).
                       configs/gpu.pbtxt is its GPU variant (Triton's onnxruntime backend with the TensorRT accelerator,
                       tritonserver --model-config-name=gpu): written, not run here (no GPU, and PyTriton's bundle has
                       the Python backend only).

Each 1/model.py is a shim the repository writer fills in: it puts the Kiln checkout and its environment's
site-packages on sys.path (the backend's stub does not see a virtualenv) and imports SamplerModel or DenoiserModel
below. A bad request (a class out of range, a negative seed, steps out of range) gets Triton's 400 (INVALID_ARG).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

SAMPLER_INPUTS = (("class_label", "TYPE_INT64", False), ("seed", "TYPE_INT64", False))
OPTIONAL_INPUTS = (("steps", "TYPE_INT32", True), ("guidance_scale", "TYPE_FP32", True))
MAX_STEPS = 1000  # a DDPM's training steps: the most a schedule can take

SHIM = '''"""Triton's Python backend entry: Kiln's {cls} (recipes/dit/triton.py), written by scripts/serve.py."""

import sys

sys.path[:0] = [p for p in {paths!r} if p not in sys.path]

from recipes.dit.triton import {cls} as TritonPythonModel  # noqa: E402,F401
'''


def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False) -> str:
    extra = ", optional: true" if optional else ""
    return f'  {{ name: "{name}", data_type: {dtype}, dims: {dims}{extra} }}'


def _config(name: str, max_batch: int, inputs: list[str], outputs: list[str], tail: str) -> str:
    return "\n".join(
        [
            f'name: "{name}"',
            f"max_batch_size: {max_batch}",
            "input [",
            ",\n".join(inputs),
            "]",
            "output [",
            ",\n".join(outputs),
            "]",
            tail,
        ]
    )


def geometry(export: Path) -> tuple[int, int, int, int]:
    """(the transformer's input and output channels, its sample size, the image's channels) of a DiT export."""
    transformer = json.loads((export / "transformer" / "config.json").read_text())
    out_channels = int(transformer.get("out_channels") or transformer["in_channels"])
    image_channels = int(transformer["in_channels"])
    if (export / "vae" / "config.json").exists():  # a latent model: its images are the VAE's
        image_channels = int(json.loads((export / "vae" / "config.json").read_text()).get("out_channels", 3))
    return int(transformer["in_channels"]), out_channels, int(transformer["sample_size"]), image_channels


def write_repository(
    export: Path, repo: Path, *, name: str, sys_path: list[str], max_batch: int, wait_us: int
) -> list[str]:
    """The model repository for `export` in `repo` (rewritten whole); returns the model names, the sampler first."""
    export, repo = Path(export).resolve(), Path(repo)
    onnx = export / "onnx" / "model.onnx"
    info = json.loads((export / "kiln.json").read_text())
    channels, out_channels, size, image_channels = geometry(export)
    image = int(info["image_size"])
    denoiser = f"{name}_denoiser"
    batching = f"dynamic_batching {{ max_queue_delay_microseconds: {wait_us} }}"
    cpu = 'backend: "python"\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
    params = {"export": str(export), "denoiser": denoiser, "max_batch": str(max_batch)}
    parameters = "".join(f'parameters {{ key: "{k}", value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())
    sampler_cfg = _config(
        name,
        max_batch,
        [_tensor(n, t, [1], o) for n, t, o in (*SAMPLER_INPUTS, *OPTIONAL_INPUTS)],
        [_tensor("image", "TYPE_FP32", [image_channels, image, image])],
        cpu + batching + "\n" + parameters,
    )
    denoiser_io = (
        [
            _tensor("sample", "TYPE_FP32", [channels, size, size]),
            _tensor("timestep", "TYPE_FP32", [1]),
            _tensor("class_labels", "TYPE_INT64", [1]),
        ],
        [_tensor("prediction", "TYPE_FP32", [out_channels, size, size])],
    )
    denoiser_cfg = _config(denoiser, 2 * max_batch, *denoiser_io, cpu + batching + "\n" + parameters)
    # The GPU variant: ONNX Runtime's backend reads 1/model.onnx; timestep and class_labels are [B] in the graph.
    gpu_io = [line.replace("dims: [1] }", "dims: [1], reshape: { shape: [] } }") for line in denoiser_io[0]]
    gpu_cfg = _config(
        denoiser,
        2 * max_batch,
        gpu_io,
        denoiser_io[1],
        'backend: "onnxruntime"\ninstance_group [{ kind: KIND_GPU, count: 1 }]\n'
        + batching
        + '\noptimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" } ] } }\n',
    )
    shutil.rmtree(repo, ignore_errors=True)  # Triton loads every model it finds: none left from another name
    for model, config, cls in ((name, sampler_cfg, "SamplerModel"), (denoiser, denoiser_cfg, "DenoiserModel")):
        (repo / model / "1").mkdir(parents=True, exist_ok=True)
        (repo / model / "config.pbtxt").write_text(config)
        (repo / model / "1" / "model.py").write_text(SHIM.format(cls=cls, paths=list(sys_path)))
    (repo / denoiser / "configs").mkdir(exist_ok=True)
    (repo / denoiser / "configs" / "gpu.pbtxt").write_text(gpu_cfg)
    (repo / denoiser / "1" / "model.onnx").symlink_to(onnx)
    return [name, denoiser]


def _to_backend(pb, name: str, tensor):
    """A backend tensor of a torch tensor, through DLPack: the backend's utilities are built against NumPy 1 and read
    a NumPy 2 array (Kiln's environment) as 0 bytes."""
    from torch.utils.dlpack import to_dlpack

    return pb.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


def _torch(tensor):
    """A backend tensor (a request's input, a BLS response's output) as a torch tensor of its own (DLPack), or None."""
    import torch

    return None if tensor is None else torch.from_dlpack(tensor.to_dlpack()).clone()


def _parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


class DenoiserModel:
    """The ONNX graph on ONNX Runtime (CPU): every request of a batch in one run."""

    def initialize(self, args: dict) -> None:
        import onnxruntime as ort
        import triton_python_backend_utils as pb

        self.pb = pb
        export = Path(_parameters(args)["export"])
        self.session = ort.InferenceSession(str(export / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])

    def execute(self, requests: list) -> list:
        import torch

        pb = self.pb
        feeds = {
            name: [_torch(pb.get_input_tensor_by_name(r, name)) for r in requests]
            for name in ("sample", "timestep", "class_labels")
        }
        rows = [len(x) for x in feeds["sample"]]
        inputs = {name: torch.cat(parts).numpy() for name, parts in feeds.items()}
        inputs["timestep"], inputs["class_labels"] = inputs["timestep"].reshape(-1), inputs["class_labels"].reshape(-1)
        (out,) = self.session.run(["prediction"], inputs)
        parts = torch.from_numpy(np.ascontiguousarray(out)).split(rows)
        return [pb.InferenceResponse([_to_backend(pb, "prediction", p)]) for p in parts]


class BLSDenoiser:
    """The denoiser model through BLS, in the diffusers call signature Kiln's sampler calls: model(x, timestep=t,
    class_labels=y).sample."""

    def __init__(self, pb, model: str):
        self.pb, self.name = pb, model

    def eval(self) -> BLSDenoiser:
        return self

    def __call__(self, sample, timestep, class_labels, return_dict: bool = True):
        import torch
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        pb = self.pb
        rows = sample.shape[0]
        t = torch.as_tensor(timestep, dtype=torch.float32).expand(rows)
        inputs = [
            _to_backend(pb, "sample", sample.float()),
            _to_backend(pb, "timestep", t.reshape(rows, 1).clone()),
            _to_backend(pb, "class_labels", class_labels.long().reshape(rows, 1).clone()),
        ]
        request = pb.InferenceRequest(model_name=self.name, inputs=inputs, requested_output_names=["prediction"])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"{self.name}: {response.error().message()}")
        out = _torch(pb.get_output_tensor_by_name(response, "prediction"))
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


class BadRequest(ValueError):
    """A request this model refuses: Triton's 400."""


class SamplerModel:
    """Kiln's DiT sampler (ExportSampler) over the denoiser model: each batch of requests in one sampling loop per
    step count, each request's noise drawn from its own seed as the images server draws it."""

    def initialize(self, args: dict) -> None:
        import torch
        import triton_python_backend_utils as pb

        from recipes.dit.onnx import ExportSampler

        torch.set_num_threads(1)  # the scheduler's arithmetic; the denoiser's process runs the model
        self.pb = pb
        params = _parameters(args)
        self.max_batch = int(params["max_batch"])
        self.sampler = ExportSampler(params["export"], "triton", model=BLSDenoiser(pb, params["denoiser"]))
        self.classes = len(self.sampler.classes)

    def read(self, request) -> tuple:
        """(labels, seeds, steps, guidance scales) of one request (torch tensors, steps an int), or BadRequest."""
        import torch

        def get(name: str, default=None):
            tensor = _torch(self.pb.get_input_tensor_by_name(request, name))
            return default if tensor is None else tensor.reshape(-1)

        labels, seeds = get("class_label"), get("seed")
        rows = len(labels)
        if len(seeds) != rows:
            raise BadRequest(f"{rows} class_label rows and {len(seeds)} seed rows: one seed per image")
        steps = get("steps", torch.tensor([int(self.sampler.info["sample_steps"])]))
        scales = get("guidance_scale", torch.full((rows,), float(self.sampler.info["guidance_scale"])))
        if ((labels < 0) | (labels >= self.classes)).any():
            raise BadRequest(f"class_label {labels.tolist()}: the classes are 0..{self.classes - 1}")
        if (seeds < 0).any():
            raise BadRequest(f"seed {seeds.tolist()}: seeds are 0..2**63-1")
        if len(set(steps.tolist())) != 1 or not 1 <= int(steps[0]) <= MAX_STEPS:
            raise BadRequest(f"steps {steps.tolist()}: one step count per request, 1..{MAX_STEPS}")
        if not torch.isfinite(scales).all():
            raise BadRequest(f"guidance_scale {scales.tolist()}: must be finite")
        return labels, seeds, int(steps[0]), scales

    def execute(self, requests: list) -> list:
        pb = self.pb
        responses: list = [None] * len(requests)
        groups: dict[int, list] = {}
        for i, request in enumerate(requests):
            try:
                labels, seeds, steps, scales = self.read(request)
            except BadRequest as exc:
                responses[i] = pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG))
                continue
            groups.setdefault(steps, []).append((i, labels, seeds, scales))
        for steps, jobs in groups.items():
            try:
                images = self.draw(jobs, steps)
            except Exception as exc:  # noqa: BLE001 -- these requests fail (500), the others and the server go on
                for i, *_ in jobs:
                    responses[i] = pb.InferenceResponse(error=pb.TritonError(f"sampling failed: {exc}"))
                continue
            for (i, *_), part in zip(jobs, images.split([len(j[1]) for j in jobs])):
                responses[i] = pb.InferenceResponse([_to_backend(pb, "image", part)])
        return responses

    def draw(self, jobs: list, steps: int):
        """Images of a group of requests with one step count: one sampling loop, each row's noise from its seed."""
        import torch

        labels = torch.cat([j[1] for j in jobs]).long()
        noise = torch.cat([self.sampler.noise(1, int(s)) for j in jobs for s in j[2].tolist()])
        scales = torch.cat([j[3] for j in jobs]).float()
        return self.sampler(labels, noise=noise, steps=steps, guidance_scale=scales, batch_size=self.max_batch)
