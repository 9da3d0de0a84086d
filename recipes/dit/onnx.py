"""ONNX / onnxruntime / TensorRT serving of an exported DiT.

    export_onnx(transformer, path, image_size=16, in_channels=1)    # fp32 ONNX, dynamic batch
    export_onnx(..., precision="fp16")                              # fp16 graph for strongly typed TensorRT
    check_parity(transformer, path[, precision="fp16"])             # ORT vs PyTorch, raises ParityError
    sample_images(OnnxDiT(path), ...)                               # the DDIM/CFG sampler, unchanged
    sample_images(TensorRTDiT(engine_path), ..., device=cuda)       # same, on a trtexec-built engine

The ONNX graph is the transformer alone: three inputs, `sample` [B, C, S, S] float32 (pixels, or
VAE latents: a latent model's VAE decode stays in PyTorch), `timestep` [B] float32 (DDPM's integer
steps and flow matching's sigma * T alike: the sinusoidal embedding takes floats) and `class_labels`
[B] int64 (the null class included), and one output `prediction` [B, C_out, S, S] (the model's
noise / v / velocity prediction). Only the batch axis is dynamic; the resolution is fixed.

`precision` ("fp32", "fp16", "bf16") is the dtype the graph computes in: weights, activations and
constants. TensorRT 11 builds strongly typed engines only (its precision flags are gone), so the
precision has to be in the ONNX. The I/O stays fp32 (a Cast at each end) in every precision, so
OnnxDiT, TensorRTDiT and the sampler take the same tensors whichever graph they run.

Parity of a reduced-precision graph is measured against PyTorch in fp32, the model as trained: what
matters is how far the artifact is from the model, and a same-precision PyTorch reference would add
its own rounding path (on CPU, PyTorch fp16 differs from fp32 by more than onnxruntime's fp16 graph,
which runs most ops in fp32 between Casts). PARITY_TOL holds the bounds and why.
onnxruntime's CPU provider has no bf16 kernels (Conv rejects tensor(bfloat16) at load), so a bf16
graph is checked with its types widened to fp32: the same nodes, bf16-rounded weights and
constants, run in fp32. That proves the artifact computes the model; the bf16 rounding of
activations, which only TensorRT performs, is not in the measurement.

Export uses the TorchScript exporter (`dynamo=False`, opset 18): the dynamo exporter produces a
DiTTransformer2DModel graph that runs but is wrong (relative error 0.13 to PyTorch, measured with torch 2.13), so
parity is always checked.
onnxruntime and tensorrt are optional: both are imported inside the functions that need them.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

INPUT_NAMES = ("sample", "timestep", "class_labels")
OUTPUT_NAME = "prediction"
OPSET = 18
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Max relative error (max|ort - torch fp32| / max|torch fp32|) per graph precision. fp32: the
# exporter's own agreement (3e-7 measured on a DiT). fp16: unit roundoff 2^-11 = 4.9e-4; dit_tiny
# measured 6e-4 (random weights, batch 4); the bound, 1e-2 (about 20 ulp), leaves room for deeper
# models (rounding grows with depth) and is still an order of magnitude below the errors a wrong
# graph gives (0.13 for the dynamo exporter's DiT graph). bf16: unit roundoff 2^-8, 8x fp16's;
# the widened check measured 3.3e-3 on dit_tiny (bf16 PyTorch itself: 8e-3); 5e-2 keeps a similar
# number of ulps while staying below a wrong graph's error.
PARITY_TOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 5e-2}


class ParityError(RuntimeError):
    """onnxruntime disagrees with PyTorch beyond the tolerance; `.errors` holds {batch: rel_err}."""

    def __init__(self, message: str, errors: dict[int, float]):
        super().__init__(message)
        self.errors = errors


class _DiTForExport(torch.nn.Module):
    """(sample, timestep, class_labels) -> prediction tensor: the positional signature ONNX needs.
    fp32 in and out; the model inside computes in its own dtype."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.dtype = next(transformer.parameters()).dtype

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        out = self.transformer(sample.to(self.dtype), timestep=timestep, class_labels=class_labels, return_dict=False)[
            0
        ]
        return out.float()


