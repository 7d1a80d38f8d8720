"""``F.normalize(x, dim=-1, eps)`` (``x / max(||x||, eps)``) with a hand-written backward.

Autograd's backward of ``F.normalize`` goes through the norm, the clamp, the expand and the division
(about twice as many full passes over ``x`` as needed). With ``r = 1 / max(||x||, eps)`` and
``y = r x`` the input gradient is ``dx = r (dy - [||x|| > eps] y (dy . y))``: one reduction and two
elementwise passes. Used by the mixers that L2-normalise their queries and keys.

That is the CPU plan (:func:`kernels.device.plan_for`); on the GPU plan the same function is one Triton
kernel each way (:func:`kernels.norm.l2_normalize`) where the five passes would be five launches.
"""
from __future__ import annotations

import torch

from kernels.backend import triton_pieces_for
from kernels.common import at_least_fp32
from kernels.norm import l2_normalize as l2_normalize_kernel


class _L2Normalize(torch.autograd.Function):
    """In at least fp32 (a no-op for fp32 and fp64 inputs), returned in the input's dtype: in fp16 ``eps`` rounds to
    zero (a zero row gave 0 / 0) and the norm of a row of large entries overflows (the row gave zeros)."""

    @staticmethod
    def forward(ctx, x, eps: float):
        xf = at_least_fp32(x)
        n = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        r = n.clamp_min(eps).reciprocal_()
        y = xf * r
        ctx.save_for_backward(y, r, n > eps)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        y, r, unclamped = ctx.saved_tensors
        dyf = dy.to(y.dtype)
        s = (dyf * y).sum(-1, keepdim=True).mul_(unclamped)
        return torch.addcmul(dyf, y, s, value=-1.0).mul_(r).to(dy.dtype), None


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``, same values and gradients."""
    if triton_pieces_for(x):
        return l2_normalize_kernel(x, eps, backend="triton")
    return _L2Normalize.apply(x, eps)
