"""The causal depthwise short convolution (+ SiLU) in one Triton kernel forward and one backward.

Layout ``x (B, T, C)`` as the projections produce it (any batch and time strides: a column block of a
wider projection is read in place), ``weight (C, k)`` as the module holds it (the kernels read it transposed,
``(k, C)``: a tap's weights of a channel block in one vector load), ``k`` a compile-time constant; outputs are
contiguous (``dx`` may be written at its place in the gradient of the projection ``x`` was cut from,
:mod:`kernels.grad_slots`). One program per (channel block, time block, batch element):

- forward: ``y_t = b + sum_j w_j x_{t-(k-1)+j}`` from ``k`` shifted loads of its tile, ``out = SiLU(y)``
  (only ``out`` is stored; the backward recomputes ``y``);
- backward (``_conv_bwd``): with ``g_r = dout_r SiLU'(y_r)`` (without the SiLU ``g = dout``),
  ``dx_t = sum_s w_{k-1-s} g_{t+s}``, ``dw_j = sum_t g_t x_{t-(k-1)+j}`` and ``db = sum_t g_t``. A program takes
  128 channels (one warp) and a run of time rows, which it walks one row at a time, keeping the last three rows of
  ``x`` and of ``g`` in registers: each row's ``y_r`` and ``g_r`` are computed once and ``x`` and ``dout`` read once
  (filters of fewer than 4 taps are padded on the left with zero taps; wider ones take ``_conv_bwd_wide``, which
  keeps the ``dx`` of the tokens in flight in a ring). Each program stores its share of ``dw`` and ``db``,
  summed afterwards in one reduction. A program's rows grow with the input so that the grid stays at about
  2048 programs. Earlier versions tiled time and recomputed ``g`` at the ``k`` rows each token feeds (``k``
  sigmoids and ``k^2`` loads an element, and a 3-D ``(taps, time, channels)`` tile of ``dw`` terms that crossed
  threads through shared memory every tile): compiled for sm_90 at 4 taps in bf16, its loop ran 175 instructions
  an element (8 of them on the special-function unit) where the walk runs 42 (2), with no barrier.

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
def _tap(W, C, c, mc, j: tl.constexpr, PAD: tl.constexpr):
    """Tap ``j`` of a filter padded on the left with ``PAD`` zero taps: ``w_{j - PAD}``, zeros where ``j < PAD``."""
    if j >= PAD:
        return tl.load(W + (j - PAD) * C + c, mask=mc, other=0.0)
    else:
        return tl.zeros(c.shape, dtype=W.dtype.element_ty)


@triton.jit
def _walk(X, DOUT, DX, T, C, sb, sdb, R, BC: tl.constexpr):
    """A backward program's batch element, channels and channel mask, its batch element's ``x``, ``dout`` and
    ``dx``, and its time rows ``[t0, t1)`` (grid: channel blocks, runs of ``R`` rows, batch)."""
    batch = tl.program_id(2).to(tl.int64)
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    t0 = tl.program_id(1) * R
    return batch, c, c < C, X + batch * sb, DOUT + batch * T * C, DX + batch * sdb, t0, tl.minimum(t0 + R, T)


@triton.jit
def _conv_bwd(X, W, B, DOUT, DX, PART, T, C, sb, st, sdb, sdt, R, n_iter, K: tl.constexpr, HAS_BIAS: tl.constexpr,
              ACT: tl.constexpr, BC: tl.constexpr, U: tl.constexpr):
    """The backward of a filter of at most 4 taps (padded on the left with zero taps to 4): ``dx`` of this
    program's ``R`` time rows ``[t0, t1)`` and its share of ``dw`` and ``db``, walking the rows one at a time
    (``U`` of them unrolled a step) with the last three rows of ``x`` and of ``g`` in registers, so that each
    row's ``y_r`` and ``g_r`` are computed once and ``x`` and ``dout`` are read once: ``dx`` of token ``r - 3``
    is complete at row ``r``. The 3 rows after ``t1`` are read for their ``g`` only."""
    batch, c, mc, xb, ob, xdb, t0, t1 = _walk(X, DOUT, DX, T, C, sb, sdb, R, BC)
    PAD: tl.constexpr = 4 - K
    w0 = _tap(W, C, c, mc, 0, PAD)
    w1 = _tap(W, C, c, mc, 1, PAD)
    w2 = _tap(W, C, c, mc, 2, PAD)
    w3 = _tap(W, C, c, mc, 3, PAD)
    wdt = W.dtype.element_ty
    bias = tl.load(B + c, mask=mc, other=0.0) if HAS_BIAS else tl.zeros([BC], dtype=wdt)
    x3 = tl.load(xb + (t0 - 3).to(tl.int64) * st + c, mask=mc & (t0 >= 3), other=0.0).to(wdt)   # x_{r-3}
    x2 = tl.load(xb + (t0 - 2).to(tl.int64) * st + c, mask=mc & (t0 >= 2), other=0.0).to(wdt)
    x1 = tl.load(xb + (t0 - 1).to(tl.int64) * st + c, mask=mc & (t0 >= 1), other=0.0).to(wdt)
    g3 = tl.zeros([BC], dtype=wdt)                                         # g_{r-3}, before t0 never read
    g2 = tl.zeros([BC], dtype=wdt)
    g1 = tl.zeros([BC], dtype=wdt)
    a0 = tl.zeros([BC], dtype=wdt)                                         # sum_r g_r x_{r-3+j}, by padded tap j
    a1 = tl.zeros([BC], dtype=wdt)
    a2 = tl.zeros([BC], dtype=wdt)
    a3 = tl.zeros([BC], dtype=wdt)
    ab = tl.zeros([BC], dtype=wdt)
    for it in range(n_iter):
        for u in tl.static_range(U):
            r = t0 + it * U + u
            row = r.to(tl.int64)
            x0 = tl.load(xb + row * st + c, mask=mc & (r < T), other=0.0).to(wdt)
            g0 = tl.load(ob + row * C + c, mask=mc & (r < T), other=0.0).to(wdt)
            if ACT:
                y = bias + w0 * x3 + w1 * x2 + w2 * x1 + w3 * x0
                sig = tl.sigmoid(y)
                g0 = g0 * sig * (1.0 + y * (1.0 - sig))
            mine = tl.where(r < t1, g0, 0.0)                               # rows from t1 on are the next program's
            a0 += mine * x3
            a1 += mine * x2
            a2 += mine * x1
            a3 += mine * x0
            ab += mine
            tau = r - 3
            dx = w3 * g3 + w2 * g2 + w1 * g1 + w0 * g0
            tl.store(xdb + tau.to(tl.int64) * sdt + c, dx.to(DX.dtype.element_ty), mask=mc & (tau >= t0) & (tau < t1))
            x3, x2, x1 = x2, x1, x0
            g3, g2, g1 = g2, g1, g0
    part = PART + (batch * tl.num_programs(1) + tl.program_id(1)) * C * (K + 1)
    if PAD < 1:
        tl.store(part + c * K + (0 - PAD), a0, mask=mc)
    if PAD < 2:
        tl.store(part + c * K + (1 - PAD), a1, mask=mc)
    if PAD < 3:
        tl.store(part + c * K + (2 - PAD), a2, mask=mc)
    tl.store(part + c * K + (3 - PAD), a3, mask=mc)
    tl.store(part + C * K + c, ab, mask=mc)


@triton.jit
def _conv_bwd_wide(X, W, B, DOUT, DX, PART, T, C, sb, st, sdb, sdt, R, n_rows, K: tl.constexpr, BK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BC: tl.constexpr):
    """The backward of a filter of more than 4 taps: as :func:`_conv_bwd`, with the rows of ``x`` that feed a row
    read as one ``(taps, channels)`` tile (the cache serves all but the newest), and the ``dx`` of the ``k`` tokens
    a row feeds held in a ring of ``BK`` slots (token ``tau`` in slot ``tau mod BK``), the oldest taken out
    and cleared when its last row has been seen."""
    batch, c, mc, xb, ob, xdb, t0, t1 = _walk(X, DOUT, DX, T, C, sb, sdb, R, BC)
    taps = tl.arange(0, BK)
    on = (taps < K)[:, None] & mc[None, :]
    wdt = W.dtype.element_ty
    w_tap = tl.load(W + taps[:, None] * C + c[None, :], mask=on, other=0.0)          # w_j at row j
    bias = tl.load(B + c, mask=mc, other=0.0) if HAS_BIAS else tl.zeros([BC], dtype=wdt)
    acc_w = tl.zeros([BK, BC], dtype=wdt)                                  # sum_r g_r x_{r-(k-1)+j}, by j
    acc_b = tl.zeros([BC], dtype=wdt)
    ring = tl.zeros([BK, BC], dtype=wdt)                                   # dx of the tokens in flight
    for i in range(n_rows):
        r = t0 + i
        src = r - (K - 1) + taps                                           # the rows of x that feed y_r
        x = tl.load(xb + src.to(tl.int64)[:, None] * st + c[None, :], mask=on & ((src >= 0) & (src < T))[:, None],
                    other=0.0).to(wdt)
        g = tl.load(ob + r.to(tl.int64) * C + c, mask=mc & (r < T), other=0.0).to(wdt)
        if ACT:
            y = tl.sum(w_tap * x, axis=0) + bias
            sig = tl.sigmoid(y)
            g = g * sig * (1.0 + y * (1.0 - sig))
        mine = tl.where(r < t1, g, 0.0)                                    # rows from t1 on are the next program's
        acc_w += mine[None, :] * x
        acc_b += mine
        back = (r - taps + BK) % BK                       # the token in slot i is this many rows back from r ...
        w_back = tl.load(W + (K - 1 - back)[:, None] * C + c[None, :], mask=(back < K)[:, None] & mc[None, :],
                         other=0.0)                       # ... and takes g_r through w_{k-1-back}
        ring += w_back * g[None, :]
        tau = r - (K - 1)                                                  # the token whose rows are all seen
        done = taps[:, None] == (tau + BK) % BK
        tl.store(xdb + tau.to(tl.int64) * sdt + c, tl.sum(tl.where(done, ring, 0.0), axis=0).to(DX.dtype.element_ty),
                 mask=mc & (tau >= t0) & (tau < t1))
        ring = tl.where(done, 0.0, ring)
    part = PART + (batch * tl.num_programs(1) + tl.program_id(1)) * C * (K + 1)
    tl.store(part + c[None, :] * K + taps[:, None], acc_w, mask=on)
    tl.store(part + C * K + c, acc_b, mask=mc)


def _blocks(T: int, C: int) -> tuple[int, int]:
    """The forward's 32 x 64 tiles in time x channels (smaller for short inputs)."""
    return min(32, max(16, pow2(T))), min(64, max(16, pow2(C)))


