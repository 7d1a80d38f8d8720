"""Chunked Mamba-2 SSD in Triton, forward and backward (same contract as :mod:`kernels.ssd.chunked`).

Per head, with chunk length ``L`` and within-chunk cumulative log decay ``a_t = sum_{l<=t} dt_l A``
(``a_L`` its value at the chunk's last position), ``u_s = dt_s x_s`` and ``h0_c`` the state entering
chunk ``c``:

    S_c      = sum_s exp(a_L - a_s) B_s u_s^T                                  (chunk state)
    h0_{c+1} = exp(a_L) h0_c + S_c                                             (state passing)
    y_t      = sum_{s<=t} exp(a_t - a_s) (C_t . B_s) u_s + exp(a_t) C_t^T h0_c  (chunk output)

Forward kernels, in the order of Dao & Gu (2024) / mamba-ssm / flash-linear-attention:
``_chunk_state`` (one program per chunk, (batch, head) and block of columns of ``x``), ``_state_pass``
(a sequential loop over chunks, parallel over batch, head and blocks of the N x P state), ``_chunk_out``
(per chunk, (batch, head) and column block). Each chunk kernel recomputes the cumulative sum of
``dt * A`` of its chunk in registers (``tl.cumsum``; L values, cheaper than a round trip through
memory). The states entering every chunk and the per-chunk decays are saved for the backward.

Backward, the mirror: with ``G_c`` the gradient w.r.t. the state leaving chunk ``c``,
``G_{c-1} = exp(a_L^c) G_c + sum_t exp(a_t) C_t dy_t^T`` (``_chunk_state`` in its second mode, then
``_state_pass_bwd`` in reverse), and two kernels per chunk form, with
``D_ts = exp(a_t - a_s) [s<=t]``, ``K = (C B^T) * D`` and ``Wd = (dy u^T) * D``:

    du  = K^T dy + exp(a_L - a) * (B G)          dx = dt * du,   ddt = rowsum(du * x) + A * dA_t
    dC  = Wd B   + exp(a) * (dy h0^T)            dB = Wd^T C + exp(a_L - a) * (u G^T)
    da_t = rowsum(K * dyu)_t - colsum(K * dyu)_t + exp(a_t) dy_t.(C_t h0) - exp(a_L - a_t) u_t.(B_t G)
    dA_t = sum_{t' >= t} da_t' + sum_s exp(a_L - a_s) u_s.(B_s G) + exp(a_L) <G, h0>   (grad of dt_t A)

``_chunk_bwd_x`` forms ``du``, ``dx``, ``ddt`` and ``dA_t``; ``_chunk_bwd_bc`` forms ``dB`` and ``dC``
(one kernel for all of it needed over 255 registers per thread, and ptxas spilled up to 15 KB). Every
gradient is linear in the columns of ``x``, ``dy`` and the states, so a program takes one block of
columns (:func:`column_block`; all of them up to head dim 64 with 16-bit inputs): ``dx`` is whole per
block, and where there are several blocks each writes its share of ``dB``, ``dC``, ``ddt`` and ``dA``
(fp32), summed in torch. ``dA`` (the per-head decay rate) is ``sum dt_t dA_t`` over batch and time
(per-chunk partial sums are reduced in torch).

Precision. fp32 inputs: every product in exact fp32 (``input_precision="ieee"``). bf16 / fp16 inputs:
every ``tl.dot`` takes 16-bit operands (the input dtype) and accumulates in fp32, on tensor cores, as
mamba-ssm's kernels do: ``x``, ``dy``, ``B``, ``C`` as stored; the decay-weighted tiles (``B exp(a_L -
a) dt``, the scores ``(C B^T) * D * dt``, ``K``, ``Wd``), ``u = dt x``, and the states ``h0`` and ``G``,
which the passes accumulate in fp32 and store in the input dtype (the chunk kernels read them only as
operands and in one sum; as the delta rule's kernels store theirs, at half the memory of fp32 states).
The chunk states, the decays, ``dt``, the cumulative sums, the passes' running states, the row and
column sums of ``dA`` and every accumulator are fp32; outputs are cast to the input dtypes. Measured
against fp64 on fp16 inputs under the interpreter (24 random shapes: T 1-130, N 4-128, P 8-128, chunk
1-128, B and C per head or shared): outputs and gradients within 5.5e-4 relative (Frobenius), dA (a sum
whose terms cancel) within 1.8e-3; at N 16, P 32: 2.4e-4 to 4.1e-4, against 2.1e-4 to 3.2e-4 with every
product in fp32 after an upcast. The test tolerance of 5e-3 / 1e-2 (tests/kernels/test_low_precision.py)
keeps about a 10x margin.

Stages. The host side is six functions, one launch each (the chunk gradients two): :func:`chunk_states`,
:func:`pass_states`, :func:`chunk_outputs`, :func:`chunk_state_grads`, :func:`pass_state_grads` and
:func:`chunk_grads`; each has its reference of the same name in :mod:`kernels.ssd.stages`
(tests/kernels/test_ssd_stages.py checks them one by one).

Positions past the end of the sequence are loaded as zero (``dt = 0``: no decay, no input), so any
``T`` and any chunk size work (a chunk is padded to a block of at least 16 positions for ``tl.dot``).

Decays within a chunk. Each exponent is summed over its own segment: ``D_ts`` from a masked cumulative sum over
the ``(L, L)`` tile (as Mamba-2's segsum), ``exp(a_L - a_s)`` from the suffix sum of the next steps (``dt`` read
one step on); ``exp(a_t)`` and ``exp(a_L)`` from the chunk start. The gradient of ``dt_r A`` sums the segments that
hold ``r`` (``sum_{t>=r, s<r} W_ts`` from a reverse cumulative sum of the tile, ``sum_{s<r}`` of the chunk state's
terms, the reverse cumulative sum of the ``h0`` readout's), not the reverse cumulative sum of ``da`` above, whose
row and column sums cancel O(1) terms. As ``exp(a_t - a_s)`` of the cumulative sums (mamba-ssm's and
flash-linear-attention's form) a weak segment after strong steps (``a`` ~ -1000) kept only ``|a| eps`` ~ 6e-5 of its
exponent, and a step's gradient was a difference of O(1) sums. Measured in fp32 against fp64 (interpreter, T 128,
chunk 64 (run as 32), 2 heads, N = P = 16, 60 draws; relative Frobenius error): with ``dt A`` of -20..-40 among
-0.05..0 in one chunk, output and gradients <= 1.3e-7 (before: 3.4e-6..1.5e-5) and ``dA`` (a sum over the steps
whose terms cancel) <= 5e-6 (before: 2.5e-5..1.5e-3); at -40..-60 everywhere, output and gradients <= 1.1e-7 and
``dA`` (a sum of ~1e-21 terms of both signs) <= 1.8e-6 (before: lost, 0.66..5.8). The chunked PyTorch path
(:func:`kernels.common.segment_log_decays`) sums the same way.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..backend import triton_interpreting
from ..common import as_state, cdiv, pow2, standard_strides, unit_last
from ..grad_slots import empty_grad
from ..launch import launch
from . import TRITON_MAX_DIM

__all__ = ["ssd_triton", "chunk_states", "pass_states", "chunk_outputs", "chunk_state_grads", "pass_state_grads",
           "chunk_grads"]


@triton.jit
def _last(a, offs_l, pid_c, T, L):
    # a at the chunk's last valid position, picked exactly from the cumsum (a separate tl.sum rounds
    # differently, and exp(a_L - a_t) at t = last must be exactly 1 when |a| is in the hundreds)
    last = tl.minimum(L, T - pid_c * L) - 1
    return tl.sum(tl.where(offs_l == last, a, 0.0), 0)


@triton.jit
def _decay_tile(dta, offs_l):
    # D_ts = exp(sum_{s<r<=t} dt_r A) for s <= t, else 0: each exponent summed over its own segment (a masked
    # cumulative sum over the (L, L) tile, as Mamba-2's segsum). As a_t - a_s of the cumulative sums, a weak
    # segment after strong steps (a ~ -1000) kept only |a| * eps ~ 6e-5 of its exponent
    steps = tl.where(offs_l[:, None] > offs_l[None, :], dta[:, None], 0.0)  # [r, s] = dt_r A where r > s
    causal = offs_l[:, None] >= offs_l[None, :]
    return tl.exp(tl.where(causal, tl.cumsum(steps, 0), float("-inf")))


@triton.jit
def _to_end(DT, dt_base, s_dt, a_h, offs_l, t, T, L):
    # sum_{s<r<=last} dt_r A for every s (a_L - a_s) as the suffix sum of the next steps' dt A (dt read one step
    # on): its rounding is that of its own segment, and it is exactly 0 at the chunk's last position
    nxt = (offs_l + 1 < L) & (t + 1 < T)
    dt_next = tl.load(DT + dt_base + (t + 1) * s_dt, mask=nxt, other=0.0).to(tl.float32)
    return tl.cumsum(dt_next * a_h, 0, reverse=True)


@triton.jit
def _chunk_state(
    KM, VM, DT, A, OUT, ALAST,
    s_kb, s_kt, s_kh, s_kn, s_vb, s_vt, s_vh, s_vp, s_db, s_dt, s_dh,
    T, H, N, P, L, NCHUNK,
    MODE: tl.constexpr, PREC: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # MODE 0 (forward):  OUT[c] = sum_s exp(a_L - a_s) dt_s KM_s VM_s^T  (KM = B, VM = x); also ALAST[c] = a_L
    # MODE 1 (backward): OUT[c] = sum_t exp(a_t) KM_t VM_t^T             (KM = C, VM = dy)
    # one block of BLOCK_P columns of the (N, P) state per program
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    t = pid_c * L + offs_l
    ok = (offs_l < L) & (t < T)
    dt = tl.load(DT + b * s_db + h * s_dh + t * s_dt, mask=ok, other=0.0).to(tl.float32)
    a_h = tl.load(A + h).to(tl.float32)
    dta = dt * a_h
    a = tl.cumsum(dta, 0)
    if MODE == 0:
        w = tl.exp(_to_end(DT, b * s_db + h * s_dh, s_dt, a_h, offs_l, t, T, L)) * dt
        if pid_p == 0:
            tl.store(ALAST + pid_bh.to(tl.int64) * NCHUNK + pid_c, _last(a, offs_l, pid_c, T, L))
    else:
        w = tl.exp(a)
    w = tl.where(ok, w, 0.0)
    km_t = tl.load(KM + b * s_kb + h * s_kh + t[None, :] * s_kt + offs_n[:, None] * s_kn,
                   mask=ok[None, :] & (offs_n[:, None] < N), other=0.0)  # (N, L)
    vm = tl.load(VM + b * s_vb + h * s_vh + t[:, None] * s_vt + offs_p[None, :] * s_vp,
                 mask=ok[:, None] & (offs_p[None, :] < P), other=0.0)  # (L, P)
    weighted = (km_t.to(tl.float32) * w[None, :]).to(vm.dtype)
    out = tl.dot(weighted, vm, input_precision=PREC)  # (N, P)
    base = ((b * NCHUNK + pid_c) * H + h) * N * P
    tl.store(OUT + base + offs_n[:, None] * P + offs_p[None, :], out,
             mask=(offs_n[:, None] < N) & (offs_p[None, :] < P))


@triton.jit
def _state_pass(
    STATES, ALAST, INIT, HSTART, FINAL,
    H, NCHUNK, NP,
    HAS_INIT: tl.constexpr, BLOCK: tl.constexpr,
):
    # h0_0 = init; HSTART[c] = h0_c; h0_{c+1} = exp(a_L^c) h0_c + S_c; FINAL = h0_NCHUNK
    pid_blk = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs = pid_blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < NP
    if HAS_INIT:
        s = tl.load(INIT + pid_bh.to(tl.int64) * NP + offs, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BLOCK], tl.float32)
    for c in range(NCHUNK):
        idx = ((b * NCHUNK + c) * H + h) * NP + offs
        tl.store(HSTART + idx, s.to(HSTART.dtype.element_ty), mask=m)
        decay = tl.exp(tl.load(ALAST + pid_bh.to(tl.int64) * NCHUNK + c))
        s = decay * s + tl.load(STATES + idx, mask=m, other=0.0)
    tl.store(FINAL + pid_bh.to(tl.int64) * NP + offs, s, mask=m)


@triton.jit
def _state_pass_bwd(
    DSTATES, ALAST, DFINAL, GEND, DINIT,
    H, NCHUNK, NP,
    HAS_DFINAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # g = dfinal; for c from last to first: GEND[c] = g; g = exp(a_L^c) g + DSTATES[c]; DINIT = g
    pid_blk = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs = pid_blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < NP
    if HAS_DFINAL:
        g = tl.load(DFINAL + pid_bh.to(tl.int64) * NP + offs, mask=m, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([BLOCK], tl.float32)
    for i in range(NCHUNK):
        c = NCHUNK - 1 - i
        idx = ((b * NCHUNK + c) * H + h) * NP + offs
        tl.store(GEND + idx, g.to(GEND.dtype.element_ty), mask=m)
        decay = tl.exp(tl.load(ALAST + pid_bh.to(tl.int64) * NCHUNK + c))
        g = decay * g + tl.load(DSTATES + idx, mask=m, other=0.0)
    tl.store(DINIT + pid_bh.to(tl.int64) * NP + offs, g, mask=m)


@triton.jit
def _chunk_out(
    X, DT, A, Bm, Cm, HSTART, DSKIP, Y,
    s_xb, s_xt, s_xh, s_xp, s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn, s_yb, s_yt, s_yh, s_yp,
    T, H, N, P, L, NCHUNK,
    PREC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_D: tl.constexpr,
):
    # y_t = sum_{s<=t} exp(a_t - a_s) (C_t . B_s) dt_s x_s + exp(a_t) C_t^T h0_c (+ D_h x_t), on BLOCK_P columns
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    t = pid_c * L + offs_l
    ok = (offs_l < L) & (t < T)
    n_ok = offs_n < N
    p_ok = offs_p < P
    dt = tl.load(DT + b * s_db + h * s_dh + t * s_dt, mask=ok, other=0.0).to(tl.float32)
    dta = dt * tl.load(A + h).to(tl.float32)
    a = tl.cumsum(dta, 0)
    bc_base = b * s_bb + h * s_bh
    c_mat = tl.load(Cm + bc_base + t[:, None] * s_bt + offs_n[None, :] * s_bn,
                    mask=ok[:, None] & n_ok[None, :], other=0.0)  # (L, N)
    b_t = tl.load(Bm + bc_base + t[None, :] * s_bt + offs_n[:, None] * s_bn,
                  mask=ok[None, :] & n_ok[:, None], other=0.0)  # (N, L)
    x = tl.load(X + b * s_xb + h * s_xh + t[:, None] * s_xt + offs_p[None, :] * s_xp,
                mask=ok[:, None] & p_ok[None, :], other=0.0)  # (L, P)
    scores = tl.dot(c_mat, b_t, input_precision=PREC) * _decay_tile(dta, offs_l) * dt[None, :]
    y = tl.dot(scores.to(x.dtype), x, input_precision=PREC)
    h0 = tl.load(HSTART + ((b * NCHUNK + pid_c) * H + h) * N * P + offs_n[:, None] * P + offs_p[None, :],
                 mask=n_ok[:, None] & p_ok[None, :], other=0.0)
    y += tl.exp(a)[:, None] * tl.dot(c_mat, h0.to(c_mat.dtype), input_precision=PREC)
    if HAS_D:
        y += tl.load(DSKIP + h) * x.to(tl.float32)
    tl.store(Y + b * s_yb + h * s_yh + t[:, None] * s_yt + offs_p[None, :] * s_yp,
             y.to(Y.dtype.element_ty), mask=ok[:, None] & p_ok[None, :])


@triton.jit
def _chunk_bwd_tiles(
    X, DT, A, Bm, Cm, DY, HSTART, GEND,
    s_xb, s_xt, s_xh, s_xp, s_yb, s_yt, s_yh, s_yp, s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn,
    T, H, N, P, L, NCHUNK,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # what both backward chunk kernels read: the chunk's decays and its tiles of x, dy (BLOCK_P columns),
    # B, C, and the states h0 (entering) and G (gradient of the leaving state), all as stored
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    t = pid_c * L + offs_l
    ok = (offs_l < L) & (t < T)
    n_ok = offs_n < N
    p_ok = offs_p < P
    dt = tl.load(DT + b * s_db + h * s_dh + t * s_dt, mask=ok, other=0.0).to(tl.float32)
    a_h = tl.load(A + h).to(tl.float32)
    dta = dt * a_h
    a = tl.cumsum(dta, 0)
    a_last = _last(a, offs_l, pid_c, T, L)
    lp_off = b * s_xb + h * s_xh + t[:, None] * s_xt + offs_p[None, :] * s_xp
    lp_mask = ok[:, None] & p_ok[None, :]
    ln_off = b * s_bb + h * s_bh + t[:, None] * s_bt + offs_n[None, :] * s_bn
    ln_mask = ok[:, None] & n_ok[None, :]
    x = tl.load(X + lp_off, mask=lp_mask, other=0.0)
    dy = tl.load(DY + b * s_yb + h * s_yh + t[:, None] * s_yt + offs_p[None, :] * s_yp, mask=lp_mask, other=0.0)
    b_mat = tl.load(Bm + ln_off, mask=ln_mask, other=0.0)
    c_mat = tl.load(Cm + ln_off, mask=ln_mask, other=0.0)
    st_off = ((b * NCHUNK + pid_c) * H + h) * N * P + offs_n[:, None] * P + offs_p[None, :]
    st_mask = n_ok[:, None] & p_ok[None, :]
    h0 = tl.load(HSTART + st_off, mask=st_mask, other=0.0)
    g = tl.load(GEND + st_off, mask=st_mask, other=0.0)
    dmat = _decay_tile(dta, offs_l)  # [t, s]
    e_end = tl.where(ok, tl.exp(_to_end(DT, b * s_db + h * s_dh, s_dt, a_h, offs_l, t, T, L)), 0.0)
    return (dt, a_h, a, a_last, ok, lp_off, lp_mask, ln_off, ln_mask, x, dy, b_mat, c_mat, h0, g, dmat, e_end)


@triton.jit
def _chunk_bwd_x(
    X, DT, A, Bm, Cm, DY, HSTART, GEND, DSKIP, DX, DDT, DA_PART,
    s_xb, s_xt, s_xh, s_xp, s_yb, s_yt, s_yh, s_yp, s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn,
    s_gb, s_gt, s_gh, s_gp, s_part_t, s_part_a, s_part_d,
    T, H, N, P, L, NCHUNK,
    PREC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_D: tl.constexpr,
):
    # du, dx and the chunk's ddt and dA (see the module docstring) from BLOCK_P columns of x: dx whole,
    # the block's share of ddt and dA (linear in the columns) at offsets pid_p * s_part_*; with the skip
    # y += D_h x, dx += D_h dy and the block's share of dD_h = sum dy . x at s_part_d past its dA share;
    # x, dy and dx each at their own strides (x and dx may be parts of wider rows)
    (dt, a_h, a, a_last, ok, lp_off, lp_mask, ln_off, ln_mask, x, dy, b_mat, c_mat, h0, g, dmat, e_end) = \
        _chunk_bwd_tiles(X, DT, A, Bm, Cm, DY, HSTART, GEND, s_xb, s_xt, s_xh, s_xp, s_yb, s_yt, s_yh, s_yp,
                         s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn, T, H, N, P, L, NCHUNK, BLOCK_L, BLOCK_N, BLOCK_P)
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    lo = x.dtype  # the dot operands' type: the input dtype (fp32 inputs: exact fp32 products)
    xf = x.to(tl.float32)
    u = xf * dt[:, None]
    k_mat = tl.dot(c_mat, tl.trans(b_mat), input_precision=PREC) * dmat
    bg = tl.dot(b_mat, g.to(lo), input_precision=PREC)  # (L, P)
    du = tl.dot(tl.trans(k_mat.to(lo)), dy, input_precision=PREC) + e_end[:, None] * bg
    dx = du * dt[:, None]
    if HAS_D:
        dyf = dy.to(tl.float32)
        dx += tl.load(DSKIP + h) * dyf
        tl.store(DA_PART + s_part_d + pid_p * s_part_a + pid_bh.to(tl.int64) * NCHUNK + pid_c,
                 tl.sum(tl.sum(dyf * xf, 1), 0))
    t = pid_c * L + tl.arange(0, BLOCK_L)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    tl.store(DX + b * s_gb + h * s_gh + t[:, None] * s_gt + offs_p[None, :] * s_gp, dx.to(DX.dtype.element_ty),
             mask=lp_mask)
    ddt = tl.sum(du * xf, 1)
    state_in = e_end * tl.sum(u * bg, 1)  # d/da_s of the chunk state is -state_in_s
    w = k_mat * tl.dot(dy, tl.trans(u.to(lo)), input_precision=PREC)
    e_start = tl.where(ok, tl.exp(a), 0.0)
    ch0 = tl.dot(c_mat, h0.to(lo), input_precision=PREC)  # (L, P)
    # d/d(dt_r A), from the segments that hold r: s < r <= t (W_ts), s < r <= end (state_in_s), start < r <= t
    # (the readout of h0) and the whole chunk (h0's decay). Not as the reverse cumulative sum of d/da_t =
    # rowsum(W) - colsum(W) + ...: that cancels O(1) terms to leave a strong step's e^{-20}-sized gradient
    offs_l = tl.arange(0, BLOCK_L)
    later = offs_l[None, :] < offs_l[:, None]  # [r, s]: s < r
    crossing = tl.cumsum(w, 0, reverse=True) + state_in[None, :]  # [r, s] = sum_{t>=r} W_ts + state_in_s
    readout = e_start * tl.sum(dy.to(tl.float32) * ch0, 1)
    whole = tl.exp(a_last) * tl.sum(tl.sum(g.to(tl.float32) * h0.to(tl.float32), 1), 0)
    dta_grad = tl.sum(tl.where(later, crossing, 0.0), 1) + tl.cumsum(readout, 0, reverse=True) + whole
    dta_grad = tl.where(ok, dta_grad, 0.0)
    ddt += a_h * dta_grad
    tl.store(DDT + pid_p * s_part_t + b * s_db + h * s_dh + t * s_dt, ddt.to(DDT.dtype.element_ty), mask=ok)
    tl.store(DA_PART + pid_p * s_part_a + pid_bh.to(tl.int64) * NCHUNK + pid_c, tl.sum(dt * dta_grad, 0))


@triton.jit
def _chunk_bwd_bc(
    X, DT, A, Bm, Cm, DY, HSTART, GEND, DB, DC,
    s_xb, s_xt, s_xh, s_xp, s_yb, s_yt, s_yh, s_yp, s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn, s_ob, s_ot, s_oh,
    s_part_bn,
    T, H, N, P, L, NCHUNK,
    PREC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # dB and dC of the chunk (see the module docstring), the share of BLOCK_P columns of x at pid_p * s_part_bn;
    # written with their own strides (s_o*, unit stride over N): B and C may share one row over the heads
    (dt, a_h, a, a_last, ok, lp_off, lp_mask, ln_off, ln_mask, x, dy, b_mat, c_mat, h0, g, dmat, e_end) = \
        _chunk_bwd_tiles(X, DT, A, Bm, Cm, DY, HSTART, GEND, s_xb, s_xt, s_xh, s_xp, s_yb, s_yt, s_yh, s_yp,
                         s_db, s_dt, s_dh, s_bb, s_bt, s_bh, s_bn, T, H, N, P, L, NCHUNK, BLOCK_L, BLOCK_N, BLOCK_P)
    lo = x.dtype
    u_lo = (x.to(tl.float32) * dt[:, None]).to(lo)
    wd = (tl.dot(dy, tl.trans(u_lo), input_precision=PREC) * dmat).to(lo)
    e_start = tl.where(ok, tl.exp(a), 0.0)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    t = tl.program_id(0) * L + tl.arange(0, BLOCK_L)
    out = tl.program_id(2) * s_part_bn + b * s_ob + h * s_oh + t[:, None] * s_ot + tl.arange(0, BLOCK_N)[None, :]
    dc = tl.dot(wd, b_mat, input_precision=PREC)
    dc += e_start[:, None] * tl.dot(dy, tl.trans(h0.to(lo)), input_precision=PREC)
    tl.store(DC + out, dc.to(DC.dtype.element_ty), mask=ln_mask)
    db = tl.dot(tl.trans(wd), c_mat, input_precision=PREC)
    db += e_end[:, None] * tl.dot(u_lo, tl.trans(g.to(lo)), input_precision=PREC)
    tl.store(DB + out, db.to(DB.dtype.element_ty), mask=ln_mask)


def column_block(P: int, low_precision: bool) -> int:
    """Columns of ``x`` per program, a power of two >= 16: all of ``P`` up to 64 with 16-bit inputs (blocks
    of 64 above), 16 with fp32 inputs, whose exact products are FMA loops over whole register tiles
    (python -m zoo.benchmark.compile_check: at 32 columns and chunk 64 they spilled 1-23 KB per thread)."""
    return min(64, max(16, pow2(P))) if low_precision else 16


def _blocks(L, N, P, block_p):
    return dict(BLOCK_L=max(16, pow2(L)), BLOCK_N=max(16, pow2(N)),
                BLOCK_P=block_p)


def _launch_opts(bwd=False):
    if triton_interpreting():
        return {}
    return {"num_warps": 8 if bwd else 4}


_PASS_BLOCK = 256
#: the products' precision: only fp32 operands read it (exact fp32); 16-bit ones run on tensor cores
_PREC = "ieee"



def block_chunk(chunk_size: int, N: int, P: int, low_precision: bool = True) -> int:
    """The chunk the kernels run: ``chunk_size`` capped at 64 with 16-bit inputs (a tensor-core tile of
    64 rows), at 32 with fp32 inputs (exact fp32 products at 64 rows spill; python -m
    zoo.benchmark.compile_check). The result does not depend on it."""
    return min(chunk_size, 64 if low_precision else 32)


# --------------------------------------------------------------------------------------------------
# the stages: one launch each (the backward's chunk gradients two), each with its reference in
# kernels.ssd.stages; x (b, T, H, P), dt (b, T, H), A32 (H,) fp32, B and C (b, T, H, N) in x's dtype,
# chunk L; states and their gradients are (b, n, H, N, P), the chunks' last cumulative decays (b, H, n),
# read as contiguous (a no-op for the stages' own outputs)
# --------------------------------------------------------------------------------------------------
def _chunk_sums(km, vm, dt, A32, L: int, mode: int):
    """One launch of ``_chunk_state`` (see its ``MODE``): every chunk's ``(N, P)`` sum (fp32) and, forwards,
    the chunks' last cumulative decays."""
    b, T, H, P = vm.shape
    N = km.shape[-1]
    n = cdiv(T, L)
    block_p = column_block(P, vm.dtype != torch.float32)
    out = torch.empty(b, n, H, N, P, device=vm.device, dtype=torch.float32)
    alast = torch.empty(b, H, n, device=vm.device, dtype=torch.float32) if mode == 0 else out  # MODE 1: unused
    launch(_chunk_state, (n, b * H, cdiv(P, block_p)),
           km, vm, dt, A32, out, alast, *km.stride(), *vm.stride(), *dt.stride(),
           T, H, N, P, L, n, MODE=mode, PREC=_PREC, **_blocks(L, N, P, block_p), **_launch_opts())
    return out, alast


