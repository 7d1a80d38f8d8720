"""Backend selection shared by every kernel family.

``auto`` means Triton when the inputs live on a CUDA device and Triton imports, otherwise the chunked
PyTorch path. ``triton`` on a CPU tensor is allowed only under the Triton interpreter
(``TRITON_INTERPRET=1`` set before the first kernel is defined), which is how the test-suite checks
the kernels on machines without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "reference", "torch", "triton")


class BackendUnavailable(RuntimeError):
    """Raised when a requested backend cannot run on this machine or for these inputs."""


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install on an unsupported platform
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable_for(tensor: torch.Tensor) -> bool:
    if not triton_importable():
        return False
    return tensor.is_cuda or (triton_interpreting() and tensor.device.type == "cpu")


def resolve_backend(backend: str, tensor: torch.Tensor, op: str, available=BACKENDS) -> str:
    """Turn ``backend`` into a concrete backend name for ``op`` running on ``tensor``.

    Raises :class:`BackendUnavailable` with a message that says what to do instead.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if "triton" in available and tensor.is_cuda and triton_importable():
            return "triton"
        return "torch" if "torch" in available else "reference"
    if backend not in available:
        raise BackendUnavailable(
            f"{op}: backend {backend!r} is not implemented; available: {', '.join(a for a in available if a != 'auto')}"
        )
    if backend == "triton" and not triton_usable_for(tensor):
        if not triton_importable():
            raise BackendUnavailable(f"{op}: backend 'triton' needs the triton package (pip install triton)")
        raise BackendUnavailable(
            f"{op}: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before import to run "
            f"the kernels on the CPU through the interpreter; use backend='torch' on a CPU"
        )
    return backend
