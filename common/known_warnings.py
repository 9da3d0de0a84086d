"""The warnings Kiln knows to be harmless, silenced once, here, by every entrypoint; all others stay visible.

Each entry says where it comes from and why it is harmless. Filters match the exact message, so a
different warning from the same library still prints.
"""

from __future__ import annotations

import logging
import os
import warnings


def silence_known_warnings() -> None:
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed probes for accelerators when imported and, finding none, logs "Setting accelerator
        # to CPU ..." from every process. CPU is what this machine has: name it instead of probing.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # torchao (the fp8 extra; diffusers imports it whenever it is installed) tries to load its CUDA
        # kernel libraries and logs "Failed to load ..._C_*.so" for each one a CPU-only machine cannot
        # load. Nothing on CPU uses them; on a GPU the same failure stays visible.
        logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
    # diffusers (0.3x) imports a few torchao tensor classes to allow-list them for torch.load of torchao-
    # quantized checkpoints; torchao >= 0.16 moved some, and diffusers logs "Unable to import `torchao`
    # Tensor objects" at import. Kiln never loads torchao-serialized diffusers weights (fp8 training
    # converts in memory), so nothing is affected.
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
        lambda record: not record.getMessage().startswith("Unable to import `torchao` Tensor objects")
    )
    # torchao registers its config enums as pytree constants when imported; torch 2.13 handles Enum
    # subclasses natively and warns once per enum that register_constant() on them is deprecated.
    # torchao's registration, not Kiln's, and the same enums work either way.
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()
    )
    # torch 2.13 deprecates these collectives in favour of all_gather_single / reduce_scatter_single;
    # DeepSpeed ZeRO-3 calls them several times a step (thousands of lines a run). Same collective,
    # different name: nothing for a user to act on.
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    )
    # DTensor: "While redistributing from ... sequential ... operations will be performed. This is
    # suboptimal" -- under TP/PP the LLM's ("pp", "dp", "tp") mesh moves a tensor over two mesh
    # dimensions in two collectives rather than one over a flattened mesh. A performance hint about
    # torch's internal plan, not a correctness problem; profile traces show the collectives anyway.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: "This is suboptimal" not in record.getMessage()
    )
