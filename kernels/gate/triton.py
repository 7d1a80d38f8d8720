"""The Mamba-2 log-decay gate ``g = -exp(A_log) softplus(raw + dt_bias)`` in one Triton kernel forward and
one backward (the GPU path), where autograd through the PyTorch formula launches five kernels forward and
about eight backward.

A program handles ``BR`` rows of the ``H`` heads; ``raw`` may be a column block of a wider projection
(any row stride) and the incoming gradient may have any strides. Backward, with ``u = raw + dt_bias`` and
``softplus'(u) = sigmoid(u)``: ``draw = -exp(A_log) sigmoid(u) dg``, and each program's share of
``dA_log = sum_rows g dg`` and ``ddt_bias = sum_rows draw``, summed over the programs in one reduction. ``softplus(u)`` is
``max(u, 0) + log1p(exp(-|u|))``, with ``log1p(e) = log(1 + e) e / ((1 + e) - 1)`` (exact to rounding for
small ``e``, where ``log(1 + e)`` alone would lose the digits of the small step sizes ``dt``). Arithmetic
in fp32 (fp64 stays fp64); no products for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import compute_dtype
from ..launch import launch


@triton.jit
def _softplus(u):
    e = tl.exp(-tl.abs(u))
    one_e = 1.0 + e
    exact = one_e == 1.0
    log1p = tl.where(exact, e, tl.log(one_e) * e / tl.where(exact, 1.0, one_e - 1.0))
    return tl.maximum(u, 0.0) + log1p


@triton.jit
def _gate_fwd(RAW, A_LOG, DT_BIAS, G, n_rows, H, s_raw, BR: tl.constexpr, BH: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BH)
    mh = cols < H
    mask = (rows < n_rows)[:, None] & mh[None, :]
    a = tl.load(A_LOG + cols, mask=mh, other=0.0)
    b = tl.load(DT_BIAS + cols, mask=mh, other=0.0)
    u = tl.load(RAW + rows[:, None] * s_raw + cols[None, :], mask=mask, other=0.0).to(a.dtype) + b[None, :]
    tl.store(G + rows[:, None] * H + cols[None, :], -tl.exp(a)[None, :] * _softplus(u), mask=mask)


@triton.jit
def _gate_bwd(RAW, A_LOG, DT_BIAS, DG, DRAW, PART, n_rows, H, s_raw, s_dg_row, s_dg_col, BR: tl.constexpr,
              BH: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BH)
    mh = cols < H
    mask = (rows < n_rows)[:, None] & mh[None, :]
    a = tl.load(A_LOG + cols, mask=mh, other=0.0)
    b = tl.load(DT_BIAS + cols, mask=mh, other=0.0)
    u = tl.load(RAW + rows[:, None] * s_raw + cols[None, :], mask=mask, other=0.0).to(a.dtype) + b[None, :]
    dg = tl.load(DG + rows[:, None] * s_dg_row + cols[None, :] * s_dg_col, mask=mask, other=0.0).to(a.dtype)
    neg_A = -tl.exp(a)[None, :]
    draw = tl.where(mask, neg_A * tl.sigmoid(u) * dg, 0.0)
    tl.store(DRAW + rows[:, None] * H + cols[None, :], draw.to(DRAW.dtype.element_ty), mask=mask)
    g = neg_A * _softplus(u)
    tl.store(PART + pid * 2 * H + cols, tl.sum(tl.where(mask, g * dg, 0.0), axis=0), mask=mh)
    tl.store(PART + pid * 2 * H + H + cols, tl.sum(draw, axis=0), mask=mh)


def _blocks(H: int, n_rows: int) -> tuple[int, int]:
    BH = max(2, triton.next_power_of_2(H))
    return max(1, min(128, 4096 // BH, triton.next_power_of_2(n_rows))), BH


class _LogDecay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, A_log, dt_bias):
        H = raw.shape[-1]
        cd = compute_dtype(raw.dtype)
        if raw.stride(-1) != 1:
            raw = raw.contiguous()
        try:
            rows = raw.view(-1, H)
        except RuntimeError:                             # leading dims that cannot be merged
            raw = raw.contiguous()
            rows = raw.view(-1, H)
        n_rows = rows.shape[0]
        a, b = A_log.to(cd).contiguous(), dt_bias.to(cd).contiguous()
        g = torch.empty(raw.shape, dtype=cd, device=raw.device)
        BR, BH = _blocks(H, n_rows)
        launch(_gate_fwd, (triton.cdiv(n_rows, BR),), rows, a, b, g, n_rows, H, rows.stride(0), BR=BR, BH=BH)
        ctx.save_for_backward(rows, a, b)
        ctx.meta = (raw.shape, raw.dtype, A_log.dtype, dt_bias.dtype, BR, BH)
        return g

    @staticmethod
    def backward(ctx, dg):
        rows, a, b = ctx.saved_tensors
        shape, raw_dtype, a_dtype, b_dtype, BR, BH = ctx.meta
        n_rows, H = rows.shape
        n_prog = triton.cdiv(n_rows, BR)
        draw = torch.empty(shape, dtype=raw_dtype, device=rows.device)
        part = a.new_empty(n_prog, 2 * H)
        try:
            dg_rows = dg.view(n_rows, H)                 # any strides (a heads-first gradient is read in place)
        except RuntimeError:
            dg_rows = dg.contiguous().view(n_rows, H)
        launch(_gate_bwd, (n_prog,), rows, a, b, dg_rows, draw, part, n_rows, H, rows.stride(0), *dg_rows.stride(),
               BR=BR, BH=BH)
        sums = part.sum(0)
        return draw, sums[:H].to(a_dtype), sums[H:].to(b_dtype)


def log_decay_triton(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.gate.reference.log_decay_reference`."""
    return _LogDecay.apply(raw, A_log, dt_bias)