def chunk_states(x, dt, A32, B, L: int):
    """``(S, alast)``: every chunk's own state ``S_c = sum_s exp(a_L - a_s) dt_s B_s x_s^T`` (fp32) and its
    cumulative decay at its last position ``a_L``."""
    return _chunk_sums(B, x, dt, A32, L, mode=0)


def _pass(kernel, has_start: str, parts, alast, start, dtype):
    """The sequential pass over chunks, forwards (``_state_pass``) or backwards (``_state_pass_bwd``): what
    enters every chunk stored in ``dtype``, and the fp32 value after the pass."""
    b, n, H, N, P = parts.shape
    parts, alast = parts.contiguous(), alast.contiguous()
    stored = torch.empty_like(parts, dtype=dtype)
    last = torch.empty(b, H, N, P, device=parts.device, dtype=torch.float32)
    launch(kernel, (cdiv(N * P, _PASS_BLOCK), b * H), parts, alast,
           start.contiguous() if start is not None else last, stored, last, H, n, N * P,
           **{has_start: start is not None}, BLOCK=_PASS_BLOCK)
    return stored, last


def pass_states(states, alast, initial_state, dtype):
    """``(hstart, final)``: the state entering every chunk, ``h0_{c+1} = exp(a_L^c) h0_c + S_c`` from
    ``initial_state`` (or zero), stored in ``dtype`` (the chunk kernels read it only as an operand), and the
    state after the last chunk (fp32)."""
    return _pass(_state_pass, "HAS_INIT", states, alast, initial_state, dtype)