def _eval_in(transformer: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An eval-mode view of the model in `dtype`: the model itself if already in it (mode restored by callers),
    else a copy."""
    if any(p.dtype != dtype for p in transformer.parameters()):
        # nn.Module.to, not diffusers' override: that one warns about fp32-pinned modules (DiT has none).
        transformer = torch.nn.Module.to(copy.deepcopy(transformer), dtype)
    return transformer.eval()


def check_precision(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)} (got {precision!r})")
    return DTYPES[precision]


def _null_class(transformer: torch.nn.Module) -> int:
    return int(transformer.config.num_embeds_ada_norm)


def _random_inputs(
    batch: int,
    *,
    image_size: int,
    in_channels: int,
    null_class: int,
    generator: torch.Generator,
    num_train_timesteps: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random inputs: Gaussian images, random (fractional) timesteps, random labels with the null class in
    them."""
    x = torch.randn(batch, in_channels, image_size, image_size, generator=generator)
    t = torch.rand(batch, generator=generator) * num_train_timesteps
    y = torch.randint(0, null_class + 1, (batch,), generator=generator, dtype=torch.long)
    y[0] = null_class  # the unconditional branch of classifier-free guidance is always exercised
    return x, t, y


def export_onnx(
    transformer: torch.nn.Module, path: str | Path, *, image_size: int, in_channels: int, precision: str = "fp32"
) -> Path:
    """Write `transformer` (a DiTTransformer2DModel) as an ONNX graph computing in `precision`, fp32
    I/O, with a dynamic batch axis."""
    dtype = check_precision(precision)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = transformer.training
    wrapper = _DiTForExport(_eval_in(transformer, dtype))
    # Trace at batch 2 so nothing specialises to a batch of one.
    dummy = _random_inputs(
        2,
        image_size=image_size,
        in_channels=in_channels,
        null_class=_null_class(transformer),
        generator=torch.Generator().manual_seed(0),
    )
    batch_axis = {0: "batch"}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # The tracer warns that the patch grid (height/width) becomes a constant: intended, the
            # resolution is fixed by design; the batch axis stays dynamic (check_parity covers it).
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(
                wrapper,
                dummy,
                str(path),
                dynamo=False,
                opset_version=OPSET,
                input_names=list(INPUT_NAMES),
                output_names=[OUTPUT_NAME],
                dynamic_axes={name: batch_axis for name in (*INPUT_NAMES, OUTPUT_NAME)},
                do_constant_folding=True,
            )
    finally:
        transformer.train(was_training)
    return path


def widen_bf16(onnx_path: str | Path, out_path: str | Path) -> Path:
    """A copy of a bf16 ONNX graph with every bf16 type made fp32 (initializers, Constant values,
    Cast targets), for onnxruntime's CPU provider, which has no bf16 kernels. Weights keep their
    bf16-rounded values. Saved with external data, so a model over protobuf's 2 GB limit works too."""
    import numpy as np
    import onnx
    from onnx import AttributeProto, TensorProto, numpy_helper

    model = onnx.load(str(onnx_path))

    def widen(tensor) -> None:
        if tensor.data_type == TensorProto.BFLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))

    for init in model.graph.initializer:
        widen(init)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == TensorProto.BFLOAT16:
                attr.i = TensorProto.FLOAT
            elif attr.type == AttributeProto.TENSOR:
                widen(attr.t)
    del model.graph.value_info[:]  # shape inference's bf16 annotations; onnxruntime infers them again
    out_path = Path(out_path)
    onnx.save_model(
        model, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True, location=out_path.name + ".data"
    )
    return out_path


def _ort_session(onnx_path: str | Path, providers: list[str] | None = None, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("onnxruntime is not installed: pip install 'kiln[export]' (onnx, onnxruntime)") from exc
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(onnx_path), sess_options=opts, providers=providers or ["CPUExecutionProvider"])


@torch.no_grad()
def check_parity(
    transformer: torch.nn.Module,
    onnx_path: str | Path,
    batch_sizes=(1, 4),
    tol: float | None = 1e-5,
    seed: int = 1234,
    precision: str = "fp32",
) -> dict[int, float]:
    """Max relative error of onnxruntime (CPU) vs eager fp32 PyTorch per batch size, on fresh random inputs.

    The error is max|ort - torch| / max|torch| over the whole output. Raises ParityError if any
    batch size exceeds `tol` (pass tol=None to only measure; PARITY_TOL[precision] is the bound
    export_dit.py uses). `precision` is the graph's (export_onnx's): a bf16 graph runs widened to fp32.
    """
    check_precision(precision)
    cfg = transformer.config
    was_training, original = transformer.training, transformer
    transformer = _eval_in(transformer, torch.float32)
    try:
        if precision != "bf16":
            return _parity(transformer, cfg, onnx_path, batch_sizes, tol, seed)
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kiln-onnx-") as tmp:
            widened = widen_bf16(onnx_path, Path(tmp) / "widened.onnx")
            return _parity(transformer, cfg, widened, batch_sizes, tol, seed)
    finally:
        original.train(was_training)


