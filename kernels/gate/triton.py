"""The Mamba-2 log-decay gate ``g = -exp(A_log) softplus(raw + dt_bias)`` in one Triton kernel forward and
one backward (the GPU path), where autograd through the PyTorch formula launches five kernels forward and
about eight backward; and the step size alone, ``dt = min(softplus(raw + dt_bias), dt_max)`` (what Mamba-2's
scan takes), the same way: backward ``draw = sigmoid(u) ddt`` where ``softplus(u) <= dt_max`` (the clamp's
gradient, the cap included), else 0.

A program handles ``BR`` rows of the ``H`` heads; ``raw`` may be a column block of a wider projection
(any row stride) and the incoming gradient may have any strides. Backward, with ``u = raw + dt_bias`` and
``softplus'(u) = sigmoid(u)``: ``draw = -exp(A_log) sigmoid(u) dg``, and each program's share of
``dA_log = sum_rows g dg`` and ``ddt_bias = sum_rows draw``, summed over the programs in one reduction. ``softplus(u)`` is
``max(u, 0) + log1p(exp(-|u|))``, with ``log1p(e) = log(1 + e) e / ((1 + e) - 1)`` (exact to rounding for
small ``e``, where ``log(1 + e)`` alone would lose the digits of the small step sizes ``dt``). Arithmetic
in fp32 (fp64 stays fp64); no products for tensor cores.

The delta rule's step size, ``beta = scale sigmoid(raw)`` (``scale`` 2 where negative eigenvalues are
allowed): one kernel each way (``_scaled_sigmoid_fwd`` / ``_scaled_sigmoid_bwd``) on the ``(rows, H)``
logits, in fp32 from a 16-bit projection, where the formula launches a sigmoid and a product each way (and a
cast where the projection is 16-bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_rows, cdiv, compute_dtype, pow2
from ..launch import launch


@triton.jit
def _softplus(u):
    e = tl.exp(-tl.abs(u))
    one_e = 1.0 + e
    exact = one_e == 1.0
    log1p = tl.where(exact, e, tl.log(one_e) * e / tl.where(exact, 1.0, one_e - 1.0))
    return tl.maximum(u, 0.0) + log1p


@triton.jit
def _u_tile(RAW, DT_BIAS, pid, n_rows, H, s_raw, BR: tl.constexpr, BH: tl.constexpr):
    """``(rows, cols, head mask, tile mask, u = raw + dt_bias)`` of program ``pid``'s ``BR`` rows, ``u`` in
    ``dt_bias``'s dtype (the compute dtype)."""
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BH)
    mh = cols < H
    mask = (rows < n_rows)[:, None] & mh[None, :]
    b = tl.load(DT_BIAS + cols, mask=mh, other=0.0)
    u = tl.load(RAW + rows[:, None] * s_raw + cols[None, :], mask=mask, other=0.0).to(b.dtype) + b[None, :]
    return rows, cols, mh, mask, u


@triton.jit
def _gate_fwd(RAW, A_LOG, DT_BIAS, G, n_rows, H, s_raw, BR: tl.constexpr, BH: tl.constexpr):
    rows, cols, mh, mask, u = _u_tile(RAW, DT_BIAS, tl.program_id(0), n_rows, H, s_raw, BR, BH)
    a = tl.load(A_LOG + cols, mask=mh, other=0.0)
    tl.store(G + rows[:, None] * H + cols[None, :], -tl.exp(a)[None, :] * _softplus(u), mask=mask)


