"""The Mamba-2 log-decay gate of the gated mixers, ``g = -exp(A_log) softplus(raw + dt_bias)`` per head, and
its step size ``dt = min(softplus(raw + dt_bias), dt_max)`` alone (what Mamba-2's scan takes); and the beta
gate of the GLA and GKA layers, ``(k sigmoid(raw), v sigmoid(raw))`` per head (:func:`beta_scale`), and the
delta rule's step size ``scale sigmoid(raw)`` (:func:`scaled_sigmoid`).

Backends: ``reference`` (the PyTorch formula, :mod:`.reference`) and ``triton`` (one kernel forward and
one backward, :mod:`.triton`; the beta gate's in :mod:`.beta`), the GPU path. The CPU path is
:class:`mixers.layers.DecayGate`'s own PyTorch code, which picks between the two paths by
:func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import beta_scale_reference, log_decay_reference, scaled_sigmoid_reference, step_size_reference

__all__ = ["BACKENDS", "beta_scale", "beta_scale_reference", "log_decay", "log_decay_reference", "scaled_sigmoid",
           "scaled_sigmoid_reference", "step_size", "step_size_reference"]

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


def step_size(raw, dt_bias, dt_max: float | None = None, out_dtype=None, backend: str = "auto"):
    """``raw (..., H)``, ``dt_bias (H)`` -> ``dt = min(softplus(raw + dt_bias), dt_max) (..., H)``, computed in
    at least fp32 and returned in ``out_dtype`` (default: that compute dtype)."""
    if raw.shape[-1:] != dt_bias.shape:
        raise ValueError(f"step_size: raw (..., H) and dt_bias (H) must share H, got {tuple(raw.shape)} and "
                         f"{tuple(dt_bias.shape)}")
    if dt_max is not None and not dt_max > 0:
        raise ValueError(f"step_size: dt_max={dt_max} must be positive (or None for no cap)")
    if resolve_backend(backend, raw, op="step_size", available=BACKENDS) == "triton":
        from .triton import step_size_triton  # lazy: triton is optional

        return step_size_triton(raw, dt_bias, dt_max, out_dtype)
    dt = step_size_reference(raw, dt_bias, dt_max)
    return dt if out_dtype is None else dt.to(out_dtype)


def beta_scale(k, v, raw, backend: str = "auto"):
    """``k (..., H, d_k)``, ``v (..., H, d_v)``, ``raw (..., H)`` -> ``(k beta, v beta)`` with ``beta =
    sigmoid(raw)`` per head, in ``k``'s and ``v``'s dtypes."""
    if k.shape[:-1] != raw.shape or v.shape[:-1] != raw.shape:
        raise ValueError(f"beta_scale: k (..., H, d_k), v (..., H, d_v) and raw (..., H) must share (..., H), got "
                         f"{tuple(k.shape)}, {tuple(v.shape)} and {tuple(raw.shape)}")
    if resolve_backend(backend, k, op="beta_scale", available=BACKENDS) == "triton":
        from .beta import beta_scale_triton  # lazy: triton is optional

        return beta_scale_triton(k, v, raw)
    return beta_scale_reference(k, v, raw)


def scaled_sigmoid(raw, scale: float = 1.0, backend: str = "auto"):
    """``raw (..., H)`` -> ``scale sigmoid(raw)`` in at least fp32 (the delta rule's ``beta``)."""
    if resolve_backend(backend, raw, op="scaled_sigmoid", available=BACKENDS) == "triton":
        from .triton import scaled_sigmoid_triton  # lazy: triton is optional

        return scaled_sigmoid_triton(raw, scale)
    return scaled_sigmoid_reference(raw, scale)
