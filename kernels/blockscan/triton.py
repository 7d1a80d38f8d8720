"""Triton kernels for the block scans, forward and backward (torch.autograd.Functions).

    dense  (arXiv:2602.12021):       h_t = A_t h_{t-1} + b_t                        A_t (m, m)
    Jordan (OpenReview 8Kg8lL3L58):  h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t,      (N h)_i = h_{i+1}
    normed Jordan:                   h_t = LN(lam_t h_{t-1} + c_t N h_{t-1} + b_t)   (per-block LayerNorm)

**The linear scans are chunk-parallel**: three launches forward and three backward, whatever ``T``. Time is
cut into chunks of ``C`` tokens (``chunk_size``) and a program owns a tile of ``BN`` blocks of one chunk of
one batch element (the ``m``-vectors of a tile sit in registers, ``m`` padded to the power of two ``BM``):

1. ``LOCAL`` pass (``_dense_fwd`` / ``_dense_local_mm`` / ``_jordan_fwd``): every chunk from a zero state,
   giving its local state ``l_c`` and its transition ``P_c = A_last ... A_first``. Dense: ``P`` is
   multiplied step by step (``m^3`` per token). Jordan: every factor is a polynomial in ``N`` (``N^m = 0``),
   so ``P`` is ``sum_j e_j N^j`` and a step updates its ``m`` coefficients, ``e_j <- lam e_j + c e_{j-1}``;
   the upper-triangular Toeplitz matrix ``P[i, k] = e_{k-i}`` is formed once per chunk.
2. ``_carry``: one program per (batch element, block tile) walks the ``T / C`` chunks,
   ``X_{c+1} = P_c X_c + l_c``, recording the state entering every chunk.
3. the chunk kernels again, each chunk rerun from its true start state, storing every ``h_t``.

The backward is the same scheme on the adjoint ``lam_t = g_t + A_{t+1}^T lam_{t+1}`` (``g_t = dL/dh_t``), a
reverse linear scan whose chunk transition is ``P_c^T`` (saved by the forward): local adjoints from zero
(``_dense_bwd`` / ``_jordan_bwd`` with ``LOCAL``), ``_carry`` reversed, then every chunk backwards from its
true adjoint writing ``db_t = lam_t``, ``dA_t = lam_t h_{t-1}^T`` (dense) or ``dlam_t = lam_t . h_{t-1}``,
``dc_t = lam_t . N h_{t-1}`` (Jordan) from the states ``h`` the forward stored (fp32; fp64 for fp64).

Rerun or fix-up. Instead of rerunning a chunk (step 3), the first pass could store the running ``P_t`` and
``l_t`` of every token and a fix-up pass add ``P_t X_c``. Per token and block, both read ``2 (m^2 + m)``
values (dense) and do the same ``m^3 + 2 m^2`` multiply-adds, but the fix-up also writes ``P_t, l_t``:
``m^2 + m`` more values, as much as the input ``A_t`` itself (total writes ``m^2 + 2m`` against ``m``:
3 against 1 at m = 1, 24 / 4 at m = 4, 80 / 8 at m = 8, 288 / 16 at m = 16, 1088 / 32 at m = 32). For Jordan
the rerun reads ``lam, c, b`` (``m + 2``) again and does ``3m`` work per token; the fix-up would write and
read back ``e_t, l_t`` (``2m``) and do ``m^2 / 2`` work per token in ``P_t X_c``. The rerun wins for every
``m``; it is what these kernels do.

Products. The one matrix-matrix product of these scans is the dense chunk transition ``P <- A_t P``
(``m x m x m`` per token). For ``m >= 16`` it is a ``tl.dot`` (``_dense_local_mm``: one block per program):
fp32 inputs multiply exactly (``input_precision="ieee"``); bf16/fp16 ``A_t`` is exact in its own type and
``P`` stays an fp32 state, fed to the tensor cores as two 16-bit tiles (:mod:`kernels.split_dot`,
about 16 bits of ``P`` in bf16, 22 in fp16; fp16 needs the chunk's ``P`` below 65504 per tile after a
power-of-two scaling, which the scaling guarantees). For ``m < 16`` the product is below a tensor-core tile
(an ``mma`` is 16 x 8 x 16 for 16-bit operands): at m = 4 it is 4 x 4 x 4 = 64 multiply-adds, padding to
16 x 16 x 16 would do 64x the work and packing four blocks into a block-diagonal 16 x 16 tile 4x (the
off-diagonal blocks are zeros), so it runs as register multiply-adds on ``[BN, m, m, m]`` tiles. Everything
else is a mat-vec (``A_t h``: one column), an outer product (``dA_t = lam_t h_{t-1}^T``: inner dimension 1)
or, for Jordan, ``O(m)`` vector work: no product of tensor-core shape exists there. (A product form of the
Jordan chunk, ``h_t = sum_j sum_s E_j(s, t) b_s`` shifted by ``j``, costs about ``C`` times more and needs
the coefficients ``E_j``, elementary symmetric functions of ``c_r / lam_r``, which lose precision for small
``lam``.)

**The normed scan is sequential** (``_normed_fwd`` / ``_normed_bwd``). ``LN`` is not affine in the state,
so two steps do not compose into one ``h -> P h + l`` and no chunk summary exists: each (batch element,
block) is one chain of ``T`` dependent steps, ``B N`` chains in all, and that is its parallelism. What can
be cut is a step's latency: a one-warp program packs ``32 / m`` blocks (an entry per lane), and its loop
issues the loads of later steps ahead (``tl.range`` with ``num_stages``, copied asynchronously), so a step
costs its arithmetic and not a global-memory round trip.

Parallelism at B = 1, d_model 1024 (N = 256 blocks of m = 4), T = 16384, C = 64: the chunk passes run
``4 x 256 = 1024`` programs of 64 blocks (a chunk each) and the carry 8 programs of 32 blocks walking 256
chunks, where the sequential kernels ran 256 one-warp programs walking 16384 tokens; the normed scan runs
32 programs of 8 chains.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_state, cdiv, compute_dtype, pow2, state_dtype
from ..launch import launch
from ..split_dot import dot_x_state

__all__ = ["block_scan_triton", "jordan_scan_triton", "jordan_scan_normed_triton", "CHUNK"]

#: default chunk length of the chunk-parallel scans
CHUNK = 64
#: loads issued ahead by the time loops (tl.range num_stages)
_STAGES = 3


@triton.jit
def _shift_up(x, S):
    # (N x)_i = x_{i+1} along the last axis of x [BN, BM]; S[i, j] = (j == i + 1)
    return tl.sum(S[None, :, :] * x[:, None, :], axis=2)


@triton.jit
def _shift_down(x, S):
    # (N^T x)_j = x_{j-1}
    return tl.sum(S[None, :, :] * x[:, :, None], axis=1)


@triton.jit
def _dense_fwd(A, Bv, XS, P, L, H, T, N, M, C, NC, sAb, sAt,
               LOCAL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # LOCAL: the chunk from zero -> (P_c, l_c); else: the chunk from XS[c], storing every h_t in H
    c = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, BM)
    m2 = (n < N)[:, None] & (i < M)[None, :]
    m3 = m2[:, :, None] & (i < M)[None, None, :]
    o2 = n[:, None] * M + i[None, :]
    o3 = o2[:, :, None] * M + i[None, None, :]
    acc = XS.dtype.element_ty
    steps = tl.minimum(C, T - c * C)
    t0 = c.to(tl.int64) * C
    a_ptr = A + b * sAb + t0 * sAt
    row0 = (b * T + t0) * N * M
    chunk = (b * NC + c) * N * M
    if LOCAL:
        h = tl.zeros([BN, BM], dtype=acc)
        p = tl.zeros([BN, BM, BM], dtype=acc) + (i[:, None] == i[None, :]).to(acc)[None, :, :]
    else:
        h = tl.load(XS + chunk + o2, mask=m2, other=0.0)
    for tt in tl.range(0, steps, num_stages=NS):
        a = tl.load(a_ptr + tt * sAt + o3, mask=m3, other=0.0).to(acc)
        bv = tl.load(Bv + row0 + tt * N * M + o2, mask=m2, other=0.0).to(acc)
        h = tl.sum(a * h[:, None, :], axis=2) + bv
        if LOCAL:
            p = tl.sum(a[:, :, :, None] * p[:, None, :, :], axis=2)
        else:
            tl.store(H + row0 + tt * N * M + o2, h, mask=m2)
    if LOCAL:
        tl.store(P + chunk * M + o3, p, mask=m3)
        tl.store(L + chunk + o2, h, mask=m2)


@triton.jit
def _dense_local_mm(A, Bv, P, L, T, N, M, C, NC, sAb, sAt, BM: tl.constexpr, NS: tl.constexpr):
    # the LOCAL pass for m >= 16, one block per program: P <- A_t P as a tl.dot (see the module docstring)
    c = tl.program_id(0)
    n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, BM)
    mi = i < M
    m2 = mi[:, None] & mi[None, :]
    o2 = i[:, None] * M + i[None, :]
    acc = P.dtype.element_ty
    steps = tl.minimum(C, T - c * C)
    t0 = c.to(tl.int64) * C
    a_ptr = A + b * sAb + t0 * sAt + n * M * M
    b_ptr = Bv + ((b * T + t0) * N + n) * M
    h = tl.zeros([BM], dtype=acc)
    p = (i[:, None] == i[None, :]).to(acc)
    for tt in tl.range(0, steps, num_stages=NS):
        a = tl.load(a_ptr + tt * sAt + o2, mask=m2, other=0.0)
        bv = tl.load(b_ptr + tt * N * M + i, mask=mi, other=0.0).to(acc)
        h = tl.sum(a.to(acc) * h[None, :], axis=1) + bv
        p = dot_x_state(a, p)
    chunk = ((b * NC + c) * N + n) * M
    tl.store(P + chunk * M + o2, p, mask=m2)
    tl.store(L + chunk + i, h, mask=mi)


@triton.jit
def _carry(P, L, X0, XS, XN, N, M, NC, HAS_X0: tl.constexpr, REVERSE: tl.constexpr,
           BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # forward: XS[c] = X_c, X_{c+1} = P_c X_c + L_c; REVERSE: XS[c] = G_{c+1}, G_c = P_c^T G_{c+1} + L_c.
    # XN receives the state after the last step (X_NC, or G_0 = the initial state's gradient)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BM)
    m2 = (n < N)[:, None] & (i < M)[None, :]
    m3 = m2[:, :, None] & (i < M)[None, None, :]
    o2 = n[:, None] * M + i[None, :]
    o3 = o2[:, :, None] * M + i[None, None, :]
    acc = XS.dtype.element_ty
    if HAS_X0:
        x = tl.load(X0 + b * N * M + o2, mask=m2, other=0.0).to(acc)
    else:
        x = tl.zeros([BN, BM], dtype=acc)
    for k in tl.range(0, NC, num_stages=NS):
        if REVERSE:
            c = NC - 1 - k
        else:
            c = k
        chunk = (b * NC + c) * N * M
        p = tl.load(P + chunk * M + o3, mask=m3, other=0.0)
        lc = tl.load(L + chunk + o2, mask=m2, other=0.0)
        tl.store(XS + chunk + o2, x, mask=m2)
        if REVERSE:
            x = tl.sum(p * x[:, :, None], axis=1) + lc
        else:
            x = tl.sum(p * x[:, None, :], axis=2) + lc
    tl.store(XN + b * N * M + o2, x, mask=m2)


@triton.jit
def _dense_bwd(A, XS, H, DH, GS, LOC, DA, DB, T, N, M, C, NC, sAb, sAt,
               LOCAL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # the chunk backwards; LOCAL: from a zero adjoint -> LOC[c] (what flows out of the chunk); else from GS[c],
    # writing db_t = lam_t and dA_t = lam_t h_{t-1}^T
    c = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, BM)
    m2 = (n < N)[:, None] & (i < M)[None, :]
    m3 = m2[:, :, None] & (i < M)[None, None, :]
    o2 = n[:, None] * M + i[None, :]
    o3 = o2[:, :, None] * M + i[None, None, :]
    acc = H.dtype.element_ty
    steps = tl.minimum(C, T - c * C)
    t0 = c.to(tl.int64) * C
    a_ptr = A + b * sAb + t0 * sAt
    row0 = (b * T + t0) * N * M
    chunk = (b * NC + c) * N * M
    if LOCAL:
        g = tl.zeros([BN, BM], dtype=acc)
    else:
        g = tl.load(GS + chunk + o2, mask=m2, other=0.0)
    for k in tl.range(0, steps, num_stages=NS):
        tt = steps - 1 - k
        row = row0 + tt * N * M
        g = g + tl.load(DH + row + o2, mask=m2, other=0.0).to(acc)
        a = tl.load(a_ptr + tt * sAt + o3, mask=m3, other=0.0).to(acc)
        if not LOCAL:
            tl.store(DB + row + o2, g.to(DB.dtype.element_ty), mask=m2)
            hp = (tl.load(H + row - N * M + o2, mask=m2 & (tt > 0), other=0.0)
                  + tl.load(XS + chunk + o2, mask=m2 & (tt == 0), other=0.0))
            tl.store(DA + row * M + o3, (g[:, :, None] * hp[:, None, :]).to(DA.dtype.element_ty), mask=m3)
        g = tl.sum(a * g[:, :, None], axis=1)
    if LOCAL:
        tl.store(LOC + chunk + o2, g, mask=m2)


@triton.jit
def _jordan_fwd(LAM, CC, Bv, XS, P, L, H, T, N, M, C, NC, scb, sct, scn,
                LOCAL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # LOCAL: the chunk from zero -> (P_c = sum_j e_j N^j as a dense m x m tile, l_c); else: from XS[c], storing h_t
    c = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, BM)
    mn = n < N
    m2 = mn[:, None] & (i < M)[None, :]
    o2 = n[:, None] * M + i[None, :]
    acc = XS.dtype.element_ty
    S = (i[None, :] == i[:, None] + 1).to(acc)
    steps = tl.minimum(C, T - c * C)
    t0 = c.to(tl.int64) * C
    lam_ptr = LAM + (b * T + t0) * N + n
    c_ptr = CC + b * scb + t0 * sct + n * scn
    row0 = (b * T + t0) * N * M
    chunk = (b * NC + c) * N * M
    if LOCAL:
        h = tl.zeros([BN, BM], dtype=acc)
        e = tl.zeros([BN, BM], dtype=acc) + (i == 0).to(acc)[None, :]
    else:
        h = tl.load(XS + chunk + o2, mask=m2, other=0.0)
    for tt in tl.range(0, steps, num_stages=NS):
        lam = tl.load(lam_ptr + tt * N, mask=mn, other=0.0).to(acc)[:, None]
        cc = tl.load(c_ptr + tt * sct, mask=mn, other=0.0).to(acc)[:, None]
        bv = tl.load(Bv + row0 + tt * N * M + o2, mask=m2, other=0.0).to(acc)
        h = lam * h + cc * _shift_up(h, S) + bv
        if LOCAL:
            e = lam * e + cc * _shift_down(e, S)
        else:
            tl.store(H + row0 + tt * N * M + o2, h, mask=m2)
    if LOCAL:
        m3 = m2[:, :, None] & (i < M)[None, None, :]
        lag = i[None, :] - i[:, None]  # k - i
        p = tl.zeros([BN, BM, BM], dtype=acc)
        for j in range(M):
            ej = tl.sum(tl.where(i[None, :] == j, e, 0.0), axis=1)
            p += ej[:, None, None] * (lag == j).to(acc)[None, :, :]
        tl.store(P + chunk * M + o2[:, :, None] * M + i[None, None, :], p, mask=m3)
        tl.store(L + chunk + o2, h, mask=m2)


@triton.jit
def _jordan_bwd(LAM, CC, XS, H, DH, GS, LOC, DLAM, DC, DB, T, N, M, C, NC, scb, sct, scn,
                LOCAL: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # the chunk backwards (see _dense_bwd): g <- lam g + c N^T g; dlam_t = g . h_{t-1}, dc_t = g . N h_{t-1}
    c = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, BM)
    mn = n < N
    m2 = mn[:, None] & (i < M)[None, :]
    m2s = mn[:, None] & (i + 1 < M)[None, :]
    o2 = n[:, None] * M + i[None, :]
    acc = H.dtype.element_ty
    S = (i[None, :] == i[:, None] + 1).to(acc)
    steps = tl.minimum(C, T - c * C)
    t0 = c.to(tl.int64) * C
    lam_ptr = LAM + (b * T + t0) * N + n
    c_ptr = CC + b * scb + t0 * sct + n * scn
    tok0 = (b * T + t0) * N
    chunk = (b * NC + c) * N * M
    if LOCAL:
        g = tl.zeros([BN, BM], dtype=acc)
    else:
        g = tl.load(GS + chunk + o2, mask=m2, other=0.0)
    for k in tl.range(0, steps, num_stages=NS):
        tt = steps - 1 - k
        tok = tok0 + tt * N
        g = g + tl.load(DH + tok * M + o2, mask=m2, other=0.0).to(acc)
        lam = tl.load(lam_ptr + tt * N, mask=mn, other=0.0).to(acc)
        cc = tl.load(c_ptr + tt * sct, mask=mn, other=0.0).to(acc)
        if not LOCAL:
            tl.store(DB + tok * M + o2, g.to(DB.dtype.element_ty), mask=m2)
            prev = (tok - N) * M + o2
            hp = (tl.load(H + prev, mask=m2 & (tt > 0), other=0.0)
                  + tl.load(XS + chunk + o2, mask=m2 & (tt == 0), other=0.0))
            hps = (tl.load(H + prev + 1, mask=m2s & (tt > 0), other=0.0)
                   + tl.load(XS + chunk + o2 + 1, mask=m2s & (tt == 0), other=0.0))
            tl.store(DLAM + tok + n, tl.sum(g * hp, axis=1).to(DLAM.dtype.element_ty), mask=mn)
            tl.store(DC + tok + n, tl.sum(g * hps, axis=1).to(DC.dtype.element_ty), mask=mn)
        g = tl.where(m2, lam[:, None] * g + cc[:, None] * _shift_down(g, S), 0.0)
    if LOCAL:
        tl.store(LOC + chunk + o2, g, mask=m2)


@triton.jit
def _normed_fwd(LAM, CC, Bv, H0, W, BIAS, H, T, N, M, scb, sct, scn, eps,
                HAS_INIT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, NS: tl.constexpr):
    # sequential: one chain of T steps per block, BN blocks per program
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BM)
    mn = n < N
    m2 = mn[:, None] & (i < M)[None, :]
    o2 = n[:, None] * M + i[None, :]
    acc = H.dtype.element_ty
    S = (i[None, :] == i[:, None] + 1).to(acc)
    if HAS_INIT:
        h = tl.load(H0 + b * N * M + o2, mask=m2, other=0.0).to(acc)
    else:
        h = tl.zeros([BN, BM], dtype=acc)
    w = tl.load(W + o2, mask=m2, other=0.0).to(acc)
    beta = tl.load(BIAS + o2, mask=m2, other=0.0).to(acc)
    lam_ptr = LAM + b * T * N + n
    c_ptr = CC + b * scb + n * scn
    row0 = b * T * N * M
    # int64 strides, as t * N M can pass 2^31 (b * 0 + x: also when the launch made x = 1 a constant)
    n64, nm64, sct64 = b * 0 + N, b * 0 + N * M, b * 0 + sct
    for t in tl.range(0, T, num_stages=NS):
        lam = tl.load(lam_ptr + t * n64, mask=mn, other=0.0).to(acc)[:, None]
        cc = tl.load(c_ptr + t * sct64, mask=mn, other=0.0).to(acc)[:, None]
        bv = tl.load(Bv + row0 + t * nm64 + o2, mask=m2, other=0.0).to(acc)
        x = lam * h + cc * _shift_up(h, S) + bv
        mu = tl.sum(x, axis=1) / M
        d = tl.where(m2, x - mu[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / M + eps)
        h = tl.where(m2, d * rstd[:, None] * w + beta, 0.0)
        tl.store(H + row0 + t * nm64 + o2, h, mask=m2)


@triton.jit
def _normed_bwd(LAM, CC, Bv, H0, H, W, DH, DHLAST, DLAM, DC, DB, DH0, DW, DBIAS, T, N, M, scb, sct, scn, eps,
                HAS_INIT: tl.constexpr, HAS_DLAST: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                NS: tl.constexpr):
    # the reverse chain: the pre-norm state is recomputed from the stored h_{t-1}, then
    # dpre = rstd (dx - mean(dx) - xhat mean(dx xhat)) with dx = g * weight, then g <- lam dpre + c N^T dpre
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BM)
    mn = n < N
    m2 = mn[:, None] & (i < M)[None, :]
    m2s = mn[:, None] & (i + 1 < M)[None, :]
    o2 = n[:, None] * M + i[None, :]
    acc = H.dtype.element_ty
    S = (i[None, :] == i[:, None] + 1).to(acc)
    state = b * N * M + o2
    if HAS_DLAST:
        g = tl.load(DHLAST + state, mask=m2, other=0.0).to(acc)
    else:
        g = tl.zeros([BN, BM], dtype=acc)
    w = tl.load(W + o2, mask=m2, other=0.0).to(acc)
    dw = tl.zeros([BN, BM], dtype=acc)
    dbeta = tl.zeros([BN, BM], dtype=acc)
    lam_ptr = LAM + b * T * N + n
    c_ptr = CC + b * scb + n * scn
    tok0 = b * T * N
    n64, sct64 = b * 0 + N, b * 0 + sct  # int64 (see _normed_fwd)
    for k in tl.range(0, T, num_stages=NS):
        t = T - 1 - k
        tok = tok0 + t * n64
        g = g + tl.load(DH + tok * M + o2, mask=m2, other=0.0).to(acc)
        prev = (tok - N) * M + o2
        hp = tl.load(H + prev, mask=m2 & (t > 0), other=0.0)
        hps = tl.load(H + prev + 1, mask=m2s & (t > 0), other=0.0)
        if HAS_INIT:
            hp += tl.load(H0 + state, mask=m2 & (t == 0), other=0.0).to(acc)
            hps += tl.load(H0 + state + 1, mask=m2s & (t == 0), other=0.0).to(acc)
        lam = tl.load(lam_ptr + t * n64, mask=mn, other=0.0).to(acc)
        cc = tl.load(c_ptr + t * sct64, mask=mn, other=0.0).to(acc)
        bv = tl.load(Bv + tok * M + o2, mask=m2, other=0.0).to(acc)
        pre = lam[:, None] * hp + cc[:, None] * hps + bv
        mu = tl.sum(pre, axis=1) / M
        d = tl.where(m2, pre - mu[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / M + eps)
        xhat = d * rstd[:, None]
        dw += g * xhat
        dbeta += g
        dx = tl.where(m2, g * w, 0.0)
        g = rstd[:, None] * (dx - (tl.sum(dx, axis=1) / M)[:, None]
                             - xhat * (tl.sum(dx * xhat, axis=1) / M)[:, None])
        g = tl.where(m2, g, 0.0)
        tl.store(DB + tok * M + o2, g.to(DB.dtype.element_ty), mask=m2)
        tl.store(DLAM + tok + n, tl.sum(g * hp, axis=1).to(DLAM.dtype.element_ty), mask=mn)
        tl.store(DC + tok + n, tl.sum(g * hps, axis=1).to(DC.dtype.element_ty), mask=mn)
        g = tl.where(m2, lam[:, None] * g + cc[:, None] * _shift_down(g, S), 0.0)
    tl.store(DH0 + state, g, mask=m2)
    tl.store(DW + state, dw, mask=m2)
    tl.store(DBIAS + state, dbeta, mask=m2)


# ------------------------------------------------------------------------------------------------------
# launch configuration: blocks per program (BN) and warps from the size of the largest register tile
# ------------------------------------------------------------------------------------------------------
def _block_m(m: int) -> int:
    return max(2, pow2(m))


def _tile(N: int, per_block: int, budget: int, cap: int = 64) -> int:
    """Blocks per program: as many as keep ``BN * per_block`` within ``budget`` elements, at most ``cap``
    and ``N`` rounded up to a power of two."""
    return max(1, min(budget // per_block, cap, pow2(N)))


def _warps(elements: int) -> int:
    return max(1, min(4, elements // 256))


def _acc_dtype(*xs):
    dt = xs[0].dtype
    for x in xs[1:]:
        if x is not None:
            dt = torch.promote_types(dt, x.dtype)
    return compute_dtype(dt)


def _inner_contiguous(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` if its last ``k`` dims are packed (the kernels take strides for the leading two), else a copy."""
    expected = 1
    for size, stride in zip(reversed(x.shape[-k:]), reversed(x.stride()[-k:])):
        if size != 1 and stride != expected:
            return x.contiguous()
        expected *= size
    return x


