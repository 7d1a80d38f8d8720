"""The causal depthwise short convolution (+ SiLU) in one Triton kernel forward and one backward.

Layout ``x (B, T, C)`` as the projections produce it (any batch and time strides: a column block of a
wider projection is read in place), ``weight (C, k)`` as the module holds it, ``k`` a compile-time
constant; outputs are contiguous. One program per (channel block, time block, batch element):

- forward: ``y_t = b + sum_j w_j x_{t-(k-1)+j}`` from ``k`` shifted loads of its tile, ``out = SiLU(y)``
  (only ``out`` is stored; the backward recomputes ``y``);
- backward: with ``dy_r = dout_r SiLU'(y_r)`` recomputed for the ``k`` rows ``r = t .. t+k-1`` a token
  feeds, ``dx_t = sum_s w_{k-1-s} dy_{t+s}``; a program walks up to ``T / 64`` consecutive time tiles and
  stores its share of ``dw_j = sum_t dy_t x_{t-(k-1)+j}`` and ``db = sum_t dy_t`` (at most 64 shares per
  channel and batch element), summed afterwards in one reduction.

So a convolution is one launch forward and two backward at every length (the CPU path of
:mod:`mixers.conv_time_first` makes ``k + 1`` passes per time block, blocks sized for a core's cache).
Arithmetic in fp32 (fp64 stays fp64); a depthwise filter has no product for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import compute_dtype
from ..launch import launch


@triton.jit
def _preact(xb, st, W, B, t, c, mc, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr,
            BC: tl.constexpr):
    """``y`` at rows ``t`` (rows outside ``[0, T)`` read zeros), in the weights' dtype."""
    acc = tl.zeros([BT, BC], dtype=W.dtype.element_ty)
    if HAS_BIAS:
        acc += tl.load(B + c, mask=mc, other=0.0)[None, :]
    for j in tl.static_range(K):
        src = t - (K - 1 - j)
        ok = (src >= 0) & (src < T)
        x = tl.load(xb + src[:, None] * st + c[None, :], mask=ok[:, None] & mc[None, :], other=0.0)
        acc += x.to(acc.dtype) * tl.load(W + c * K + j, mask=mc, other=0.0)[None, :]
    return acc


@triton.jit
def _conv_fwd(X, W, B, OUT, T, C, sb, st, K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_t = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    xb = X + batch * sb
    y = _preact(xb, st, W, B, t, c, mc, T, C, K, HAS_BIAS, BT, BC)
    if ACT:
        y = y * tl.sigmoid(y)
    tl.store(OUT + batch * T * C + t[:, None] * C + c[None, :], y.to(OUT.dtype.element_ty),
             mask=(t < T)[:, None] & mc[None, :])


@triton.jit
def _conv_bwd(X, W, B, DOUT, DX, PART, T, C, sb, st, n_groups, tiles, K: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACT: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_g = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    taps = tl.arange(0, BK)
    xb = X + batch * sb
    db = DOUT + batch * T * C
    acc_w = tl.zeros([BK, BC], dtype=W.dtype.element_ty)      # this group's share of dw_j (row j), then db
    acc_b = tl.zeros([BC], dtype=W.dtype.element_ty)
    for it in range(tiles):                                 # consecutive time tiles of this group
        t = ((pid_g * tiles + it) * BT + tl.arange(0, BT)).to(tl.int64)
        dx = tl.zeros([BT, BC], dtype=W.dtype.element_ty)
        dy0 = tl.zeros([BT, BC], dtype=W.dtype.element_ty)
        for s in tl.static_range(K):
            r = t + s                                      # the rows token t feeds, through tap k-1-s
            ok = (r < T)[:, None] & mc[None, :]
            dy = tl.load(db + r[:, None] * C + c[None, :], mask=ok, other=0.0).to(dx.dtype)
            if ACT:
                y = _preact(xb, st, W, B, r, c, mc, T, C, K, HAS_BIAS, BT, BC)
                sig = tl.sigmoid(y)
                dy = dy * sig * (1.0 + y * (1.0 - sig))
            dx += tl.load(W + c * K + (K - 1 - s), mask=mc, other=0.0)[None, :] * dy
            if s == 0:
                dy0 = dy
        tl.store(DX + batch * T * C + t[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty),
                 mask=(t < T)[:, None] & mc[None, :])
        for j in tl.static_range(K):                       # dw_j += sum_t dy_t x_{t-(k-1)+j}
            src = t - (K - 1 - j)
            ok = (src >= 0) & (src < T)
            x = tl.load(xb + src[:, None] * st + c[None, :], mask=ok[:, None] & mc[None, :], other=0.0)
            acc_w += tl.where(taps[:, None] == j, tl.sum(dy0 * x.to(dy0.dtype), axis=0)[None, :], 0.0)
        acc_b += tl.sum(dy0, axis=0)
    part = PART + (batch * n_groups + pid_g) * C * (K + 1)
    tl.store(part + c[None, :] * K + taps[:, None], acc_w, mask=(taps < K)[:, None] & mc[None, :])
    tl.store(part + C * K + c, acc_b, mask=mc)


#: programs along time in the backward at most (each stores one row of partial sums of dw and db, so at
#: long lengths a program walks several time tiles and that buffer stays small)
_MAX_GROUPS = 64


def _blocks(T: int, C: int, backward: bool = False) -> tuple[int, int]:
    """A 32 x 64 tile forward, 16 x 64 backward (which recomputes y for k shifted rows): no register spills
    on sm_80 / sm_90."""
    return min(16 if backward else 32, max(16, triton.next_power_of_2(T))), min(64, max(16, triton.next_power_of_2(C)))


class _CausalConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation: bool):
        Bsz, T, C = x.shape
        K = weight.shape[1]
        cd = compute_dtype(x.dtype)
        if x.stride(2) != 1:
            x = x.contiguous()
        w = weight.to(cd).contiguous()                         # (C, K)
        b = bias.to(cd).contiguous() if bias is not None else w
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        BT, BC = _blocks(T, C)
        launch(_conv_fwd, (triton.cdiv(C, BC), triton.cdiv(T, BT), Bsz), x, w, b, out, T, C, x.stride(0),
               x.stride(1), K=K, HAS_BIAS=bias is not None, ACT=activation, BT=BT, BC=BC)
        ctx.save_for_backward(x, w, b)
        ctx.has_bias, ctx.activation, ctx.K = bias is not None, activation, K
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, b = ctx.saved_tensors
        Bsz, T, C = x.shape
        K = ctx.K
        BT, BC = _blocks(T, C, backward=True)
        n_t = triton.cdiv(T, BT)
        tiles = triton.cdiv(n_t, _MAX_GROUPS)
        n_groups = triton.cdiv(n_t, tiles)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        part = w.new_empty(Bsz * n_groups, C * (K + 1))
        launch(_conv_bwd, (triton.cdiv(C, BC), n_groups, Bsz), x, w, b, dout.contiguous(), dx, part, T, C,
               x.stride(0), x.stride(1), n_groups, tiles, K=K, HAS_BIAS=ctx.has_bias, ACT=ctx.activation,
               BK=max(2, triton.next_power_of_2(K)), BT=BT, BC=BC)
        sums = part.sum(0)                                      # dw (C, K) row-major, then db (C)
        dw = sums[:C * K].view(C, K).to(ctx.dtypes[0])
        db = sums[C * K:].to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx, dw, db, None


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: bool = True) -> torch.Tensor:
    """Same contract as :func:`kernels.shortconv.reference.causal_conv_reference`."""
    return _CausalConvTriton.apply(x, weight, bias, activation)