def chunk_outputs(x, dt, A32, B, C, hstart, L: int, D=None):
    """``y_t = sum_{s<=t} exp(a_t - a_s) (C_t . B_s) dt_s x_s + exp(a_t) C_t^T h0_c`` within every chunk, plus
    the skip ``D_h x_t`` with ``D`` (H,) fp32."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    n = cdiv(T, L)
    block_p = column_block(P, x.dtype != torch.float32)
    hstart = hstart.contiguous()
    y = torch.empty_like(x)
    launch(_chunk_out, (n, b * H, cdiv(P, block_p)),
           x, dt, A32, B, C, hstart, A32 if D is None else D, y, *x.stride(), *dt.stride(), *B.stride(),
           *y.stride(), T, H, N, P, L, n, PREC=_PREC, **_blocks(L, N, P, block_p), HAS_D=D is not None,
           **_launch_opts())
    return y


def chunk_state_grads(C, dy, dt, A32, L: int):
    """Every chunk's contribution to the gradient of the state entering it, ``sum_t exp(a_t) C_t dy_t^T``
    (fp32)."""
    return _chunk_sums(C, dy, dt, A32, L, mode=1)[0]


def pass_state_grads(dstates, alast, dfinal, dtype):
    """``(gend, dinit)``: the gradient of the state leaving every chunk, ``G_{c-1} = exp(a_L^c) G_c +
    dstates_c`` from ``dfinal`` (or zero), stored in ``dtype``, and that of the initial state (fp32)."""
    return _pass(_state_pass_bwd, "HAS_DFINAL", dstates, alast, dfinal, dtype)


def chunk_grads(x, dt, A32, B, C, dy, hstart, gend, L: int, D=None):
    """``(dx, ddt, dA, dB, dC, dD)`` of every chunk's ``<dy, y> + <G, exp(a_L) h0 + S>`` with the states ``h0``
    entering and the gradients ``G`` of the states leaving held fixed (``dA`` (H,) fp32 summed over batch and
    chunks; the others in their inputs' dtypes); with the skip ``D`` (H,) fp32 in ``y``, its gradient ``dD``
    (H,) fp32, else None."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    n = cdiv(T, L)
    dx, ddt, dB, dC, sums, parts = _chunk_bwd_outputs(x, dt, B, n, column_block(P, x.dtype != torch.float32),
                                                      D is not None)
    assert C.stride() == B.stride()
    hstart, gend = hstart.contiguous(), gend.contiguous()
    grid = (n, b * H, parts.count)
    tiles = (x, dt, A32, B, C, dy, hstart, gend)
    strides = (*x.stride(), *dy.stride(), *dt.stride(), *B.stride())
    sizes = (T, H, N, P, L, n)
    consts = dict(PREC=_PREC, **_blocks(L, N, P, parts.block_p), **_launch_opts(bwd=True))
    launch(_chunk_bwd_x, grid, *tiles, A32 if D is None else D, dx, ddt, sums, *strides, *dx.stride(),
           parts.t, parts.a, sums[0].numel(), *sizes, HAS_D=D is not None, **consts)
    out_strides = (T * H * N, H * N, N)  # dB, dC (and their shares) are contiguous
    launch(_chunk_bwd_bc, grid, *tiles, dB, dC, *strides, *out_strides, parts.bn, *sizes, **consts)
    if parts.count > 1:  # the column blocks' shares of dB, dC, ddt
        dB, dC, ddt = (part.sum(0).to(like.dtype) for part, like in ((dB, B), (dC, C), (ddt, dt)))
    if D is None:
        return dx, ddt, sums[0].sum(dim=(0, 1, 3)), dB, dC, None
    dA, dD = sums.sum(dim=(1, 2, 4))      # the per-chunk partial sums of both in one reduction
    return dx, ddt, dA, dB, dC, dD


class _SSDTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, initial_state, chunk_size):
        ctx.set_materialize_grads(False)          # an unused final state gets no zero-filled gradient
        L = chunk_size
        A32 = A.to(torch.float32).contiguous()
        D32 = None if D is None else D.to(torch.float32).contiguous()
        states, alast = chunk_states(x, dt, A32, B, L)
        hstart, final = pass_states(states, alast, initial_state, x.dtype)
        y = chunk_outputs(x, dt, A32, B, C, hstart, L, D32)
        ctx.save_for_backward(x, dt, A, B, C, D, hstart, alast)
        ctx.chunk_size = L
        ctx.init_dtype = None if initial_state is None else initial_state.dtype
        return y, as_state(final, x)     # the fp32 state the pass accumulated

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, hstart, alast = ctx.saved_tensors
        L = ctx.chunk_size
        A32 = A.to(torch.float32).contiguous()
        D32 = None if D is None else D.to(torch.float32).contiguous()
        dy = torch.zeros_like(x) if dy is None else dy.to(x.dtype).contiguous()
        gend, dinit = pass_state_grads(chunk_state_grads(C, dy, dt, A32, L), alast, dfinal, x.dtype)
        dx, ddt, dA, dB, dC, dD = chunk_grads(x, dt, A32, B, C, dy, hstart, gend, L, D32)
        dinit_out = None if ctx.init_dtype is None else dinit.to(ctx.init_dtype)
        return dx, ddt, dA.to(A.dtype), dB, dC, None if D is None else dD.to(D.dtype), dinit_out, None


