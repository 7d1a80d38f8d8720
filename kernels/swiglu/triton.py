"""The SwiGLU gate in one Triton kernel forward and one backward (the GPU path), where autograd through
``SiLU(a) * b`` launches two kernels forward and four backward (SiLU's, the product's two, and the
concatenation of the halves' gradients), and keeps ``SiLU(a)`` alive for the backward.

A program handles a ``BR x BF`` tile of the output: it reads ``a`` and ``b`` from the rows of ``h`` (any row
stride) and computes in fp32 (fp64 stays fp64), rounding once to ``h``'s dtype. Backward, from ``h`` alone,
with ``s = sigmoid(a)``: ``da = dy b s (1 + a (1 - s))`` and ``db = dy a s``, written side by side as the
gradient of ``h``. No products for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_rows, cdiv, compute_dtype, pow2
from ..launch import launch


@triton.jit
def _tile(pid, n_rows, F, BR: tl.constexpr, BF: tl.constexpr):
    col_blocks = tl.cdiv(F, BF)
    rows = ((pid // col_blocks) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = (pid % col_blocks) * BF + tl.arange(0, BF)
    return rows, cols, (rows < n_rows)[:, None] & (cols < F)[None, :]


@triton.jit
def _swiglu_fwd(H, Y, n_rows, F, s_h, FP64: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
    rows, cols, mask = _tile(tl.program_id(0), n_rows, F, BR, BF)
    at = H + rows[:, None] * s_h + cols[None, :]
    a = tl.load(at, mask=mask, other=0.0)
    b = tl.load(at + F, mask=mask, other=0.0)
    a, b = (a.to(tl.float64), b.to(tl.float64)) if FP64 else (a.to(tl.float32), b.to(tl.float32))
    tl.store(Y + rows[:, None] * F + cols[None, :], (a * tl.sigmoid(a) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(H, DY, DH, n_rows, F, s_h, s_dy, FP64: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
    rows, cols, mask = _tile(tl.program_id(0), n_rows, F, BR, BF)
    at = H + rows[:, None] * s_h + cols[None, :]
    a = tl.load(at, mask=mask, other=0.0)
    b = tl.load(at + F, mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * s_dy + cols[None, :], mask=mask, other=0.0)
    if FP64:
        a, b, dy = a.to(tl.float64), b.to(tl.float64), dy.to(tl.float64)
    else:
        a, b, dy = a.to(tl.float32), b.to(tl.float32), dy.to(tl.float32)
    s = tl.sigmoid(a)
    out = DH + rows[:, None] * 2 * F + cols[None, :]
    tl.store(out, (dy * b * s * (1.0 + a * (1.0 - s))).to(DH.dtype.element_ty), mask=mask)
    tl.store(out + F, (dy * a * s).to(DH.dtype.element_ty), mask=mask)


def _grid(n_rows: int, F: int) -> tuple[tuple[int], int, int]:
    """``(grid, BR, BF)``: tiles of about 2048 elements, at most 256 columns wide."""
    BF = min(256, max(16, pow2(F)))
    BR = max(1, min(2048 // BF, pow2(max(n_rows, 1))))
    return (cdiv(n_rows, BR) * cdiv(F, BF),), BR, BF


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        rows = as_rows(h)
        n_rows, F = rows.shape[0], rows.shape[1] // 2
        y = torch.empty(*h.shape[:-1], F, dtype=h.dtype, device=h.device)
        grid, BR, BF = _grid(n_rows, F)
        fp64 = compute_dtype(h.dtype) == torch.float64
        launch(_swiglu_fwd, grid, rows, y, n_rows, F, rows.stride(0), FP64=fp64, BR=BR, BF=BF, num_warps=4)
        ctx.save_for_backward(rows)
        ctx.meta = (h.shape, grid, BR, BF, fp64)
        return y

    @staticmethod
    def backward(ctx, dy):
        (rows,) = ctx.saved_tensors
        shape, grid, BR, BF, fp64 = ctx.meta
        n_rows, F = rows.shape[0], rows.shape[1] // 2
        dy_rows = as_rows(dy)
        dh = torch.empty(shape, dtype=rows.dtype, device=rows.device)
        launch(_swiglu_bwd, grid, rows, dy_rows, dh, n_rows, F, rows.stride(0), dy_rows.stride(0), FP64=fp64,
               BR=BR, BF=BF, num_warps=4)
        return dh


def swiglu_triton(h: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.swiglu.reference.swiglu_reference`."""
    if h.numel() == 0:
        return h[..., : h.shape[-1] // 2].clone()
    return _SwiGLU.apply(h)