def _parity(transformer, cfg, onnx_path, batch_sizes, tol, seed) -> dict[int, float]:
    session = _ort_session(onnx_path)
    gen = torch.Generator().manual_seed(seed)
    errors: dict[int, float] = {}
    for batch in batch_sizes:
        x, t, y = _random_inputs(
            batch,
            image_size=cfg.sample_size,
            in_channels=cfg.in_channels,
            null_class=_null_class(transformer),
            generator=gen,
        )
        dev = next(transformer.parameters()).device
        ref = transformer(x.to(dev), timestep=t.to(dev), class_labels=y.to(dev)).sample.cpu()
        (got,) = session.run([OUTPUT_NAME], {"sample": x.numpy(), "timestep": t.numpy(), "class_labels": y.numpy()})
        got = torch.from_numpy(got)
        if got.shape != ref.shape:
            raise ParityError(
                f"onnxruntime output shape {tuple(got.shape)} != PyTorch {tuple(ref.shape)} at batch {batch}", errors
            )
        errors[int(batch)] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    bad = {b: e for b, e in errors.items() if tol is not None and not e <= tol}
    if bad:
        detail = ", ".join(f"batch {b}: {e:.3g}" for b, e in bad.items())
        raise ParityError(f"onnxruntime vs PyTorch relative error above {tol:g} ({detail})", errors)
    return errors


class OnnxDiT:
    """onnxruntime in the diffusers call signature: `model(x, timestep=t, class_labels=y).sample`.

    Takes and returns torch tensors (on the CPU; outputs are moved to the input's device), so
    common.diffusion.sampling.sample_images runs on it unchanged.
    """

    def __init__(self, onnx_path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        self.path = Path(onnx_path)
        self.session = _ort_session(self.path, providers, threads)

    def eval(self) -> OnnxDiT:
        return self

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor | int, class_labels: torch.Tensor, return_dict: bool = True
    ):
        device = sample.device
        t = torch.as_tensor(timestep, dtype=torch.float32)
        if t.ndim == 0:
            t = t.expand(sample.shape[0])
        feeds = {
            "sample": sample.detach().float().cpu().contiguous().numpy(),
            "timestep": t.cpu().contiguous().numpy(),
            "class_labels": class_labels.detach().long().cpu().contiguous().numpy(),
        }
        (out,) = self.session.run([OUTPUT_NAME], feeds)
        out = torch.from_numpy(np.ascontiguousarray(out)).to(device)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


