"""The causal depthwise short convolution (+ SiLU) in one Triton kernel forward and one backward.

Layout ``x (B, T, C)`` as the projections produce it (any batch and time strides: a column block of a
wider projection is read in place), ``weight (C, k)`` as the module holds it (the kernels read it transposed,
``(k, C)``: a tap's weights of a channel block in one vector load), ``k`` a compile-time constant; outputs are
contiguous (``dx`` may be written at its place in the gradient of the projection ``x`` was cut from,
:mod:`kernels.grad_slots`). One program per (channel block, time block, batch element):

- forward: ``y_t = b + sum_j w_j x_{t-(k-1)+j}`` from ``k`` shifted loads of its tile, ``out = SiLU(y)``
  (only ``out`` is stored; the backward recomputes ``y``);
- backward (``_conv_bwd``): ``g_r = dout_r SiLU'(y_r)`` (without the SiLU ``g = dout``) at the ``k`` rows
  ``r = t .. t + k - 1`` each token feeds, ``y_r`` recomputed from shifted loads of ``x`` (the cache serves all
  but the first), then ``dx_t = sum_s w_{k-1-s} g_{t+s}`` and the sums ``dw_j = sum_t g_t x_{t-(k-1)+j}``,
  ``db = sum_t g_t``: a program walks up to ``T / 64`` consecutive time tiles, accumulates ``g_t
  x_{t-(k-1)+j}`` elementwise (taps the leading axis of a 3-D tile) and sums over time once at its end,
  storing its share of ``dw`` and ``db`` (at most 64 shares per channel and batch element), summed afterwards
  in one reduction. Recomputing ``g`` costs ``k`` sigmoids and ``k^2`` cached loads an element, where a
  separate pass writing ``g`` and reading it back moved 8 more bytes an element through memory (fp32 ``g``)
  and took a second launch.

So a convolution is one launch forward and two backward (with the reduction) at every length (the CPU path of
:mod:`mixers.conv_time_first` makes ``k + 1`` passes per time block, blocks sized for a core's cache).

Arithmetic in fp32 (fp64 stays fp64); a depthwise filter has no product for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, compute_dtype, pow2
from ..grad_slots import empty_grad
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
        acc += x.to(acc.dtype) * tl.load(W + j * C + c, mask=mc, other=0.0)[None, :]
    return acc


@triton.jit
def _tile(C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's batch element, time rows, channels and channel mask (grid: channel blocks, time blocks,
    batch)."""
    batch = tl.program_id(2).to(tl.int64)
    t = (tl.program_id(1) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    return batch, t, c, c < C


@triton.jit
def _conv_fwd(X, W, B, OUT, T, C, sb, st, K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr):
    batch, t, c, mc = _tile(C, BT, BC)
    y = _preact(X + batch * sb, st, W, B, t, c, mc, T, C, K, HAS_BIAS, BT, BC)
    if ACT:
        y = y * tl.sigmoid(y)
    tl.store(OUT + batch * T * C + t[:, None] * C + c[None, :], y.to(OUT.dtype.element_ty),
             mask=(t < T)[:, None] & mc[None, :])


@triton.jit
def _grad_at(xb, st, W, B, ob, rows, c, mc, T, C, K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
             BT: tl.constexpr, BC: tl.constexpr):
    """``g = dL/dy`` at rows ``rows`` (zero at rows ``>= T``): ``dout SiLU'(y)`` with ``y`` recomputed, or ``dout``."""
    keep = (rows < T)[:, None] & mc[None, :]
    g = tl.load(ob + rows[:, None] * C + c[None, :], mask=keep, other=0.0).to(W.dtype.element_ty)
    if ACT:
        y = _preact(xb, st, W, B, rows, c, mc, T, C, K, HAS_BIAS, BT, BC)
        sig = tl.sigmoid(y)
        g = g * sig * (1.0 + y * (1.0 - sig))
    return g


@triton.jit
def _conv_bwd(X, W, B, DOUT, DX, PART, T, C, sb, st, sdb, sdt, n_groups, tiles, K: tl.constexpr, BK: tl.constexpr,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``dx`` of this program's time tiles and its share of ``dw`` and ``db`` from ``dout``: ``g_r = dL/dy_r``
    at the ``k`` rows ``r = t .. t + k - 1`` each token ``t`` feeds (``y_r`` recomputed from shifted loads of
    ``x``, which the cache serves), ``dx_t = sum_s w_{k-1-s} g_{t+s}``; and ``g_t x_{t-(k-1)+j}`` for ``dw_j``,
    taps the leading axis of a 3-D tile ``(BK, BT, BC)``, accumulated elementwise over the tiles and summed over
    time once, at the end."""
    pid_c = tl.program_id(0)
    pid_g = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    c = pid_c * BC + tl.arange(0, BC)
    mc = c < C
    taps = tl.arange(0, BK)
    tap3 = taps[:, None, None]
    c3 = c[None, None, :]
    on3 = (tap3 < K) & mc[None, None, :]
    wdt = W.dtype.element_ty
    xb = X + batch * sb
    ob = DOUT + batch * T * C
    acc_w = tl.zeros([BK, BT, BC], dtype=wdt)                                # g_t x_{t-(k-1)+j}, by j
    acc_b = tl.zeros([BT, BC], dtype=wdt)
    for it in range(tiles):                                                   # consecutive time tiles
        t = ((pid_g * tiles + it) * BT + tl.arange(0, BT)).to(tl.int64)
        g = _grad_at(xb, st, W, B, ob, t, c, mc, T, C, K, HAS_BIAS, ACT, BT, BC)
        dx = g * tl.load(W + (K - 1) * C + c, mask=mc, other=0.0)[None, :]
        for s in tl.static_range(1, K):
            dx += _grad_at(xb, st, W, B, ob, t + s, c, mc, T, C, K, HAS_BIAS, ACT, BT, BC) * \
                tl.load(W + (K - 1 - s) * C + c, mask=mc, other=0.0)[None, :]
        tl.store(DX + batch * sdb + t[:, None] * sdt + c[None, :], dx.to(DX.dtype.element_ty),
                 mask=(t < T)[:, None] & mc[None, :])
        src = t[None, :, None] - (K - 1) + tap3                               # the rows that fed token t
        x = tl.load(xb + src * st + c3, mask=on3 & (src >= 0) & (src < T), other=0.0).to(wdt)
        acc_w += g[None, :, :] * x
        acc_b += g
    part = PART + (batch * n_groups + pid_g) * C * (K + 1)
    tl.store(part + c[None, :] * K + taps[:, None], tl.sum(acc_w, axis=1), mask=(taps < K)[:, None] & mc[None, :])
    tl.store(part + C * K + c, tl.sum(acc_b, axis=0), mask=mc)


#: programs along time in the backward at most (each stores one row of partial sums of dw and db, so at
#: long lengths a program walks several time tiles and that buffer stays small)
_MAX_GROUPS = 64
#: time tiles a backward program walks at least, while the grid keeps ``_MIN_PROGRAMS``: each program ends with
#: a reduction over its rows across warps and a row of partial sums, which a program of one tile pays per tile
#: (on an H200, with the backward's 32-row tiles and ``g`` read from a separate pass, the language model's 16384
#: tokens a step over 1536 channels took 0.245 ms as 8 sequences of 2048, one tile a program, and 0.21 ms as 2 of
#: 8192, four tiles a program; a layer's 16384 x 3072, eight tiles a program, 0.37 ms: 7.4 ps an element against
#: 9.7)
_MIN_TILES = 4
_MIN_PROGRAMS = 1024


def _blocks(T: int, C: int, taps: int = 1) -> tuple[int, int]:
    """32 x 64 tiles in time x channels; the backward's 3-D tiles hold ``taps`` of them, so their time rows shrink
    (taps x rows <= 64; with 8 warps, 122 registers a thread on sm_90 at 4 taps, where 32 rows and 4 warps
    spilled): no register spills on sm_80 / sm_90."""
    rows = max(4, min(32, 64 // taps)) if taps > 1 else 32
    return min(rows, max(16, pow2(T))), min(64, max(16, pow2(C)))


#: warps of the backward's programs
_BWD_WARPS = 8


class _CausalConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation: bool):
        Bsz, T, C = x.shape
        K = weight.shape[1]
        cd = compute_dtype(x.dtype)
        if x.stride(2) != 1:
            x = x.contiguous()
        w = weight.to(cd).t().contiguous()                     # (K, C)
        b = bias.to(cd).contiguous() if bias is not None else w
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        BT, BC = _blocks(T, C)
        launch(_conv_fwd, (cdiv(C, BC), cdiv(T, BT), Bsz), x, w, b, out, T, C, x.stride(0),
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
        dout = dout.contiguous()
        BK = max(2, pow2(K))
        BT, BC = _blocks(T, C, BK)
        n_t = cdiv(T, BT)
        spread = cdiv(_MIN_PROGRAMS, cdiv(C, BC) * Bsz)          # programs along time the grid needs
        tiles = max(cdiv(n_t, _MAX_GROUPS), min(_MIN_TILES, cdiv(n_t, spread)))
        n_groups = cdiv(n_t, tiles)
        dx = empty_grad(x)          # in place in the gradient of the projection x was cut from, where it was
        part = w.new_empty(Bsz * n_groups, C * (K + 1))
        launch(_conv_bwd, (cdiv(C, BC), n_groups, Bsz), x, w, b, dout, dx, part, T, C, x.stride(0), x.stride(1),
               dx.stride(0), dx.stride(1), n_groups, tiles, K=K, BK=BK, HAS_BIAS=ctx.has_bias, ACT=ctx.activation,
               BT=BT, BC=BC, num_warps=_BWD_WARPS)
        sums = part.sum(0)                                      # dw (C, K) row-major, then db (C)
        dw = sums[:C * K].view(C, K).to(ctx.dtypes[0])
        db = sums[C * K:].to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx, dw, db, None


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: bool = True) -> torch.Tensor:
    """Same contract as :func:`kernels.shortconv.reference.causal_conv_reference`."""
    return _CausalConvTriton.apply(x, weight, bias, activation)
