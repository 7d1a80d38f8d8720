"""Fused recurrent Triton kernels for the block scans, forward and backward (torch.autograd.Functions).

One program per (batch element, block) walks the sequence, holding the block's ``m``-vector state in
registers (``m`` padded to the power of two ``BM``, a ``tl.constexpr``, with masks for other ``m``):

    dense  (arXiv:2602.12021):       h_t = A_t h_{t-1} + b_t
    Jordan (OpenReview 8Kg8lL3L58):  h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t,   (N h)_i = h_{i+1}
    normed Jordan:                   h_t = LN(lam_t h_{t-1} + c_t N h_{t-1} + b_t)   (per-block LayerNorm)

The forward stores every state ``h_t`` in the compute dtype (fp32, or fp64 for fp64 inputs). The
backward is the reverse loop with transposed transitions: with ``g`` the gradient w.r.t. ``h_t``
(output gradient plus what flows back from ``t + 1``),

    db_t = g,  dA_t = g h_{t-1}^T,  g <- A_t^T g                          (dense)
    dlam_t = g . h_{t-1},  dc_t = g . (N h_{t-1}),  g <- lam_t g + c_t N^T g  (Jordan)

and for the normed scan the LayerNorm is recomputed from the stored ``h_{t-1}`` and its Jacobian
applied first, ``dpre = rstd (dx - mean(dx) - xhat mean(dx xhat))`` with ``dx = g * weight``; the
weight and bias gradients are summed per program over time and over the batch in torch.

Everything accumulates in fp32 (bf16/fp16 inputs allowed) and the per-token work is ``O(m^2)``
(dense) or ``O(m)`` plus an ``m x m`` shift (Jordan). Expected GPU behaviour: time linear in ``T``
with ``B * N`` programs in flight, each a dependent chain of ``T`` small register operations and
loads of ``m^2`` (dense) or ``m + 2`` (Jordan) values per token, so throughput is bound by the
per-token latency when ``B * N`` is small; the chunked form is the one to write if that matters.
The normed scan is nonlinear, so this sequential kernel is its only fast form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import compute_dtype
from ..launch import launch

__all__ = ["block_scan_triton", "jordan_scan_triton", "jordan_scan_normed_triton"]


@triton.jit
def _shift_up(x, i, j):
    # (N x)_i = x_{i+1}: x indexed by j, result indexed by i
    s = (j[None, :] == i[:, None] + 1).to(x.dtype)
    return tl.sum(s * x[None, :], axis=1)


@triton.jit
def _shift_down(x, i, j):
    # (N^T x)_j = x_{j-1}: x indexed by i, result indexed by j
    s = (j[None, :] == i[:, None] + 1).to(x.dtype)
    return tl.sum(s * x[:, None], axis=0)


@triton.jit
def _block_fwd(A, Bv, H0, H, T, N, M, HAS_INIT: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // N
    n = pid % N
    i = tl.arange(0, BM)
    mi = i < M
    mij = mi[:, None] & mi[None, :]
    acc = H.dtype.element_ty
    if HAS_INIT:
        h = tl.load(H0 + pid * M + i, mask=mi, other=0.0).to(acc)
    else:
        h = tl.zeros([BM], dtype=acc)
    for t in range(T):
        row = (bi * T + t) * N + n
        a = tl.load(A + row * M * M + i[:, None] * M + i[None, :], mask=mij, other=0.0).to(acc)
        bv = tl.load(Bv + row * M + i, mask=mi, other=0.0).to(acc)
        h = tl.sum(a * h[None, :], axis=1) + bv
        tl.store(H + row * M + i, h, mask=mi)


@triton.jit
def _block_bwd(A, H0, H, DH, DHLAST, DA, DB, DH0, T, N, M,
               HAS_INIT: tl.constexpr, HAS_DLAST: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // N
    n = pid % N
    i = tl.arange(0, BM)
    mi = i < M
    mij = mi[:, None] & mi[None, :]
    acc = H.dtype.element_ty
    if HAS_INIT:
        h0 = tl.load(H0 + pid * M + i, mask=mi, other=0.0).to(acc)
    else:
        h0 = tl.zeros([BM], dtype=acc)
    if HAS_DLAST:
        g = tl.load(DHLAST + pid * M + i, mask=mi, other=0.0).to(acc)
    else:
        g = tl.zeros([BM], dtype=acc)
    for tt in range(T):
        t = T - 1 - tt
        row = (bi * T + t) * N + n
        g = g + tl.load(DH + row * M + i, mask=mi, other=0.0).to(acc)
        tl.store(DB + row * M + i, g.to(DB.dtype.element_ty), mask=mi)
        prev = (bi * T + tl.maximum(t - 1, 0)) * N + n
        hp = tl.load(H + prev * M + i, mask=mi & (t > 0), other=0.0).to(acc)
        hp = tl.where(t > 0, hp, h0)
        tl.store(DA + row * M * M + i[:, None] * M + i[None, :],
                 (g[:, None] * hp[None, :]).to(DA.dtype.element_ty), mask=mij)
        a = tl.load(A + row * M * M + i[:, None] * M + i[None, :], mask=mij, other=0.0).to(acc)
        g = tl.sum(a * g[:, None], axis=0)
    tl.store(DH0 + pid * M + i, g.to(DH0.dtype.element_ty), mask=mi)


@triton.jit
def _jordan_fwd(LAM, Cc, Bv, H0, H, W, BIAS, T, N, M, eps,
                HAS_INIT: tl.constexpr, NORMED: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // N
    n = pid % N
    i = tl.arange(0, BM)
    mi = i < M
    acc = H.dtype.element_ty
    if HAS_INIT:
        h = tl.load(H0 + pid * M + i, mask=mi, other=0.0).to(acc)
    else:
        h = tl.zeros([BM], dtype=acc)
    if NORMED:
        w = tl.load(W + n * M + i, mask=mi, other=0.0).to(acc)
        beta = tl.load(BIAS + n * M + i, mask=mi, other=0.0).to(acc)
    for t in range(T):
        row = (bi * T + t) * N + n
        lam = tl.load(LAM + row).to(acc)
        c = tl.load(Cc + row).to(acc)
        bv = tl.load(Bv + row * M + i, mask=mi, other=0.0).to(acc)
        h = lam * h + c * _shift_up(h, i, i) + bv
        if NORMED:
            mu = tl.sum(tl.where(mi, h, 0.0), axis=0) / M
            d = tl.where(mi, h - mu, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / M + eps)
            h = tl.where(mi, d * rstd * w + beta, 0.0)
        tl.store(H + row * M + i, h, mask=mi)


@triton.jit
def _jordan_bwd(LAM, Cc, Bv, H0, H, W, BIAS, DH, DHLAST, DLAM, DC, DB, DH0, DW, DBIAS, T, N, M, eps,
                HAS_INIT: tl.constexpr, HAS_DLAST: tl.constexpr, NORMED: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // N
    n = pid % N
    i = tl.arange(0, BM)
    mi = i < M
    mi1 = (i + 1) < M
    acc = H.dtype.element_ty
    if HAS_INIT:
        h0 = tl.load(H0 + pid * M + i, mask=mi, other=0.0).to(acc)
        h0s = tl.load(H0 + pid * M + i + 1, mask=mi1, other=0.0).to(acc)
    else:
        h0 = tl.zeros([BM], dtype=acc)
        h0s = tl.zeros([BM], dtype=acc)
    if HAS_DLAST:
        g = tl.load(DHLAST + pid * M + i, mask=mi, other=0.0).to(acc)
    else:
        g = tl.zeros([BM], dtype=acc)
    if NORMED:
        w = tl.load(W + n * M + i, mask=mi, other=0.0).to(acc)
        dw = tl.zeros([BM], dtype=acc)
        dbeta = tl.zeros([BM], dtype=acc)
    for tt in range(T):
        t = T - 1 - tt
        row = (bi * T + t) * N + n
        g = g + tl.load(DH + row * M + i, mask=mi, other=0.0).to(acc)
        prev = (bi * T + tl.maximum(t - 1, 0)) * N + n
        hp = tl.load(H + prev * M + i, mask=mi & (t > 0), other=0.0).to(acc)
        hps = tl.load(H + prev * M + i + 1, mask=mi1 & (t > 0), other=0.0).to(acc)
        hp = tl.where(t > 0, hp, h0)
        hps = tl.where(t > 0, hps, h0s)
        lam = tl.load(LAM + row).to(acc)
        c = tl.load(Cc + row).to(acc)
        if NORMED:
            bv = tl.load(Bv + row * M + i, mask=mi, other=0.0).to(acc)
            pre = lam * hp + c * hps + bv
            mu = tl.sum(tl.where(mi, pre, 0.0), axis=0) / M
            d = tl.where(mi, pre - mu, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / M + eps)
            xhat = d * rstd
            dw += g * xhat
            dbeta += g
            dx = tl.where(mi, g * w, 0.0)
            g = rstd * (dx - tl.sum(dx, axis=0) / M - xhat * (tl.sum(dx * xhat, axis=0) / M))
            g = tl.where(mi, g, 0.0)
        tl.store(DB + row * M + i, g.to(DB.dtype.element_ty), mask=mi)
        tl.store(DLAM + row, tl.sum(g * hp, axis=0).to(DLAM.dtype.element_ty))
        tl.store(DC + row, tl.sum(g * hps, axis=0).to(DC.dtype.element_ty))
        g = lam * g + c * _shift_down(g, i, i)
    tl.store(DH0 + pid * M + i, g.to(DH0.dtype.element_ty), mask=mi)
    if NORMED:
        tl.store(DW + pid * M + i, dw, mask=mi)
        tl.store(DBIAS + pid * M + i, dbeta, mask=mi)


def _block_m(m: int) -> int:
    return max(2, triton.next_power_of_2(m))


def _acc_dtype(*xs):
    dt = xs[0].dtype
    for x in xs[1:]:
        if x is not None:
            dt = torch.promote_types(dt, x.dtype)
    return compute_dtype(dt)


class _BlockScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, b, h0):
        Bsz, T, N, m = b.shape
        A, b = A.contiguous(), b.contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        H = torch.empty(Bsz, T, N, m, dtype=_acc_dtype(A, b, h0), device=b.device)
        launch(_block_fwd, (Bsz * N,), A, b, h0c if h0c is not None else H, H, T, N, m,
                               HAS_INIT=h0c is not None, BM=_block_m(m), num_warps=1)
        ctx.save_for_backward(A, h0c, H)
        ctx.dtypes = (A.dtype, b.dtype, None if h0 is None else h0.dtype)
        return H.to(b.dtype), H[:, -1].to(b.dtype, copy=True)

    @staticmethod
    def backward(ctx, dh, dlast):
        A, h0, H = ctx.saved_tensors
        Bsz, T, N, m = H.shape
        dh = torch.zeros_like(H) if dh is None else dh.contiguous()
        dA = torch.empty(A.shape, dtype=ctx.dtypes[0], device=A.device)
        db = torch.empty(H.shape, dtype=ctx.dtypes[1], device=A.device)
        dh0 = torch.empty(Bsz, N, m, dtype=H.dtype, device=A.device)
        launch(_block_bwd, (Bsz * N,), A, h0 if h0 is not None else H, H, dh,
                               dlast.contiguous() if dlast is not None else H, dA, db, dh0, T, N, m,
                               HAS_INIT=h0 is not None, HAS_DLAST=dlast is not None, BM=_block_m(m),
                               num_warps=1)
        return dA, db, (dh0.to(ctx.dtypes[2]) if h0 is not None else None)


class _JordanScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lam, c, b, h0, weight, bias, eps):
        Bsz, T, N, m = b.shape
        lam, c, b = lam.contiguous(), c.contiguous(), b.contiguous()
        normed = weight is not None
        h0c = h0.contiguous() if h0 is not None else None
        H = torch.empty(Bsz, T, N, m, dtype=_acc_dtype(lam, c, b, h0, weight, bias), device=b.device)
        dummy = H
        launch(_jordan_fwd, (Bsz * N,), lam, c, b, h0c if h0c is not None else dummy, H,
                                weight if normed else dummy, bias if normed else dummy, T, N, m, eps,
                                HAS_INIT=h0c is not None, NORMED=normed, BM=_block_m(m), num_warps=1)
        ctx.save_for_backward(lam, c, b if normed else None, h0c, H, weight, bias)
        ctx.eps = eps
        ctx.dtypes = (lam.dtype, c.dtype, b.dtype, None if h0 is None else h0.dtype)
        return H.to(b.dtype), H[:, -1].to(b.dtype, copy=True)

    @staticmethod
    def backward(ctx, dh, dlast):
        lam, c, b, h0, H, weight, bias = ctx.saved_tensors
        Bsz, T, N, m = H.shape
        normed = weight is not None
        dev = H.device
        dh = torch.zeros_like(H) if dh is None else dh.contiguous()
        dlam = torch.empty(Bsz, T, N, dtype=ctx.dtypes[0], device=dev)
        dc = torch.empty(Bsz, T, N, dtype=ctx.dtypes[1], device=dev)
        db = torch.empty(Bsz, T, N, m, dtype=ctx.dtypes[2], device=dev)
        dh0 = torch.empty(Bsz, N, m, dtype=H.dtype, device=dev)
        dw = torch.zeros(Bsz, N, m, dtype=H.dtype, device=dev) if normed else H
        dbias = torch.zeros(Bsz, N, m, dtype=H.dtype, device=dev) if normed else H
        launch(_jordan_bwd, (Bsz * N,), lam, c, b if normed else H, h0 if h0 is not None else H, H,
                                weight if normed else H, bias if normed else H, dh,
                                dlast.contiguous() if dlast is not None else H,
                                dlam, dc, db, dh0, dw, dbias, T, N, m, ctx.eps,
                                HAS_INIT=h0 is not None, HAS_DLAST=dlast is not None, NORMED=normed,
                                BM=_block_m(m), num_warps=1)
        dh0 = dh0.to(ctx.dtypes[3]) if h0 is not None else None
        if normed:
            return dlam, dc, db, dh0, dw.sum(0).to(weight.dtype), dbias.sum(0).to(bias.dtype), None
        return dlam, dc, db, dh0, None, None, None


def _empty_result(b, h0):
    Bsz, _, N, m = b.shape
    last = b.new_zeros(Bsz, N, m) if h0 is None else h0.to(b.dtype)
    return b.new_zeros(Bsz, 0, N, m), last


def block_scan_triton(A, b, initial_state=None):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))`` of ``h_t = A_t h_{t-1} + b_t``."""
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    return _BlockScan.apply(A, b, initial_state)


def jordan_scan_triton(lam, c, b, initial_state=None):
    """Returns ``(h, h_last)`` of ``h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t``; ``c`` broadcastable to
    ``lam``."""
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    c = torch.broadcast_to(c if torch.is_tensor(c) else torch.tensor(float(c), dtype=lam.dtype, device=lam.device),
                           lam.shape)
    return _JordanScan.apply(lam, c, b, initial_state, None, None, 0.0)


def jordan_scan_normed_triton(lam, c, b, weight, bias, eps: float = 1e-5, initial_state=None):
    """Returns ``(h, h_last)`` of ``h_t = LN(lam_t h_{t-1} + c_t N h_{t-1} + b_t)`` (per-block LayerNorm,
    ``weight``/``bias`` broadcastable to ``(N, m)``)."""
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    N, m = b.shape[-2:]
    c = torch.broadcast_to(c if torch.is_tensor(c) else torch.tensor(float(c), dtype=lam.dtype, device=lam.device),
                           lam.shape)
    weight = torch.broadcast_to(weight, (N, m)).contiguous()
    bias = torch.broadcast_to(bias, (N, m)).contiguous()
    return _JordanScan.apply(lam, c, b, initial_state, weight, bias, float(eps))