class TensorRTDiT:
    """A TensorRT engine (built by scripts/build_trt_engine.sh) in the diffusers call signature.

    Needs a CUDA GPU and the `tensorrt` package (the name-based tensor API of TensorRT 10 and 11). Batches larger
    than the engine's optimisation profile allows are split into chunks. Returns CUDA tensors.
    """

    def __init__(self, engine_path: str | Path, device: str | torch.device = "cuda"):
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise ImportError(
                "TensorRTDiT needs the `tensorrt` Python package (pip install 'kiln[tensorrt]' on a CUDA machine); "
                "use OnnxDiT (onnxruntime) on CPU"
            ) from exc
        if not torch.cuda.is_available():
            raise RuntimeError("TensorRTDiT needs a CUDA GPU; none is visible to PyTorch")
        self.trt = trt
        self.path = Path(engine_path)
        if not self.path.exists():
            raise FileNotFoundError(f"no TensorRT engine at {self.path} (build it with scripts/build_trt_engine.sh)")
        self.device = torch.device(device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {self.path} (built by another TensorRT version/GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        missing = set(INPUT_NAMES) - set(names)
        if missing or OUTPUT_NAME not in names:
            raise RuntimeError(f"{self.path} is not a Kiln DiT engine: I/O tensors are {names}")
        _, _, max_shape = self.engine.get_tensor_profile_shape("sample", 0)
        self.max_batch = int(max_shape[0])
        self._dtypes = {n: self._torch_dtype(self.engine.get_tensor_dtype(n)) for n in names}
        self.stream = torch.cuda.Stream(device=self.device)

    def _torch_dtype(self, dt) -> torch.dtype:
        trt = self.trt
        table = {
            trt.float32: torch.float32,
            trt.float16: torch.float16,
            trt.int32: torch.int32,
            trt.int8: torch.int8,
            trt.bool: torch.bool,
        }
        for name, torch_dt in (("int64", torch.int64), ("bf16", torch.bfloat16)):
            if hasattr(trt, name):
                table[getattr(trt, name)] = torch_dt
        return table[dt]

    def eval(self) -> TensorRTDiT:
        return self

    def _run(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feeds = {"sample": x, "timestep": t, "class_labels": y}
        bufs = {}
        for name, value in feeds.items():
            buf = value.to(self.device, self._dtypes[name]).contiguous()
            bufs[name] = buf
            self.context.set_input_shape(name, tuple(buf.shape))
            self.context.set_tensor_address(name, buf.data_ptr())
        out = torch.empty(
            tuple(self.context.get_tensor_shape(OUTPUT_NAME)), dtype=self._dtypes[OUTPUT_NAME], device=self.device
        )
        self.context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out.float()

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor | int, class_labels: torch.Tensor, return_dict: bool = True
    ):
        t = torch.as_tensor(timestep, dtype=torch.float32)
        if t.ndim == 0:
            t = t.expand(sample.shape[0])
        chunks = [
            self._run(xs, ts, ys)
            for xs, ts, ys in zip(
                sample.split(self.max_batch), t.split(self.max_batch), class_labels.split(self.max_batch)
            )
        ]
        out = torch.cat(chunks)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


BACKENDS = ("torch", "onnxruntime", "tensorrt")


def load_backend(
    name: str,
    export: Path,
    *,
    onnx_path: str | Path | None = None,
    engine_path: str | Path | None = None,
    threads: int | None = None,
    device: str | None = None,
) -> tuple[object, torch.device]:
    """(model, device) of an export on one backend, in the diffusers call signature sample_images uses:
    PyTorch (transformer/), onnxruntime (onnx/model.onnx) or TensorRT (onnx/model.plan), the last two
    written by scripts/export_dit.py."""
    if name == "torch":
        from diffusers import DiTTransformer2DModel

        dev = torch.device(device or "cpu")
        return DiTTransformer2DModel.from_pretrained(export / "transformer").eval().to(dev), dev
    if name == "onnxruntime":
        path = Path(onnx_path or export / "onnx" / "model.onnx")
        if not path.exists():
            raise FileNotFoundError(f"no ONNX file at {path}: run scripts/export_dit.py {export} first")
        return OnnxDiT(path, threads=threads), torch.device("cpu")
    if name == "tensorrt":
        dev = torch.device(device or "cuda")
        return TensorRTDiT(Path(engine_path or export / "onnx" / "model.plan"), device=dev), dev
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {name!r})")


class ExportSampler:
    """A DiT export on one backend with everything sampling it needs: kiln.json's classes, null class,
    steps and guidance, the scheduler/ config, the model's geometry and (latent models) the vae/ decoder.

        sampler = ExportSampler(export, "onnxruntime")
        images = sampler(labels, generator=torch.Generator().manual_seed(0))   # [-1, 1], [N, C, S, S]

    `model`, where given, is the denoiser instead of the backend's (same call signature, on the CPU): Triton's BLS
    model calls its denoiser model through it (recipes/dit/triton.py).
    """

    def __init__(self, export: str | Path, backend: str = "torch", model=None, **backend_kwargs):
        import json

        from common.diffusion.vae import folder_decoder

        self.export = Path(export)
        self.backend = backend
        self.info = json.loads((self.export / "kiln.json").read_text())
        self.scheduler_config = json.loads((self.export / "scheduler" / "scheduler_config.json").read_text())
        transformer = json.loads((self.export / "transformer" / "config.json").read_text())
        self.sample_size, self.in_channels = transformer["sample_size"], transformer["in_channels"]
        self.image_size = int(self.info["image_size"])
        self.classes = [str(c) for c in self.info.get("classes") or range(self.info["num_classes"])]
        # `model`: a denoiser in the same call signature, given (Triton's BLS model: recipes/dit/triton.py)
        self.model, self.device = (
            (model, torch.device("cpu")) if model is not None else load_backend(backend, self.export, **backend_kwargs)
        )
        self.decode = (
            folder_decoder(self.export / "vae", self.image_size, self.device)
            if (self.export / "vae").is_dir()
            else None
        )

    def __call__(
        self,
        labels: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        steps: int | None = None,
        guidance_scale: float | torch.Tensor | None = None,
        batch_size: int = 512,
    ) -> torch.Tensor:
        """Images in [-1, 1] for `labels`; steps and guidance default to the export's (kiln.json)."""
        from common.diffusion.sampling import sample_images

        if self.backend == "tensorrt":  # keep CFG's doubled batch inside the engine's profile (TensorRTDiT also splits)
            batch_size = min(batch_size, max(1, self.model.max_batch // 2))
        return sample_images(
            self.model,
            self.scheduler_config,
            labels,
            null_class=self.info["null_class"],
            image_size=self.sample_size,
            in_channels=self.in_channels,
            steps=steps or int(self.info["sample_steps"]),
            guidance_scale=self.info["guidance_scale"] if guidance_scale is None else guidance_scale,
            generator=generator,
            noise=noise,
            device=self.device,
            decode=self.decode,
            batch_size=batch_size,
        )

    def noise(self, n: int, seed: int) -> torch.Tensor:
        """The starting noise sample_images draws for a chunk of n labels from a generator seeded with `seed`."""
        return torch.randn(
            (n, self.in_channels, self.sample_size, self.sample_size), generator=torch.Generator().manual_seed(seed)
        )
