"""The causal depthwise short convolution (+ SiLU) behind :class:`mixers.layers.ShortConv`, computed in the
time-first layout ``(B, T, C)`` the projections produce.

``conv1d`` wants ``(B, C, T)``; on a CPU the strided copies to that layout and back (forward and backward)
cost more than the convolution itself, and its CPU backward is slow. Here the ``k``-tap causal filter is
``k`` shifted multiply-adds on the contiguous time-first tensor,

    y_t = b + sum_{j=0}^{k-1} w_j x_{t-(k-1)+j}      (x_s = 0 for s < 0),     out = SiLU(y) (optional),

with a hand-written backward (``dx_s = sum_j w_j dy_{s+(k-1)-j}``, ``dw_j = sum_t dy_t x_{t-(k-1)+j}``,
``db = sum_t dy_t``) so autograd does not materialise a full-size gradient per shifted slice.

That is the CPU plan (:func:`kernels.device.plan_for`), run in time blocks sized for a core's L2 cache. On
the GPU plan every such pass would be one kernel launch per block (hundreds at 16K tokens), so there the
convolution is :func:`kernels.shortconv.causal_conv`'s Triton kernels (one launch forward, one plus a
reduction backward), or these passes over the whole tensor at once where Triton cannot run.
"""
from __future__ import annotations

import torch

from kernels.backend import triton_pieces_for
from kernels.device import plan_for
from kernels.shortconv import causal_conv

#: elements of one time block on the CPU plan: every pass below runs block by block so its operands stay in
#: a core's L2 cache across the k taps (on a CPU a (T, C) tensor of a long sequence does not fit)
_BLOCK_ELEMENTS = 1 << 18


def _blocks(T: int, C: int, one_pass: bool):
    if one_pass:
        return [(0, T)]
    rows = max(16, _BLOCK_ELEMENTS // max(C, 1))
    return [(t, min(t + rows, T)) for t in range(0, T, rows)]


class _CausalConvTimeFirst(torch.autograd.Function):
    # tap j reads x_{t-m} with m = k-1-j (the shift); rows t < m read the zero padding and are skipped
    @staticmethod
    def forward(ctx, x, w, b, activation: bool, one_pass: bool):
        # x (B, T, C), w (C, k), b (C) or None
        B, T, C = x.shape
        k = w.shape[1]
        w = w.t().contiguous()                                     # (k, C): each tap a contiguous row
        y = x.new_empty(B, T, C)
        out = x.new_empty(B, T, C) if activation else y
        for t0, t1 in _blocks(T, C, one_pass):
            yb = y[:, t0:t1]
            if b is None:
                torch.mul(x[:, t0:t1], w[k - 1], out=yb)
            else:
                torch.addcmul(b, x[:, t0:t1], w[k - 1], out=yb)
            for j in range(k - 1):
                m = k - 1 - j
                lo = max(t0, m)
                if lo < t1:
                    y[:, lo:t1].addcmul_(x[:, lo - m:t1 - m], w[j])
            if activation:
                torch.ops.aten.silu.out(yb, out=out[:, t0:t1])
        ctx.activation, ctx.has_bias, ctx.one_pass = activation, b is not None, one_pass
        ctx.save_for_backward(x, w, y)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, y = ctx.saved_tensors                                # w (k, C)
        k = w.shape[0]
        B, T, C = y.shape
        if ctx.activation:
            dy = torch.ops.aten.silu_backward(dout, y)
        else:
            dy = dout.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = y.new_empty(B, T, C) if need_x else None
        dw = w.new_zeros(k, C) if need_w else None
        for t0, t1 in _blocks(T, C, ctx.one_pass):
            if need_x:                                             # dx_s = sum_j w_j dy_{s+m}, s + m < T
                torch.mul(dy[:, t0:t1], w[k - 1], out=dx[:, t0:t1])
                for j in range(k - 1):
                    m = k - 1 - j
                    hi = min(t1, T - m)
                    if t0 < hi:
                        dx[:, t0:hi].addcmul_(dy[:, t0 + m:hi + m], w[j])
            if need_w:                                             # dw_j = sum_{t >= m} dy_t x_{t-m}
                for j in range(k):
                    m = k - 1 - j
                    lo = max(t0, m)
                    if lo < t1:
                        dw[j] += (dy[:, lo:t1] * x[:, lo - m:t1 - m]).sum((0, 1))
        db = dy.sum((0, 1)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None if dw is None else dw.t(), db, None, None


def causal_conv_time_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           activation: bool = True) -> torch.Tensor:
    """Causal depthwise conv of ``x (B, T, C)`` with ``weight (C, k)`` and ``bias (C)`` (or None), then SiLU
    if ``activation``; returns ``(B, T, C)``."""
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv_time_first: expected x (B, T, C) and weight (C, k) with the same C, got "
                         f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if triton_pieces_for(x):
        return causal_conv(x, weight, bias, activation, backend="triton")
    return _CausalConvTimeFirst.apply(x.contiguous(), weight, bias, activation, plan_for(x).one_pass)


def short_conv_time_first(convs, x: torch.Tensor) -> torch.Tensor:
    """``cat([c(x_i) for c, x_i in zip(convs, split(x))], -1)`` for :class:`mixers.layers.ShortConv` modules
    ``convs`` (one module or a sequence of them, same kernel size and activation) applied to consecutive
    channel blocks of ``x (B, T, sum of their channels)``: one pass over ``x``, no layout copies."""
    convs = [convs] if not isinstance(convs, (list, tuple)) else list(convs)
    sizes = {(c.kernel_size, c.activation) for c in convs}
    if len(sizes) != 1:
        raise ValueError("short_conv_time_first: the convolutions must share kernel size and activation")
    channels = sum(c.channels for c in convs)
    if x.ndim != 3 or x.shape[-1] != channels:
        raise ValueError(f"short_conv_time_first: expected x of shape (B, T, {channels}), got {tuple(x.shape)}")
    if len(convs) == 1:
        w, b = convs[0].conv.weight.squeeze(1), convs[0].conv.bias        # (C, 1, k) -> (C, k)
    else:
        w = torch.cat([c.conv.weight.squeeze(1) for c in convs], dim=0)
        b = torch.cat([c.conv.bias for c in convs], dim=0)
    return causal_conv_time_first(x, w, b, convs[0].activation)
