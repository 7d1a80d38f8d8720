"""The spec of the row normalisations of the mixers' q/k and output paths, in plain PyTorch (fp64-capable).

- :func:`l2_normalize_reference`: ``x / max(||x||, eps)`` over the last dimension (``F.normalize``), computed in
  at least fp32 and returned in ``x``'s dtype.
- :func:`rms_norm_reference`: ``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, computed in
  at least fp32 and returned in ``x``'s dtype or the ``out_dtype`` asked for (the blocks' pre-norm,
  :class:`mixers.layers.RMSNorm`).
- :func:`gated_rms_norm_reference`: the same times ``SiLU(z)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import at_least_fp32


def l2_normalize_reference(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """In at least fp32, returned in ``x``'s dtype: in fp16 ``eps`` would round to zero (a zero row gave 0 / 0) and
    the norm of a row of large entries overflow (the row gave zeros)."""
    return F.normalize(at_least_fp32(x), dim=-1, eps=eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = at_least_fp32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(out_dtype or x.dtype)


def gated_rms_norm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = at_least_fp32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    return (y * F.silu(z.to(xf.dtype))).to(x.dtype)
