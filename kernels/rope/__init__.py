"""Rotary position embeddings (RoPE) of the attention layer's queries and keys.

Backends: ``reference`` (the PyTorch formula, :mod:`.reference`) and ``triton`` (one kernel forward and one
backward, :mod:`.triton`), the GPU path. The CPU path is :class:`mixers.attention.Attention`'s own use of
:func:`rope_reference`, chosen by :func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import rope_reference, rotary_reference

__all__ = ["BACKENDS", "rotary", "rotary_reference", "rope_reference"]

#: the backends this family implements
BACKENDS = ("reference", "triton")


def rotary(x, start: int = 0, base: float = 10000.0, rotated: int | None = None, backend: str = "auto"):
    """``x (B, T, G, D)``, positions ``start .. start + T - 1``: the first ``rotated`` groups (all by default)
    rotated by RoPE, the others copied, into a new contiguous tensor in ``x``'s dtype.

    A fused ``q | k | v`` projection viewed as ``(B, T, 3 H, D)`` with ``rotated = 2 H`` rotates the queries
    and keys and copies the values in one pass."""
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotary: expected x of shape (B, T, G, D) with D even, got {tuple(x.shape)}")
    if rotated is not None and not 0 <= rotated <= x.shape[2]:
        raise ValueError(f"rotary: rotated={rotated} groups must lie in [0, {x.shape[2]}] (the groups of x)")
    if start < 0:
        raise ValueError(f"rotary: start={start} must be >= 0 (the position of the first row)")
    if resolve_backend(backend, x, op="rotary", available=BACKENDS) == "triton":
        from .triton import rotary_triton  # lazy: triton is optional

        return rotary_triton(x, start, base, rotated)
    return rotary_reference(x, start, base, rotated)
