"""Row normalisations of the mixers and the model: the L2 normalisation of queries and keys, the gated RMSNorm
of the output path (``RMSNorm(x) * SiLU(z)``) and the plain RMSNorm of every block's pre-norm, each over the
last dimension.

Backends: ``reference`` (the PyTorch formulas, :mod:`.reference`) and ``triton`` (one kernel forward and
one backward each, :mod:`.triton`), the GPU path. The CPU path is the mixers' own PyTorch code
(:mod:`mixers.l2norm`, :class:`mixers.layers.RMSNorm` and ``GatedRMSNorm``), which picks between the two paths by
:func:`kernels.device.plan_for`.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .reference import gated_rms_norm_reference, l2_normalize_reference, rms_norm_reference

__all__ = ["BACKENDS", "l2_normalize", "gated_rms_norm", "rms_norm", "l2_normalize_reference",
           "gated_rms_norm_reference", "rms_norm_reference"]

#: the backends this family implements
BACKENDS = ("reference", "triton")


def l2_normalize(x, eps: float = 1e-12, backend: str = "auto"):
    """``x / max(||x||, eps)`` over the last dimension."""
    if resolve_backend(backend, x, op="l2_normalize", available=BACKENDS) == "triton":
        from .triton import l2_normalize_triton  # lazy: triton is optional

        return l2_normalize_triton(x, eps)
    return l2_normalize_reference(x, eps)


def _check_weight(op: str, x, weight) -> None:
    if weight is None:
        raise ValueError(f"{op}: weight is required, a ({x.shape[-1]},) tensor (torch.ones for no scale)")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"{op}: weight must be ({x.shape[-1]},), the last dimension of x {tuple(x.shape)}; got "
                         f"{tuple(weight.shape)}")


def gated_rms_norm(x, z, weight, eps: float = 1e-6, backend: str = "auto"):
    """``x / sqrt(mean(x^2) + eps) * weight * SiLU(z)`` over the last dimension, in ``x``'s dtype."""
    _check_weight("gated_rms_norm", x, weight)
    if tuple(z.shape) != tuple(x.shape):
        raise ValueError(f"gated_rms_norm: the gate z must have x's shape {tuple(x.shape)}; got {tuple(z.shape)}")
    if resolve_backend(backend, x, op="gated_rms_norm", available=BACKENDS) == "triton":
        from .triton import gated_rms_norm_triton  # lazy: triton is optional

        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_reference(x, z, weight, eps)


def rms_norm(x, weight, eps: float = 1e-6, backend: str = "auto", out_dtype=None):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in ``out_dtype`` (default ``x``'s dtype);
    its gradient with respect to ``x`` comes back in ``x``'s dtype."""
    _check_weight("rms_norm", x, weight)
    if resolve_backend(backend, x, op="rms_norm", available=BACKENDS) == "triton":
        from .triton import rms_norm_triton  # lazy: triton is optional

        return rms_norm_triton(x, weight, eps, out_dtype)
    return rms_norm_reference(x, weight, eps, out_dtype)
