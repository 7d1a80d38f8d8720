"""The Mamba-2 log-decay gate of the gated mixers, ``g = -exp(A_log) softplus(raw + dt_bias)`` per head.

Backends: ``reference`` (the PyTorch formula, :mod:`.reference`) and ``triton`` (one kernel forward and
one backward, :mod:`.triton`), the GPU path. The CPU path is :class:`mixers.layers.DecayGate`'s own
PyTorch code, which picks between the two paths by :func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import log_decay_reference

__all__ = ["BACKENDS", "log_decay", "log_decay_reference"]

#: the backends this family implements
BACKENDS = ("reference", "triton")


def log_decay(raw, A_log, dt_bias, backend: str = "auto"):
    """``raw (..., H)``, ``A_log (H)``, ``dt_bias (H)`` -> ``g (..., H)`` in at least fp32."""
    if raw.shape[-1:] != A_log.shape or A_log.shape != dt_bias.shape:
        raise ValueError(f"log_decay: raw (..., H), A_log (H) and dt_bias (H) must share H, got {tuple(raw.shape)}, "
                         f"{tuple(A_log.shape)} and {tuple(dt_bias.shape)}")
    if resolve_backend(backend, raw, op="log_decay", available=BACKENDS) == "triton":
        from .triton import log_decay_triton  # lazy: triton is optional

        return log_decay_triton(raw, A_log, dt_bias)
    return log_decay_reference(raw, A_log, dt_bias)
