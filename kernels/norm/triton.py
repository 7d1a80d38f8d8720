"""Row normalisations in one Triton kernel forward and one backward each (the GPU path).

Rows are the last dimension; a program normalises ``BR`` rows of ``D`` elements in registers, in fp32
(fp64 stays fp64; ``eps`` is passed as an fp32 scalar). Inputs may be strided views (the ``q|k`` columns of
a fused ``q|k|v`` matrix, a gate slice, heads in a heads-first layout): element ``(o, i, d)`` of the rows
viewed as ``(outer, inner, D)`` is read at ``o * stride_outer + i * stride_inner + d``, so no copy is made
to take them out; outputs are contiguous, in ``x``'s dtype (an RMSNorm may be asked for another: the pre-norm of a
linear layer under autocast writes the autocast dtype, the linear's cast done by the norm's store), and the input
gradients ``dx`` of the L2 normalisation and ``dz`` of the gate are written at their places in the gradient of the
tensor they were cut from where :mod:`kernels.grad_slots` has one, else contiguous.

- :func:`l2_normalize_triton`: ``y = x r``, ``r = 1 / max(||x||, eps)``; backward
  ``dx = r (dy - [||x|| > eps] y (dy . y))`` from ``x`` (recomputed ``r`` and ``y``).
- :func:`gated_rms_norm_triton`: ``y = x r w SiLU(z)``, ``r = (mean(x^2) + eps)^(-1/2)``; backward with
  ``n = x r``, ``s = SiLU(z)``: ``dz = dy n w SiLU'(z)``, ``dx = r (da w - n mean(da w n))`` with
  ``da = dy s``, and each program's share of ``dw = sum_rows da n`` over the blocks of rows it walks (at most
  :data:`_DW_SHARES` programs), summed over the programs in one reduction.
- :func:`rms_norm_triton`: the same kernels without the gate (``GATED=False``: ``s = 1``, no ``z``), the
  pre-norms of every block of a model.

So an L2 normalisation is two launches forward+backward and an RMSNorm, gated or not, three, where autograd
through the PyTorch formulas runs ten, about sixteen (plain) and about twenty-four (gated). No products here
for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, compute_dtype, pow2
from ..grad_slots import empty_grad
from ..launch import launch


@triton.jit
def _offsets(pid, n_rows, inner, s_outer, s_inner, D, BR: tl.constexpr, BD: tl.constexpr):
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return rows, cols, mask, _strided(rows, cols, inner, s_outer, s_inner), rows[:, None] * D + cols[None, :]


@triton.jit
def _strided(rows, cols, inner, s_outer, s_inner):
    return ((rows // inner) * s_outer + (rows % inner) * s_inner)[:, None] + cols[None, :]


@triton.jit
def _l2_fwd(X, Y, n_rows, inner, sx, six, D, eps, FP64: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    rows, cols, mask, x_off, y_off = _offsets(tl.program_id(0), n_rows, inner, sx, six, D, BR, BD)
    x = tl.load(X + x_off, mask=mask, other=0.0)
    x = x.to(tl.float64) if FP64 else x.to(tl.float32)
    r = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
    tl.store(Y + y_off, (x * r[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _l2_bwd(X, DY, DX, n_rows, inner, sx, six, sdx, sidx, D, eps, FP64: tl.constexpr, BR: tl.constexpr,
            BD: tl.constexpr):
    rows, cols, mask, x_off, y_off = _offsets(tl.program_id(0), n_rows, inner, sx, six, D, BR, BD)
    x = tl.load(X + x_off, mask=mask, other=0.0)
    x = x.to(tl.float64) if FP64 else x.to(tl.float32)
    dy = tl.load(DY + y_off, mask=mask, other=0.0).to(x.dtype)
    n = tl.sqrt(tl.sum(x * x, axis=1))
    r = 1.0 / tl.maximum(n, eps)
    y = x * r[:, None]
    s = tl.where(n > eps, tl.sum(dy * y, axis=1), 0.0)
    tl.store(DX + _strided(rows, cols, inner, sdx, sidx), (r[:, None] * (dy - y * s[:, None])).to(DX.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_fwd(X, Z, W, Y, n_rows, inner, sx, six, sz, siz, D, eps, GATED: tl.constexpr, BR: tl.constexpr,
             BD: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, mask, x_off, y_off = _offsets(pid, n_rows, inner, sx, six, D, BR, BD)
    w = tl.load(W + cols, mask=cols < D, other=0.0)
    x = tl.load(X + x_off, mask=mask, other=0.0).to(w.dtype)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * r[:, None] * w[None, :]
    if GATED:
        z = tl.load(Z + _strided(rows, cols, inner, sz, siz), mask=mask, other=0.0).to(w.dtype)
        y = y * (z * tl.sigmoid(z))
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd(X, Z, W, DY, DX, DZ, DW, n_rows, inner, sx, six, sz, siz, sdz, sidz, D, eps, BLOCKS,
             GATED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    w = tl.load(W + cols, mask=cols < D, other=0.0)
    dw = tl.zeros([BD], dtype=w.dtype)
    for i in range(BLOCKS):                                  # consecutive blocks of BR rows, one share of dw
        rows, cols, mask, x_off, y_off = _offsets(pid * BLOCKS + i, n_rows, inner, sx, six, D, BR, BD)
        x = tl.load(X + x_off, mask=mask, other=0.0).to(w.dtype)
        dy = tl.load(DY + y_off, mask=mask, other=0.0).to(w.dtype)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        n = x * r[:, None]
        da = dy
        if GATED:
            z = tl.load(Z + _strided(rows, cols, inner, sz, siz), mask=mask, other=0.0).to(w.dtype)
            sig = tl.sigmoid(z)
            a = n * w[None, :]
            dz = dy * a * sig * (1.0 + z * (1.0 - sig))
            tl.store(DZ + _strided(rows, cols, inner, sdz, sidz), dz.to(DZ.dtype.element_ty), mask=mask)
            da = dy * (z * sig)
        dw += tl.sum(da * n, axis=0)
        dn = da * w[None, :]
        dx = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        tl.store(DX + y_off, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * D + cols, dw, mask=cols < D)


def _rows(x: torch.Tensor):
    """``(x, n_rows, inner, stride_outer, stride_inner)``: ``x`` (copied only when it must be) addressed as
    rows ``(outer, inner, D)`` with element ``(o, i, d)`` at ``o * stride_outer + i * stride_inner + d``."""
    inner = x.shape[-2] if x.ndim >= 2 else 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        v = _row_view(x)
    except RuntimeError:                                 # leading dims that cannot be merged
        x = x.contiguous()
        v = _row_view(x)
    return x, v.shape[0] * inner, inner, v.stride(0), v.stride(1)


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as rows ``(outer, inner, D)``."""
    return t.view(-1, t.shape[-2] if t.ndim >= 2 else 1, t.shape[-1])


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """``(stride_outer, stride_inner)`` of a gradient laid out like its input (:func:`_rows` made the view of
    that layout possible)."""
    v = _row_view(t)
    return v.stride(0), v.stride(1)