class _Parts(NamedTuple):
    """How ``_chunk_bwd_x`` and ``_chunk_bwd_bc`` split the columns of ``x``: ``count`` blocks of ``block_p``,
    and the element offsets between the blocks' shares of dB / dC (``bn``), ddt (``t``) and the dA partials
    (``a``)."""
    block_p: int
    count: int
    bn: int
    t: int
    a: int


def _chunk_bwd_outputs(x, dt, B, n, block_p, has_d: bool):
    """``dx``, ``ddt``, ``dB``, ``dC``, the per-chunk partial sums of dA (and of dD with the skip: ``(2 or 1,
    count, b, H, n)``, summed by the caller in one reduction) and the column split of the backward chunk
    kernels: with one column block, the gradients themselves; with several, fp32 shares stacked along a
    leading axis (in the layouts of ``dt`` and ``B``), summed by the caller."""
    b, T, H, P = x.shape
    count = cdiv(P, block_p)
    dx = empty_grad(x)
    sums = torch.empty(2 if has_d else 1, count, b, H, n, device=x.device, dtype=torch.float32)
    if count == 1:
        dB, dC = (torch.empty(B.shape, device=x.device, dtype=B.dtype) for _ in range(2))
        return dx, torch.empty_like(dt), dB, dC, sums, _Parts(block_p, 1, 0, 0, 0)
    ddt = torch.empty(count, *dt.shape, device=x.device, dtype=torch.float32)
    dB, dC = (torch.empty(count, *B.shape, device=x.device, dtype=torch.float32) for _ in range(2))
    return dx, ddt, dB, dC, sums, _Parts(block_p, count, B.numel(), dt.numel(), b * H * n)