class _ChunkPlan:
    """Chunk count and tiles of one call."""

    def __init__(self, T, N, m, chunk):
        self.C = int(chunk)
        self.NC = -(-T // self.C)
        self.BM = BM = _block_m(m)
        self.bn_local = _tile(N, BM ** 3, 4096)   # [BN, m, m, m] transition products
        self.bn_run = _tile(N, BM * BM, 2048)      # [BN, m, m] transitions (or the Jordan shift)
        self.bn_carry = _tile(N, BM * BM, 512)
        self.w_local = _warps(self.bn_local * BM ** 3)
        self.w_run = _warps(self.bn_run * BM * BM)
        self.w_carry = _warps(self.bn_carry * BM * BM)

    def grid(self, bn, B, N):
        return (self.NC, cdiv(N, bn), B)


def _use_mm(plan, A, acc):
    return plan.BM >= 16 and acc == torch.float32 and A.dtype in (torch.float32, torch.bfloat16, torch.float16)


class _BlockScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, b, h0, chunk):
        ctx.set_materialize_grads(False)          # an unused final state gets no zero-filled gradient
        Bsz, T, N, m = b.shape
        acc = _acc_dtype(A, b, h0)
        A, b = _inner_contiguous(A, 3), b.contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        sAb, sAt = A.stride(0), A.stride(1)
        pl = _ChunkPlan(T, N, m, chunk)
        NC, C, BM = pl.NC, pl.C, pl.BM
        new = lambda *shape: torch.empty(*shape, dtype=acc, device=b.device)  # noqa: E731
        P, L, XS, H, XN = new(Bsz, NC, N, m, m), new(Bsz, NC, N, m), new(Bsz, NC, N, m), new(Bsz, T, N, m), new(Bsz, N, m)
        if _use_mm(pl, A, acc):
            launch(_dense_local_mm, (NC, N, Bsz), A, b, P, L, T, N, m, C, NC, sAb, sAt, BM=BM, NS=_STAGES,
                   num_warps=4)
        else:
            launch(_dense_fwd, pl.grid(pl.bn_local, Bsz, N), A, b, XS, P, L, H, T, N, m, C, NC, sAb, sAt,
                   LOCAL=True, BN=pl.bn_local, BM=BM, NS=_STAGES, num_warps=pl.w_local)
        launch(_carry, (cdiv(N, pl.bn_carry), Bsz), P, L, h0c if h0c is not None else XS, XS, XN, N, m, NC,
               HAS_X0=h0c is not None, REVERSE=False, BN=pl.bn_carry, BM=BM, NS=_STAGES, num_warps=pl.w_carry)
        launch(_dense_fwd, pl.grid(pl.bn_run, Bsz, N), A, b, XS, P, L, H, T, N, m, C, NC, sAb, sAt,
               LOCAL=False, BN=pl.bn_run, BM=BM, NS=_STAGES, num_warps=pl.w_run)
        ctx.save_for_backward(A, XS, H, P)
        ctx.meta = (chunk, A.dtype, b.dtype, None if h0 is None else h0.dtype)
        return H.to(b.dtype), H[:, -1].to(state_dtype(b), copy=True)     # from the accumulator

    @staticmethod
    def backward(ctx, dh, dlast):
        A, XS, H, P = ctx.saved_tensors
        chunk, a_dtype, b_dtype, h0_dtype = ctx.meta
        Bsz, T, N, m = H.shape
        pl = _ChunkPlan(T, N, m, chunk)
        NC, C, BM = pl.NC, pl.C, pl.BM
        sAb, sAt = A.stride(0), A.stride(1)
        dh = torch.zeros_like(H) if dh is None else dh.contiguous()
        new = lambda *shape: torch.empty(*shape, dtype=H.dtype, device=H.device)  # noqa: E731
        LOC, GS, DH0 = new(Bsz, NC, N, m), new(Bsz, NC, N, m), new(Bsz, N, m)
        dA = torch.empty(Bsz, T, N, m, m, dtype=a_dtype, device=H.device)
        db = torch.empty(Bsz, T, N, m, dtype=b_dtype, device=H.device)
        launch(_dense_bwd, pl.grid(pl.bn_run, Bsz, N), A, XS, H, dh, GS, LOC, dA, db, T, N, m, C, NC, sAb, sAt,
               LOCAL=True, BN=pl.bn_run, BM=BM, NS=_STAGES, num_warps=pl.w_run)
        launch(_carry, (cdiv(N, pl.bn_carry), Bsz), P, LOC, dlast.contiguous() if dlast is not None else GS,
               GS, DH0, N, m, NC, HAS_X0=dlast is not None, REVERSE=True, BN=pl.bn_carry, BM=BM, NS=_STAGES,
               num_warps=pl.w_carry)
        launch(_dense_bwd, pl.grid(pl.bn_run, Bsz, N), A, XS, H, dh, GS, LOC, dA, db, T, N, m, C, NC, sAb, sAt,
               LOCAL=False, BN=pl.bn_run, BM=BM, NS=_STAGES, num_warps=pl.w_run)
        return dA, db, (DH0.to(h0_dtype) if h0_dtype is not None else None), None


