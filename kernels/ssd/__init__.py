"""Mamba-2 SSD: ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t``.

Backends: ``reference`` (token recurrence), ``torch`` (chunked, the CPU default), ``triton``
(chunked Triton kernels, when present). ``ssd_step`` is the one-token decode.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .chunked import ssd_chunked, ssd_step
from .reference import ssd_reference

__all__ = ["ssd", "ssd_chunked", "ssd_reference", "ssd_step"]


def _available():
    import importlib.util
    has_triton = importlib.util.find_spec(f"{__name__}.triton") is not None
    return ("reference", "torch", "triton") if has_triton else ("reference", "torch")


def ssd(x, dt, A, B, C, chunk_size: int = 64, initial_state=None, backend: str = "auto"):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``."""
    chosen = resolve_backend(backend, x, op="ssd", available=_available())
    if chosen == "reference":
        return ssd_reference(x, dt, A, B, C, initial_state=initial_state)
    if chosen == "triton":
        from .triton import ssd_triton
        return ssd_triton(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