def ssd_triton(x, dt, A, B, C, chunk_size: int = 64, initial_state=None, D=None):
    """Chunked SSD with Triton kernels. ``x (B, T, H, P)``, ``dt (B, T, H)``, ``A (H,)``,
    ``B, C (B, T, H, N)``, optional ``initial_state (B, H, N, P)`` and skip ``D (H,)`` (``y += D_h x``, in the
    output kernel; its gradients in the backward's).

    Returns ``(y (B, T, H, P), final_state (B, H, N, P))``, ``y`` in ``x.dtype`` and the state in
    :func:`kernels.common.state_dtype` of it (fp32 for 16-bit inputs); differentiable in every
    input including ``initial_state``. Any ``chunk_size >= 1`` (it is padded to a block of >= 16, and
    capped by :func:`block_chunk`); ``d_state`` and the head dim at most :data:`kernels.ssd.TRITON_MAX_DIM`.
    """
    if x.dim() != 4 or dt.dim() != 3 or A.dim() != 1 or B.dim() != 4 or C.dim() != 4:
        raise ValueError("ssd_triton: expected x (B,T,H,P), dt (B,T,H), A (H,), B and C (B,T,H,N)")
    bsz, T, H, P = x.shape
    if dt.shape != (bsz, T, H) or A.shape != (H,) or B.shape[:3] != (bsz, T, H) or C.shape != B.shape or (
            D is not None and D.shape != (H,)):
        raise ValueError(f"ssd_triton: shapes x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}"
                         f"{'' if D is None else f', D {tuple(D.shape)}'} do not match")
    N = B.shape[-1]
    if initial_state is not None and initial_state.shape != (bsz, H, N, P):
        raise ValueError(f"ssd_triton: initial_state must be {(bsz, H, N, P)}, got {tuple(initial_state.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd_triton: chunk_size must be a positive integer, got {chunk_size!r}")
    if T == 0:
        raise ValueError("ssd_triton: empty sequence")
    if max(N, P) > TRITON_MAX_DIM:
        raise ValueError(f"ssd_triton: d_state and head dim must be <= {TRITON_MAX_DIM} (got {N}, {P}): larger chunk tiles "
                         f"exceed a GPU block's shared memory; use backend='mamba_ssm' or 'torch'")
    if x.dtype == torch.float64:  # computed in fp32, as every fp32 input (the kernels take 32 and 16 bits)
        h0 = None if initial_state is None else initial_state.float()
        y, final = ssd_triton(x.float(), dt.float(), A, B.float(), C.float(), chunk_size, h0, D)
        return y.double(), final.double()
    chunk_size = block_chunk(chunk_size, N, P, x.dtype != torch.float32)
    # x at any token and head strides (a part of the convolved x|B|C rows, read in place; its gradient written
    # into that part's slot of the rows' gradient where kernels.grad_slots has one)
    x, dt = unit_last(x), dt.contiguous()
    B, C = B.to(x.dtype), C.to(x.dtype)  # one operand type for the products
    if B.stride() != C.stride() or B.stride(-1) != 1:
        B, C = standard_strides(B), standard_strides(C)  # one set of strides for both
    # else read in place: Mamba-2's one group of B and C, expanded over the heads (a head stride of 0), is
    # neither copied per head nor saved per head for the backward
    return _SSDTriton.apply(x, dt, A, B, C, D, initial_state, chunk_size)
