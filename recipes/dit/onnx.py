"""ONNX / onnxruntime / TensorRT serving of an exported DiT.

    export_onnx(transformer, path, image_size=16, in_channels=1)    # fp32 ONNX, dynamic batch
    check_parity(transformer, path)                                 # ORT vs PyTorch, raises ParityError
    sample_images(OnnxDiT(path), ...)                               # the DDIM/CFG sampler, unchanged
    sample_images(TensorRTDiT(engine_path), ..., device=cuda)       # same, on a trtexec-built engine

The ONNX graph is the transformer alone: three inputs, `sample` [B, C, S, S] float32 (pixels, or
VAE latents: a latent model's VAE decode stays in PyTorch), `timestep` [B] float32 (DDPM's integer
steps and flow matching's sigma * T alike: the sinusoidal embedding takes floats) and `class_labels`
[B] int64 (the null class included), and one output `prediction` [B, C_out, S, S] (the model's
noise / v / velocity prediction). Only the batch axis is dynamic; the resolution is fixed.

Export uses the TorchScript exporter (`dynamo=False`, opset 18): the dynamo exporter produces a
DiTTransformer2DModel graph that runs but is wrong (see PITFALLS.md), so parity is always checked.
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


class ParityError(RuntimeError):
    """onnxruntime disagrees with PyTorch beyond the tolerance; `.errors` holds {batch: rel_err}."""

    def __init__(self, message: str, errors: dict[int, float]):
        super().__init__(message)
        self.errors = errors


class _DiTForExport(torch.nn.Module):
    """(sample, timestep, class_labels) -> prediction tensor: the positional signature ONNX needs."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        return self.transformer(sample, timestep=timestep, class_labels=class_labels, return_dict=False)[0]


def _fp32_eval(transformer: torch.nn.Module) -> torch.nn.Module:
    """An eval-mode fp32 view of the model: the model itself if already fp32 (mode restored by callers), else a copy."""
    if any(p.dtype != torch.float32 for p in transformer.parameters()):
        transformer = copy.deepcopy(transformer).float()
    return transformer.eval()


def _null_class(transformer: torch.nn.Module) -> int:
    return int(transformer.config.num_embeds_ada_norm)


