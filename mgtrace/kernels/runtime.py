"""Choosing how Triton runs: compiled on a GPU, or interpreted on the CPU.

Triton decides at import time of a kernel module whether its kernels are interpreted
(``TRITON_INTERPRET=1``), so the choice has to be made before
``mgtrace.kernels.triton_align`` (or vLLM's kernel module) is imported, and cannot change
afterwards within one process.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from mgtrace.errors import UsageError

DEVICES = ("cpu", "cuda")
KERNEL_MODULE = "mgtrace.kernels.triton_align"


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def load_triton_kernels(device: str) -> ModuleType:
    """Import the Triton kernel module set up for ``device`` (interpreted on ``cpu``)."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; expected cpu or cuda")
    if device == "cuda" and not cuda_available():
        raise UsageError("--device cuda needs a CUDA GPU, and torch sees none here")
    return _load_for(KERNEL_MODULE, "align_postprocess_kernel", interpreted=device == "cpu")


def _load_for(module: str, kernel: str, *, interpreted: bool) -> ModuleType:
    """Import ``module`` with its kernels interpreted or compiled, re-importing if needed."""
    if interpreted:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("TRITON_INTERPRET=1 is set here, so Triton cannot compile for cuda")
    loaded = sys.modules.get(module)
    if loaded is None:
        loaded = importlib.import_module(module)
    elif is_interpreted(getattr(loaded, kernel)) != interpreted:
        if not interpreted:
            raise UsageError(
                "the Triton kernels were loaded interpreted in this process; compiling them "
                "for cuda needs a fresh process"
            )
        # Triton picks interpretation when a kernel is defined: define the kernels again.
        loaded = importlib.reload(loaded)
    if is_interpreted(getattr(loaded, kernel)) != interpreted:
        raise UsageError(f"cannot load {module} for the requested device")
    return loaded


def is_interpreted(kernel: object) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def load_vllm_module(module: str, kernel: str, device: str) -> ModuleType:
    """Import one of vLLM's kernel modules for ``device`` (interpreted on ``cpu``)."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; expected cpu or cuda")
    if device == "cpu" and not cuda_available():
        # With no GPU in sight vLLM would swap triton for a placeholder; hide CUDA entirely.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    return _load_for(module, kernel, interpreted=device == "cpu")