@triton.jit
def _gate_bwd(RAW, A_LOG, DT_BIAS, DG, DRAW, PART, n_rows, H, s_raw, s_dg_row, s_dg_col, BR: tl.constexpr,
              BH: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, mh, mask, u = _u_tile(RAW, DT_BIAS, pid, n_rows, H, s_raw, BR, BH)
    a = tl.load(A_LOG + cols, mask=mh, other=0.0)
    dg = tl.load(DG + rows[:, None] * s_dg_row + cols[None, :] * s_dg_col, mask=mask, other=0.0).to(a.dtype)
    neg_A = -tl.exp(a)[None, :]
    draw = tl.where(mask, neg_A * tl.sigmoid(u) * dg, 0.0)
    tl.store(DRAW + rows[:, None] * H + cols[None, :], draw.to(DRAW.dtype.element_ty), mask=mask)
    g = neg_A * _softplus(u)
    tl.store(PART + pid * 2 * H + cols, tl.sum(tl.where(mask, g * dg, 0.0), axis=0), mask=mh)
    tl.store(PART + pid * 2 * H + H + cols, tl.sum(draw, axis=0), mask=mh)


@triton.jit
def _step_fwd(RAW, DT_BIAS, DT, n_rows, H, s_raw, dt_max, CAP: tl.constexpr, BR: tl.constexpr,
              BH: tl.constexpr):
    rows, cols, mh, mask, u = _u_tile(RAW, DT_BIAS, tl.program_id(0), n_rows, H, s_raw, BR, BH)
    dt = _softplus(u)
    if CAP:
        dt = tl.minimum(dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
    tl.store(DT + rows[:, None] * H + cols[None, :], dt.to(DT.dtype.element_ty), mask=mask)


@triton.jit
def _step_bwd(RAW, DT_BIAS, DDT, DRAW, PART, n_rows, H, s_raw, s_ddt_row, s_ddt_col, dt_max, CAP: tl.constexpr,
              BR: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, mh, mask, u = _u_tile(RAW, DT_BIAS, pid, n_rows, H, s_raw, BR, BH)
    ddt = tl.load(DDT + rows[:, None] * s_ddt_row + cols[None, :] * s_ddt_col, mask=mask, other=0.0).to(u.dtype)
    draw = tl.where(mask, tl.sigmoid(u) * ddt, 0.0)
    if CAP:                                           # the clamp passes the gradient up to the cap, inclusive
        draw = tl.where(_softplus(u) <= dt_max, draw, 0.0)
    tl.store(DRAW + rows[:, None] * H + cols[None, :], draw.to(DRAW.dtype.element_ty), mask=mask)
    tl.store(PART + pid * H + cols, tl.sum(draw, axis=0), mask=mh)


def _blocks(H: int, n_rows: int) -> tuple[int, int]:
    BH = max(2, pow2(H))
    return max(1, min(128, 4096 // BH, pow2(n_rows))), BH


def _grad_rows(grad: torch.Tensor, n_rows: int, H: int) -> torch.Tensor:
    """The incoming gradient as ``(n_rows, H)``: any strides (a heads-first gradient is read in place)."""
    try:
        return grad.view(n_rows, H)
    except RuntimeError:
        return grad.contiguous().view(n_rows, H)


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, A_log, dt_bias):
        cd = compute_dtype(raw.dtype)
        rows = as_rows(raw)
        n_rows, H = rows.shape
        a, b = A_log.to(cd).contiguous(), dt_bias.to(cd).contiguous()
        g = torch.empty(raw.shape, dtype=cd, device=raw.device)
        BR, BH = _blocks(H, n_rows)
        launch(_gate_fwd, (cdiv(n_rows, BR),), rows, a, b, g, n_rows, H, rows.stride(0), BR=BR, BH=BH)
        ctx.save_for_backward(rows, a, b)
        ctx.meta = (raw.shape, raw.dtype, A_log.dtype, dt_bias.dtype, BR, BH)
        return g

    @staticmethod
    def backward(ctx, dg):
        rows, a, b = ctx.saved_tensors
        shape, raw_dtype, a_dtype, b_dtype, BR, BH = ctx.meta
        n_rows, H = rows.shape
        n_prog = cdiv(n_rows, BR)
        draw = torch.empty(shape, dtype=raw_dtype, device=rows.device)
        part = a.new_empty(n_prog, 2 * H)
        dg_rows = _grad_rows(dg, n_rows, H)
        launch(_gate_bwd, (n_prog,), rows, a, b, dg_rows, draw, part, n_rows, H, rows.stride(0), *dg_rows.stride(),
               BR=BR, BH=BH)
        sums = part.sum(0)
        return draw, sums[:H].to(a_dtype), sums[H:].to(b_dtype)


class _StepSize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, dt_bias, dt_max, out_dtype):
        cd = compute_dtype(raw.dtype)
        rows = as_rows(raw)
        n_rows, H = rows.shape
        b = dt_bias.to(cd).contiguous()
        dt = torch.empty(raw.shape, dtype=out_dtype or cd, device=raw.device)
        BR, BH = _blocks(H, n_rows)
        cap = dt_max is not None
        launch(_step_fwd, (cdiv(n_rows, BR),), rows, b, dt, n_rows, H, rows.stride(0),
               float(dt_max) if cap else 0.0, CAP=cap, BR=BR, BH=BH)
        ctx.save_for_backward(rows, b)
        ctx.meta = (raw.shape, raw.dtype, dt_bias.dtype, dt_max, BR, BH)
        return dt

    @staticmethod
    def backward(ctx, ddt):
        rows, b = ctx.saved_tensors
        shape, raw_dtype, b_dtype, dt_max, BR, BH = ctx.meta
        n_rows, H = rows.shape
        n_prog = cdiv(n_rows, BR)
        draw = torch.empty(shape, dtype=raw_dtype, device=rows.device)
        part = b.new_empty(n_prog, H)
        ddt_rows = _grad_rows(ddt, n_rows, H)
        cap = dt_max is not None
        launch(_step_bwd, (n_prog,), rows, b, ddt_rows, draw, part, n_rows, H, rows.stride(0), *ddt_rows.stride(),
               float(dt_max) if cap else 0.0, CAP=cap, BR=BR, BH=BH)
        return draw, part.sum(0).to(b_dtype), None, None


def log_decay_triton(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.gate.reference.log_decay_reference`."""
    return _LogDecay.apply(raw, A_log, dt_bias)


def step_size_triton(raw: torch.Tensor, dt_bias: torch.Tensor, dt_max: float | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`kernels.gate.reference.step_size_reference`, stored in ``out_dtype`` (default: the compute
    dtype, at least fp32)."""
    return _StepSize.apply(raw, dt_bias, dt_max, out_dtype)


@triton.jit
def _scaled_sigmoid_fwd(RAW, OUT, n_rows, H, s_raw, scale, BR: tl.constexpr, BH: tl.constexpr, FP64: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BH)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    raw = tl.load(RAW + rows[:, None] * s_raw + cols[None, :], mask=mask, other=0.0)
    out = scale * tl.sigmoid(raw.to(tl.float64 if FP64 else tl.float32))
    tl.store(OUT + rows[:, None] * H + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_sigmoid_bwd(RAW, DOUT, DRAW, n_rows, H, s_raw, s_dout_row, s_dout_col, scale, BR: tl.constexpr,
                        BH: tl.constexpr, FP64: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BH)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    cd = tl.float64 if FP64 else tl.float32
    sig = tl.sigmoid(tl.load(RAW + rows[:, None] * s_raw + cols[None, :], mask=mask, other=0.0).to(cd))
    dout = tl.load(DOUT + rows[:, None] * s_dout_row + cols[None, :] * s_dout_col, mask=mask, other=0.0).to(cd)
    tl.store(DRAW + rows[:, None] * H + cols[None, :], (scale * sig * (1.0 - sig) * dout).to(DRAW.dtype.element_ty),
             mask=mask)


class _ScaledSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, scale):
        rows = as_rows(raw)
        n_rows, H = rows.shape
        out = torch.empty(raw.shape, dtype=compute_dtype(raw.dtype), device=raw.device)
        BR, BH = _blocks(H, n_rows)
        fp64 = raw.dtype == torch.float64
        launch(_scaled_sigmoid_fwd, (cdiv(n_rows, BR),), rows, out, n_rows, H, rows.stride(0), float(scale),
               BR=BR, BH=BH, FP64=fp64)
        ctx.save_for_backward(rows)
        ctx.meta = (raw.shape, raw.dtype, float(scale), BR, BH, fp64)
        return out

    @staticmethod
    def backward(ctx, dout):
        (rows,) = ctx.saved_tensors
        shape, raw_dtype, scale, BR, BH, fp64 = ctx.meta
        n_rows, H = rows.shape
        draw = torch.empty(shape, dtype=raw_dtype, device=rows.device)
        d_rows = _grad_rows(dout, n_rows, H)
        launch(_scaled_sigmoid_bwd, (cdiv(n_rows, BR),), rows, d_rows, draw, n_rows, H, rows.stride(0),
               *d_rows.stride(), scale, BR=BR, BH=BH, FP64=fp64)
        return draw, None


def scaled_sigmoid_triton(raw: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """:func:`kernels.gate.reference.scaled_sigmoid_reference` in one launch each way."""
    return _ScaledSigmoid.apply(raw, scale)