class _JordanScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lam, c, b, h0, chunk):
        ctx.set_materialize_grads(False)          # an unused final state gets no zero-filled gradient
        Bsz, T, N, m = b.shape
        acc = _acc_dtype(lam, c, b, h0)
        lam, b = lam.contiguous(), b.contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        pl = _ChunkPlan(T, N, m, chunk)
        NC, C, BM = pl.NC, pl.C, pl.BM
        new = lambda *shape: torch.empty(*shape, dtype=acc, device=b.device)  # noqa: E731
        P, L, XS, H, XN = new(Bsz, NC, N, m, m), new(Bsz, NC, N, m), new(Bsz, NC, N, m), new(Bsz, T, N, m), new(Bsz, N, m)
        sc = c.stride()
        for local in (True, False):
            if not local:
                launch(_carry, (cdiv(N, pl.bn_carry), Bsz), P, L, h0c if h0c is not None else XS, XS, XN,
                       N, m, NC, HAS_X0=h0c is not None, REVERSE=False, BN=pl.bn_carry, BM=BM, NS=_STAGES,
                       num_warps=pl.w_carry)
            launch(_jordan_fwd, pl.grid(pl.bn_run, Bsz, N), lam, c, b, XS, P, L, H, T, N, m, C, NC, *sc,
                   LOCAL=local, BN=pl.bn_run, BM=BM, NS=_STAGES, num_warps=pl.w_run)
        ctx.save_for_backward(lam, c, XS, H, P)
        ctx.meta = (chunk, lam.dtype, c.dtype, b.dtype, None if h0 is None else h0.dtype)
        return H.to(b.dtype), H[:, -1].to(state_dtype(b), copy=True)     # from the accumulator

    @staticmethod
    def backward(ctx, dh, dlast):
        lam, c, XS, H, P = ctx.saved_tensors
        chunk, lam_dtype, c_dtype, b_dtype, h0_dtype = ctx.meta
        Bsz, T, N, m = H.shape
        pl = _ChunkPlan(T, N, m, chunk)
        NC, C, BM = pl.NC, pl.C, pl.BM
        dev = H.device
        dh = torch.zeros_like(H) if dh is None else dh.contiguous()
        new = lambda *shape: torch.empty(*shape, dtype=H.dtype, device=dev)  # noqa: E731
        LOC, GS, DH0 = new(Bsz, NC, N, m), new(Bsz, NC, N, m), new(Bsz, N, m)
        dlam = torch.empty(Bsz, T, N, dtype=lam_dtype, device=dev)
        dc = torch.empty(Bsz, T, N, dtype=c_dtype, device=dev)
        db = torch.empty(Bsz, T, N, m, dtype=b_dtype, device=dev)
        args = (lam, c, XS, H, dh, GS, LOC, dlam, dc, db, T, N, m, C, NC, *c.stride())
        launch(_jordan_bwd, pl.grid(pl.bn_run, Bsz, N), *args, LOCAL=True, BN=pl.bn_run, BM=BM, NS=_STAGES,
               num_warps=pl.w_run)
        launch(_carry, (cdiv(N, pl.bn_carry), Bsz), P, LOC, dlast.contiguous() if dlast is not None else GS,
               GS, DH0, N, m, NC, HAS_X0=dlast is not None, REVERSE=True, BN=pl.bn_carry, BM=BM, NS=_STAGES,
               num_warps=pl.w_carry)
        launch(_jordan_bwd, pl.grid(pl.bn_run, Bsz, N), *args, LOCAL=False, BN=pl.bn_run, BM=BM, NS=_STAGES,
               num_warps=pl.w_run)
        return dlam, dc, db, (DH0.to(h0_dtype) if h0_dtype is not None else None), None


