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
    # FSDP2 (torch 2.13) warns once per rank when a wrapped module returns a view: an in-place op on it would
    # skip the pre-backward all-gather. The LLM's root module (FSDPTransformer, tp x dp) returns its logits as a
    # view (the tensor-parallel output projection's local tensor: DTensor.to_local() is a view); the loss reads them
    # out of place (recipes/llm/loss.py: ce_sum), so the hook runs. Only that module's warning: any other wrapped
    # module's still prints.
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor",
        category=UserWarning,
        module=r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
    )
    # torch.distributed.checkpoint read without a process group (scripts/export.py consolidates a checkpoint of any
    # layout in one process, on purpose): "torch.distributed is disabled, unavailable or uninitialized, assuming
    # the intent is to load in a single process". That is the intent.
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
        r"single process",
        category=UserWarning,
        module=r"torch\.distributed\.checkpoint\.utils",
    )
    # transformers' tokenizers log "Token indices sequence length is longer than the specified maximum sequence
    # length ..." whenever they encode a text longer than model_max_length without truncation. Kiln encodes whole
    # texts on purpose and cuts them itself: the LLM packs documents into rows of data.max_seq_len, and the
    # text-to-image encoders truncate prompts with Kiln's own one-line warning (recipes/t2i/weights.py).
    logging.getLogger("transformers.tokenization_utils_base").addFilter(
        lambda record: not record.getMessage().startswith("Token indices sequence length is longer than the specified")
    )
    # transformers 5 made torchvision the default backend of its image processors and falls back to the PIL one,
    # logging "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`",
    # when torchvision is absent. The training environment has none by design (PyPI's torchvision links the CUDA
    # build of torch, which the +cpu install lacks), and the PIL backend is the processors' own implementation, the
    # one Kiln's image paths and their tests run on. (vLLM's environment, .venv-serve, has torchvision.)
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed); falling back to" not in record.getMessage()
    )