def _random_inputs(batch: int, *, image_size: int, in_channels: int, null_class: int, generator: torch.Generator,
                   num_train_timesteps: int = 1000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random inputs: Gaussian images, random (fractional) timesteps, random labels with the null class in them."""
    x = torch.randn(batch, in_channels, image_size, image_size, generator=generator)
    t = torch.rand(batch, generator=generator) * num_train_timesteps
    y = torch.randint(0, null_class + 1, (batch,), generator=generator, dtype=torch.long)
    y[0] = null_class  # the unconditional branch of classifier-free guidance is always exercised
    return x, t, y


def export_onnx(transformer: torch.nn.Module, path: str | Path, *, image_size: int, in_channels: int) -> Path:
    """Write `transformer` (a DiTTransformer2DModel) as an fp32 ONNX graph with a dynamic batch axis."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = transformer.training
    wrapper = _DiTForExport(_fp32_eval(transformer))
    # Trace at batch 2 so nothing specialises to a batch of one.
    dummy = _random_inputs(2, image_size=image_size, in_channels=in_channels, null_class=_null_class(transformer),
                           generator=torch.Generator().manual_seed(0))
    batch_axis = {0: "batch"}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # The tracer warns that the patch grid (height/width) becomes a constant: intended, the
            # resolution is fixed by design; the batch axis stays dynamic (check_parity covers it).
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(
                wrapper, dummy, str(path), dynamo=False, opset_version=OPSET,
                input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                dynamic_axes={name: batch_axis for name in (*INPUT_NAMES, OUTPUT_NAME)},
                do_constant_folding=True,
            )
    finally:
        transformer.train(was_training)
    return path


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
def check_parity(transformer: torch.nn.Module, onnx_path: str | Path, batch_sizes=(1, 4), tol: float | None = 1e-5,
                 seed: int = 1234) -> dict[int, float]:
    """Max relative error of onnxruntime (CPU) vs eager PyTorch per batch size, on fresh random inputs.

    The error is max|ort - torch| / max|torch| over the whole output. Raises ParityError if any
    batch size exceeds `tol` (pass tol=None to only measure).
    """
    cfg = transformer.config
    was_training, original = transformer.training, transformer
    transformer = _fp32_eval(transformer)
    try:
        return _parity(transformer, cfg, onnx_path, batch_sizes, tol, seed)
    finally:
        original.train(was_training)


def _parity(transformer, cfg, onnx_path, batch_sizes, tol, seed) -> dict[int, float]:
    session = _ort_session(onnx_path)
    gen = torch.Generator().manual_seed(seed)
    errors: dict[int, float] = {}
    for batch in batch_sizes:
        x, t, y = _random_inputs(batch, image_size=cfg.sample_size, in_channels=cfg.in_channels,
                                 null_class=_null_class(transformer), generator=gen)
        dev = next(transformer.parameters()).device
        ref = transformer(x.to(dev), timestep=t.to(dev), class_labels=y.to(dev)).sample.cpu()
        (got,) = session.run([OUTPUT_NAME], {"sample": x.numpy(), "timestep": t.numpy(), "class_labels": y.numpy()})
        got = torch.from_numpy(got)
        if got.shape != ref.shape:
            raise ParityError(f"onnxruntime output shape {tuple(got.shape)} != PyTorch {tuple(ref.shape)} at batch {batch}",
                              errors)
        errors[int(batch)] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    bad = {b: e for b, e in errors.items() if tol is not None and not e <= tol}
    if bad:
        detail = ", ".join(f"batch {b}: {e:.3g}" for b, e in bad.items())
        raise ParityError(f"onnxruntime vs PyTorch relative error above {tol:g} ({detail})", errors)
    return errors


class OnnxDiT:
    """onnxruntime in the diffusers call signature: `model(x, timestep=t, class_labels=y).sample`.

    Takes and returns torch tensors (on the CPU; outputs are moved to the input's device), so
    recipes.dit.sampling.sample_images runs on it unchanged.
    """

    def __init__(self, onnx_path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        self.path = Path(onnx_path)
        self.session = _ort_session(self.path, providers, threads)

    def eval(self) -> OnnxDiT:
        return self

    def __call__(self, sample: torch.Tensor, timestep: torch.Tensor | int, class_labels: torch.Tensor,
                 return_dict: bool = True):
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

    Needs a CUDA GPU and the `tensorrt` package (TensorRT 10 tensor API). Batches larger than the
    engine's optimisation profile allows are split into chunks. Returns CUDA tensors.
    """

    def __init__(self, engine_path: str | Path, device: str | torch.device = "cuda"):
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise ImportError(
                "TensorRTDiT needs the `tensorrt` Python package (pip install 'kiln[gpu]' on a CUDA machine); "
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
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.int8: torch.int8,
                 trt.bool: torch.bool}
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
        out = torch.empty(tuple(self.context.get_tensor_shape(OUTPUT_NAME)), dtype=self._dtypes[OUTPUT_NAME],
                          device=self.device)
        self.context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out.float()

    def __call__(self, sample: torch.Tensor, timestep: torch.Tensor | int, class_labels: torch.Tensor,
                 return_dict: bool = True):
        t = torch.as_tensor(timestep, dtype=torch.float32)
        if t.ndim == 0:
            t = t.expand(sample.shape[0])
        chunks = [self._run(xs, ts, ys) for xs, ts, ys in
                  zip(sample.split(self.max_batch), t.split(self.max_batch), class_labels.split(self.max_batch))]
        out = torch.cat(chunks)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
