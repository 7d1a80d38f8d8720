"""The SwiGLU gate of the state mixer ``W_2 (SiLU(W_1 x) * W_3 x)``, applied to the fused projection
``[W_1 x | W_3 x]``.

Backends: ``reference`` (the PyTorch formula, :mod:`.reference`) and ``triton`` (one kernel forward and one
backward, :mod:`.triton`), the GPU path. The CPU path is :class:`mixers.mlp.SwiGLU`'s use of
:func:`swiglu_reference`, chosen by :func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import swiglu_reference

__all__ = ["BACKENDS", "swiglu", "swiglu_reference"]

#: the backends this family implements
BACKENDS = ("reference", "triton")


def swiglu(h, backend: str = "auto"):
    """``h (..., 2 F)`` -> ``SiLU(h[..., :F]) * h[..., F:]`` (``..., F``) in ``h``'s dtype."""
    if h.ndim < 1 or h.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension of h must be even (the two halves a | b), got "
                         f"{tuple(h.shape)}")
    if resolve_backend(backend, h, op="swiglu", available=BACKENDS) == "triton":
        from .triton import swiglu_triton  # lazy: triton is optional

        return swiglu_triton(h)
    return swiglu_reference(h)