def _normed_tile(N, m):
    """One warp per program, ``32 / m`` blocks in it (an entry per lane): a step's latency is what counts."""
    BM = _block_m(m)
    return BM, max(1, min(32 // BM, pow2(N))), 1


class _NormedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lam, c, b, h0, weight, bias, eps):
        ctx.set_materialize_grads(False)          # an unused final state gets no zero-filled gradient
        Bsz, T, N, m = b.shape
        lam, b = lam.contiguous(), b.contiguous()
        h0c = h0.contiguous() if h0 is not None else None
        H = torch.empty(Bsz, T, N, m, dtype=_acc_dtype(lam, c, b, h0, weight, bias), device=b.device)
        BM, bn, warps = _normed_tile(N, m)
        launch(_normed_fwd, (cdiv(N, bn), Bsz), lam, c, b, h0c if h0c is not None else H, weight, bias, H,
               T, N, m, *c.stride(), eps, HAS_INIT=h0c is not None, BN=bn, BM=BM, NS=_STAGES, num_warps=warps)
        ctx.save_for_backward(lam, c, b, h0c, H, weight)
        ctx.eps = eps
        ctx.dtypes = (lam.dtype, c.dtype, b.dtype, None if h0 is None else h0.dtype, weight.dtype, bias.dtype)
        return H.to(b.dtype), H[:, -1].to(state_dtype(b), copy=True)     # from the accumulator

    @staticmethod
    def backward(ctx, dh, dlast):
        lam, c, b, h0, H, weight = ctx.saved_tensors
        Bsz, T, N, m = H.shape
        dev = H.device
        dh = torch.zeros_like(H) if dh is None else dh.contiguous()
        dlam = torch.empty(Bsz, T, N, dtype=ctx.dtypes[0], device=dev)
        dc = torch.empty(Bsz, T, N, dtype=ctx.dtypes[1], device=dev)
        db = torch.empty(Bsz, T, N, m, dtype=ctx.dtypes[2], device=dev)
        dh0, dw, dbias = (torch.empty(Bsz, N, m, dtype=H.dtype, device=dev) for _ in range(3))
        BM, bn, warps = _normed_tile(N, m)
        launch(_normed_bwd, (cdiv(N, bn), Bsz), lam, c, b, h0 if h0 is not None else H, H, weight, dh,
               dlast.contiguous() if dlast is not None else H, dlam, dc, db, dh0, dw, dbias, T, N, m, *c.stride(),
               ctx.eps, HAS_INIT=h0 is not None, HAS_DLAST=dlast is not None, BN=bn, BM=BM, NS=_STAGES,
               num_warps=warps)
        dh0 = dh0.to(ctx.dtypes[3]) if h0 is not None else None
        return dlam, dc, db, dh0, dw.sum(0).to(ctx.dtypes[4]), dbias.sum(0).to(ctx.dtypes[5]), None


def _empty_result(b, h0):
    Bsz, _, N, m = b.shape
    last = b.new_zeros(Bsz, N, m, dtype=state_dtype(b)) if h0 is None else as_state(h0, b)
    return b.new_zeros(Bsz, 0, N, m), last


def _check_chunk(chunk_size):
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"block scan (triton): chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def _coupling(c, lam):
    c = c if torch.is_tensor(c) else torch.tensor(float(c), dtype=lam.dtype, device=lam.device)
    return torch.broadcast_to(c, lam.shape)  # a view: a per-block coupling is read with stride 0 over (B, T)


def block_scan_triton(A, b, initial_state=None, chunk_size: int = CHUNK):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))`` of ``h_t = A_t h_{t-1} + b_t``. ``A`` may be a broadcast
    view over batch and time (read with stride 0, e.g. one block per layer); ``chunk_size`` does not change
    the result."""
    _check_chunk(chunk_size)
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    return _BlockScan.apply(A, b, initial_state, chunk_size)


def jordan_scan_triton(lam, c, b, initial_state=None, chunk_size: int = CHUNK):
    """Returns ``(h, h_last)`` of ``h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t``; ``c`` broadcastable to
    ``lam``; ``chunk_size`` does not change the result."""
    _check_chunk(chunk_size)
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    return _JordanScan.apply(lam, _coupling(c, lam), b, initial_state, chunk_size)


def jordan_scan_normed_triton(lam, c, b, weight, bias, eps: float = 1e-5, initial_state=None):
    """Returns ``(h, h_last)`` of ``h_t = LN(lam_t h_{t-1} + c_t N h_{t-1} + b_t)`` (per-block LayerNorm,
    ``weight``/``bias`` broadcastable to ``(N, m)``)."""
    if b.shape[1] == 0:
        return _empty_result(b, initial_state)
    N, m = b.shape[-2:]
    weight = torch.broadcast_to(weight, (N, m)).contiguous()
    bias = torch.broadcast_to(bias, (N, m)).contiguous()
    return _NormedScan.apply(lam, _coupling(c, lam), b, initial_state, weight, bias, float(eps))