def _block(D: int, n_rows: int) -> tuple[int, int, int]:
    """``(rows per program, padded row length, warps)``: about 1024 elements per program, 8 per thread for
    rows up to 1024 (the backward keeps about six such tiles live), more warps for longer rows."""
    BD = max(16, pow2(D))
    return max(1, min(16, 1024 // BD, pow2(n_rows))), BD, min(16, max(4, BD // 256))


#: shares of the RMSNorm weight gradient at most (fp32 rows of ``D``, written by the backward's programs and summed
#: in torch): a program walks as many blocks of rows as keeps to this many. One block a program wrote a share every
#: 2 rows of 512 (a model's pre-norm), as many bytes as ``x`` itself in fp32, and read them all again to sum them.
_DW_SHARES = 1024


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps: float):
        x, n_rows, inner, sx, six = _rows(x)
        D = x.shape[-1]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        BR, BD, warps = _block(D, n_rows)
        fp64 = compute_dtype(x.dtype) == torch.float64
        launch(_l2_fwd, (cdiv(n_rows, BR),), x, y, n_rows, inner, sx, six, D, eps, FP64=fp64, BR=BR, BD=BD,
               num_warps=warps)
        ctx.save_for_backward(x)
        ctx.eps, ctx.layout = eps, (n_rows, inner, sx, six, BR, BD, warps, fp64)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        n_rows, inner, sx, six, BR, BD, warps, fp64 = ctx.layout
        dx = empty_grad(x)          # in place in the gradient of the tensor x was cut from, where it was
        launch(_l2_bwd, (cdiv(n_rows, BR),), x, dy.contiguous(), dx, n_rows, inner, sx, six, *_row_strides(dx),
               x.shape[-1], ctx.eps, FP64=fp64, BR=BR, BD=BD, num_warps=warps)
        return dx, None


class _RMSNorm(torch.autograd.Function):
    """``x r w``, times ``SiLU(z)`` where ``z`` is given (``GATED``; without it nothing is read or written
    in its place)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps: float, out_dtype=None):
        gated = z is not None
        if gated and z.shape != x.shape:
            raise ValueError(f"gated_rms_norm: z {tuple(z.shape)} must have the shape of x {tuple(x.shape)}")
        x, n_rows, inner, sx, six = _rows(x)
        z, _, _, sz, siz = _rows(z) if gated else (x, None, None, sx, six)
        D = x.shape[-1]
        w = weight.to(compute_dtype(x.dtype)).contiguous()
        y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
        BR, BD, warps = _block(D, n_rows)
        launch(_rms_fwd, (cdiv(n_rows, BR),), x, z, w, y, n_rows, inner, sx, six, sz, siz, D, eps,
               GATED=gated, BR=BR, BD=BD, num_warps=warps)
        ctx.save_for_backward(x, z, w)
        ctx.eps, ctx.layout, ctx.w_dtype = eps, (n_rows, inner, sx, six, sz, siz, BR, BD, warps), weight.dtype
        ctx.gated = gated
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, w = ctx.saved_tensors
        n_rows, inner, sx, six, sz, siz, BR, BD, warps = ctx.layout
        D = x.shape[-1]
        blocks = cdiv(cdiv(n_rows, BR), _DW_SHARES)          # row blocks a program walks
        n_prog = cdiv(n_rows, BR * blocks)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dz = empty_grad(z) if ctx.gated else dx     # the gate's in place in its projection's gradient, where it was
        dw = w.new_empty(n_prog, D)
        launch(_rms_bwd, (n_prog,), x, z, w, dy.contiguous(), dx, dz, dw, n_rows, inner, sx, six, sz, siz,
               *_row_strides(dz), D, ctx.eps, blocks, GATED=ctx.gated, BR=BR, BD=BD, num_warps=warps)
        return dx, dz if ctx.gated else None, dw.sum(0).to(ctx.w_dtype), None, None


def l2_normalize_triton(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    return _L2Normalize.apply(x, eps)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _RMSNorm.apply(x, z, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return _RMSNorm.apply(x, None, weight, eps, out_dtype)