#: channels of a backward program (one warp): four a thread, each thread's rows in its own registers
_BWD_CHANNELS = 128
_BWD_WARPS = 1
#: programs the backward's grid aims at (the rows a program walks grow with the input to keep at most this many):
#: about 16 one-warp programs on each multiprocessor of an H100 / H200, which is what their registers hold at once
#: (120 a thread on sm_90)
_BWD_PROGRAMS = 2048
#: time rows a backward program walks at least: it reads 3 rows past its own for their ``g`` (``k - 1`` for wider
#: filters), so that share stays small
_MIN_ROWS = 32
#: elements of a ``(taps, channels)`` tile for filters of more than 4 taps (its channels shrink as its taps grow)
_WIDE_ELEMENTS = 512
#: rows a step of the backward's walk takes (their loads issued together)
_UNROLL = 4


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
        BC = min(_BWD_CHANNELS if K <= 4 else max(16, _WIDE_ELEMENTS // BK), max(16, pow2(C)))
        n_c = cdiv(C, BC)
        R = max(_MIN_ROWS, pow2(cdiv(Bsz * T * n_c, _BWD_PROGRAMS)))
        n_groups = cdiv(T, R)
        dx = empty_grad(x)          # in place in the gradient of the projection x was cut from, where it was
        part = w.new_empty(Bsz * n_groups, C * (K + 1))
        args = ((n_c, n_groups, Bsz), x, w, b, dout, dx, part, T, C, x.stride(0), x.stride(1), dx.stride(0),
                dx.stride(1), R)
        if K <= 4:
            launch(_conv_bwd, *args, cdiv(min(R, T) + 3, _UNROLL), K=K, HAS_BIAS=ctx.has_bias, ACT=ctx.activation,
                   BC=BC, U=_UNROLL, num_warps=_BWD_WARPS)
        else:
            launch(_conv_bwd_wide, *args, min(R, T) + K - 1, K=K, BK=BK, HAS_BIAS=ctx.has_bias,
                   ACT=ctx.activation, BC=BC, num_warps=_BWD_WARPS)
        sums = part.sum(0)                                      # dw (C, K) row-major, then db (C)
        dw = sums[:C * K].view(C, K).to(ctx.dtypes[0])
        db = sums[C * K:].to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx, dw, db, None


def causal_conv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: bool = True) -> torch.Tensor:
    """Same contract as :func:`kernels.shortconv.reference.causal_conv_reference`."""
    return _CausalConvTriton.apply(x, weight, bias, activation)
