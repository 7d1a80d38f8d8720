"""Triton kernels for the chunked gated delta rule / delta product, forward and backward.

Same algorithm and notation as :mod:`kernels.delta.chunked` (read its docstring first). The product's
``n_h`` sub-steps form one sequence of ``L = n_h * T`` positions (token-major, the layout of ``k``, ``v``,
``beta``); the gate sits on sub-step 0 of each token and the query on the last. The kernels read that
layout directly: position ``s`` has the gate ``g[s // NQ]`` when ``s % NQ == 0`` and the query
``q[s // NQ]`` when ``s % NQ == NQ - 1``, with ``NQ = n_h`` (or ``NQ = 1`` after the torch glue has
interleaved ``q`` and ``g`` with zeros, when a chunk holds too few queries for a tensor-core tile), so a
chunk of ``BT`` positions has ``BT / NQ`` query rows and the output pass computes only those.

Per chunk ``c`` of ``BT`` positions (``G`` = in-chunk cumulative log gate, ``gC = G[BT-1]``):

forward
  1. ``_fwd_prep``  (parallel over chunks): ``G``; ``A = tril_strict(beta_r e^{G_r-G_i} k_r.k_i)``;
     ``Tm = (I + A)^{-1}`` (:func:`_unit_lower_inverse`); ``U = Tm diag(beta) V``, ``W = Tm diag(beta e^G) K``.
  2. ``_fwd_state`` (sequential over chunks, parallel over V blocks): stores the entry state ``h_c``,
     ``D = U - W h_c`` and ``h_{c+1} = e^{gC} h_c + K^T (e^{gC-G} D)``.
  3. ``_fwd_out``   (parallel over chunks): ``O = scale (e^G Q h_c + ((Q K^T) * M) D)`` on the query rows.

backward (``dO``, ``dh_final``)
  3'. ``_bwd_out``  (parallel): ``dD_o = ((QK^T)*M)^T dO``, ``dQ``, the ``dK`` and ``dG`` terms of step 3.
  2'. ``_bwd_state`` (sequential, reverse): stores ``dh_{c+1}`` (gradient of the chunk's exit state),
      ``dD = dD_o + e^{gC-G} K dh_{c+1}``, ``dh_c = e^{gC} dh_{c+1} + scale (e^G Q)^T dO - W^T dD``.
  1'a. ``_bwd_prep_state`` (parallel): the gradients through ``D = U - W h_c`` and the state update:
      ``dW = -dU h_c^T`` (stored), the ``dK`` and ``dG`` terms of ``K^T (e^{gC-G} D)`` and ``e^{gC} h_c``.
  1'b. ``_bwd_prep_wy`` (parallel): the gradients through the UT transform (``dTm = dU (beta V)^T + dW (beta
      e^G K)^T``, ``dA = -Tm^T dTm Tm^T``) to ``dK, dV, dbeta`` and ``dgamma`` (the in-chunk reverse cumulative
      sum of ``dG``). Two kernels where one could do both (flash-linear-attention splits its backward the same
      way): one kernel kept 249 registers a thread live on sm_90 (one block of 8 warps a multiprocessor) and
      spilled on sm_80; apart they keep 78 and 182 on sm_90 and spill on neither (Triton 3.7.1, ``python -m
      zoo.benchmark.compile_check``), for a round trip of ``dW`` in 16 bits and a second read of ``k`` and ``dU``.

Stages. The host side is one function per kernel (:func:`prep`, :func:`state_pass`, :func:`output`,
:func:`output_grads`, :func:`state_grads`, :func:`prep_state_grads`, :func:`prep_wy_grads`), each with its
reference of the same name in :mod:`kernels.delta.stages` (tests/kernels/test_delta_stages.py checks them one by one).

Precision. With bf16 / fp16 inputs every ``tl.dot`` takes 16-bit operands (the input dtype) and
accumulates in fp32, on tensor cores; everything else is fp32: the state and its gradient stay fp32 in
registers across the sequential loop and are rounded to 16 bits only as a dot operand and where stored
for the other passes (``h``, ``dh``), as are ``U``, ``W``, ``D``, ``Tm``, ``dD`` and ``dW``, which the other
kernels read only as dot operands. The gates, ``beta``, ``A``, the masks, the gradient partials that
are summed (``dD_o``, ``dK``, ``dG``) and the outputs' accumulators are fp32. The one exception is the
triangular inverse (:func:`_unit_lower_inverse`): its 16 x 16 diagonal blocks are solved by substitution
in fp32 (a substitution compounds its roundings row after row), and the blocks are combined by products
with fp16 operands, not the input dtype: the entries are bounded (``Tm_ri = -beta_r k_r^T P k_i`` with
``P`` a product of the chunk's transitions, of norm <= 1, so ``|Tm_ri| <= beta_r <= 2`` for unit keys),
and fp16 keeps 3 more mantissa bits than bf16. Measured (BT = 64, K = 128, unit keys, beta in (0, 2),
fp64 truth): combining in bf16 doubles the finished inverse's error (1.2e-3 to 1.7e-3 against 8e-4 for
the exact inverse rounded to bf16) and adds 20 to 35 % to the error of ``U``; combined in fp16 the
inverse is within 0.7e-4 to 2.2e-4 before that rounding, and ``U``'s error is the same as with an fp32
combination. fp32 inputs keep every product in fp32 (``input_precision="ieee"``).

Sizes: ``q`` ``(B, L / NQ, H, K)``, ``k`` ``(B, L, H, K)``, ``v`` ``(B, L, H, V)``, ``beta`` ``(B, L, H)``,
``g`` ``(B, L / NQ, H)`` in their own layout (no copies; ``q``, ``k`` and ``v`` at any token stride ``SQ``,
``SK``, ``SV``, so the column blocks of a layer's projections are read in place; their gradients are written
contiguous, or at the token strides ``SDQ``, ``SDK``, ``SDV`` of their places in the gradient of the tensor they
were cut from, :mod:`kernels.grad_slots`); rows past ``L`` are masked (zero ``k``, ``beta``, ``gamma``: identity
steps). The delta product's keys and values may also come as ``(B, T, n_h, H, D)``, a token's ``n_h`` sub-steps side
by side in a row of its projections: the kernels then address position ``s`` as token ``s // NS`` and sub-step
``s % NS`` (``NS = n_h``, :func:`_at`), reading them and writing their gradients in place, where flattening them
to ``(B, L, H, D)`` would copy both.
Intermediates are ``(B*H, Lp, D)`` with ``Lp`` a multiple of ``BT``. Head dims are powers of two >= 16 (the
wrapper pads others with zero columns).

Decays within a chunk are ``exp(G_r - G_i)`` of cumulative sums, as in flash-linear-attention's kernels. Measured
in fp32 against fp64 (interpreter, T 128, chunk 64, d 16): with log decays of -20..-40 among -0.05..0 in one chunk
the output and gradients are 6e-6..3e-5 off and a strong step's gate gradient 1e3 times its size; at -40..-60
the gate gradient is lost (relative error 0.5..1.7). The chunked PyTorch path sums each segment instead
(:func:`kernels.common.segment_log_decays`): ~1e-7 on both.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..common import pow2, standard_strides, token_stride, token_stride_of
from ..grad_slots import grad_slot
from ..launch import launch
from . import TRITON_MAX_HEAD_DIM
from .chunked import interleave_inputs
from .reference import flatten_substeps

#: fp32 operands are multiplied exactly (16-bit operands ignore it: they run on tensor cores)
_PREC = tl.constexpr("ieee")


@triton.jit
def _at(b, t, L, S, SS, NS: tl.constexpr):
    """Offsets of positions ``t`` of batch ``b`` in ``k``, ``v`` or their gradients: rows ``S`` apart, or, with
    ``NS > 1`` sub-steps stored per token (the delta product's ``(B, T, n_h, H, D)`` read in place), token
    ``t // NS`` at stride ``S`` and sub-step ``t % NS`` at stride ``SS``."""
    if NS == 1:
        out = b * L * S + t * S
    else:
        out = b * (L // NS) * S + (t // NS) * S + (t % NS) * SS
    return out


# ---------------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, LOWP: tl.constexpr):
    """``(I + tril(A, -1))^{-1}`` of a ``(BT, BT)`` fp32 tile (the diagonal and upper part of ``A`` are ignored).

    Blocked: the ``BT / 16`` diagonal 16 x 16 blocks are inverted together by forward substitution (fp32,
    16 steps on a ``(BT/16, 16, 16)`` tile), then pairs of inverted blocks are merged, 16 -> 32 -> 64:
    ``[[P, 0], [C, Q]]^{-1} = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]``, for all pairs at once as
    ``Tm - (Tm Am) Tm`` with ``Tm`` block diagonal and ``Am`` the lower-left blocks ``C``. The merge products
    take fp16 operands when ``LOWP`` (see the module docstring), fp32 ones otherwise.
    """
    NB: tl.constexpr = BT // 16
    i16 = tl.arange(0, 16)
    blk = tl.arange(0, NB)
    same = (blk[:, None] == blk[None, :])[:, None, :, None]                 # (NB, 1, NB, 1)
    Ad = tl.sum(tl.where(same, tl.reshape(A, (NB, 16, NB, 16)), 0.0), 2)     # (NB, 16, 16) diagonal blocks
    Td = tl.zeros((NB, 16, 16), dtype=tl.float32) + tl.where(i16[:, None] == i16[None, :], 1.0, 0.0)[None, :, :]
    row3 = i16[None, :, None]
    for r in range(1, 16):
        # row r of every block: e_r - sum_{i < r} A_ri Tm_i (rows >= r of Td are still identity rows)
        a = tl.sum(tl.where((row3 == r) & (i16[None, None, :] < r), Ad, 0.0), 1)          # (NB, 16)
        new = tl.where(i16 == r, 1.0, 0.0)[None, :] - tl.sum(a[:, :, None] * Td, 1)      # (NB, 16)
        Td = tl.where(row3 == r, new[:, None, :], Td)
    Tm = tl.reshape(tl.where(same, Td[:, :, None, :], 0.0), (BT, BT))
    if LOWP:   # the merges take A as an fp16 operand: rounded once here, it holds half the registers
        A = A.to(tl.float16)
    if BT >= 32:
        Tm = _merge_pairs(Tm, A, 16, BT, LOWP)
    if BT >= 64:
        Tm = _merge_pairs(Tm, A, 32, BT, LOWP)
    return Tm


@triton.jit
def _merge_pairs(Tm, A, S: tl.constexpr, BT: tl.constexpr, LOWP: tl.constexpr):
    """One merge level of :func:`_unit_lower_inverse`: ``Tm`` holds the inverses of the S x S diagonal blocks;
    returns those of the 2S x 2S blocks."""
    rows = tl.arange(0, BT)
    lower_left = ((rows[:, None] // (2 * S)) == (rows[None, :] // (2 * S))) \
        & ((rows[:, None] // S) % 2 == 1) & ((rows[None, :] // S) % 2 == 0)
    Am = tl.where(lower_left, A, tl.zeros_like(A))
    # Tm - X Tm with Tm as the product's accumulator: no second fp32 tile live beside it
    if LOWP:
        X = tl.dot(Tm.to(tl.float16), Am.to(tl.float16))
        Tm = tl.dot((-X).to(tl.float16), Tm.to(tl.float16), Tm)
    else:
        X = tl.dot(Tm, Am, input_precision=_PREC)
        Tm = tl.dot(-X, Tm, Tm, input_precision=_PREC)
    return Tm


@triton.jit
def _chunk_tokens(L, H: tl.constexpr, BT: tl.constexpr):
    """``(c, bh, b, hd, rows, t, m_t)`` of a program on chunk ``c`` (axis 0) of head ``bh`` (axis 1): batch
    ``b``, head ``hd``, the chunk's rows, their positions ``t`` and the ``(BT, 1)`` mask of those before ``L``."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BT)
    t = c * BT + rows
    return c, bh, bh // H, bh % H, rows, t, (t < L)[:, None]


# ---------------------------------------------------------------------------------------------------
# forward kernels
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_prep(k_ptr, v_ptr, b_ptr, g_ptr, G_ptr, Tm_ptr, U_ptr, W_ptr, L, Lp, SK, SV, SKS, SVS,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              NQ: tl.constexpr, NS: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr):
    c, bh, b, hd, rows, t, m_t = _chunk_tokens(L, H, BT)
    DT = k_ptr.dtype.element_ty
    k_base = k_ptr + hd * K + _at(b, t, L, SK, SKS, NS)[:, None]
    beta = tl.load(b_ptr + b * L * H + hd + t * H, mask=t < L, other=0.0).to(tl.float32)
    if HAS_G:
        gam = tl.load(g_ptr + b * (L // NQ) * H + hd + (t // NQ) * H, mask=(t < L) & (t % NQ == 0),
                      other=0.0).to(tl.float32)
        G = tl.cumsum(gam, 0)
    else:
        G = tl.zeros([BT], dtype=tl.float32)
    tl.store(G_ptr + bh * Lp + t, G)

    KK = tl.zeros([BT, BT], dtype=tl.float32)
    for ik in range(K // BK):
        kb = tl.load(k_base + ik * BK + tl.arange(0, BK)[None, :], mask=m_t, other=0.0)
        KK = tl.dot(kb, tl.trans(kb), KK, input_precision=_PREC)
    strict = rows[:, None] > rows[None, :]
    A = tl.where(strict, beta[:, None] * tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)) * KK, 0.0)
    Tm = _unit_lower_inverse(A, BT, LOWP)
    tl.store(Tm_ptr + bh * Lp * BT + t[:, None] * BT + rows[None, :], Tm.to(DT))
    # diag(beta) and diag(beta e^G) folded into Tm's columns: one rounding to 16 bits per operand
    Tw = (Tm * (beta * tl.exp(G))[None, :]).to(DT)
    for ik in range(K // BK):
        offs_k = ik * BK + tl.arange(0, BK)
        kb = tl.load(k_base + offs_k[None, :], mask=m_t, other=0.0)
        W = tl.dot(Tw, kb, input_precision=_PREC)
        tl.store(W_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :], W.to(DT))
    Tu = (Tm * beta[None, :]).to(DT)
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        vv = tl.load(v_ptr + hd * V + _at(b, t, L, SV, SVS, NS)[:, None] + offs_v[None, :], mask=m_t, other=0.0)
        U = tl.dot(Tu, vv, input_precision=_PREC)
        tl.store(U_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], U.to(DT))


@triton.jit
def _fwd_state(k_ptr, G_ptr, U_ptr, W_ptr, h0_ptr, h_ptr, D_ptr, hT_ptr, L, Lp, N, SK, SKS,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
               NS: tl.constexpr, HAS_H0: tl.constexpr):
    iv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    hd = bh % H
    DT = W_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    kv_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + bh * K * V + kv_off)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for c in range(N):
        tl.store(h_ptr + (bh * N + c) * K * V + kv_off, S.to(DT))
        t = c * BT + rows
        W = tl.load(W_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        U = tl.load(U_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        D = U.to(tl.float32) - tl.dot(W, S.to(DT), input_precision=_PREC)
        tl.store(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], D.to(DT))
        G = tl.load(G_ptr + bh * Lp + t)
        gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
        kT = tl.load(k_ptr + hd * K + offs_k[:, None] + _at(b, t, L, SK, SKS, NS)[None, :],
                     mask=(t < L)[None, :], other=0.0)
        S = S * tl.exp(gC) + tl.dot(kT, (D * tl.exp(gC - G)[:, None]).to(DT), input_precision=_PREC)
    tl.store(hT_ptr + bh * K * V + kv_off, S)


@triton.jit
def _fwd_out(q_ptr, k_ptr, G_ptr, h_ptr, D_ptr, o_ptr, scale, L, Lp, N, SQ, SK, SKS,
             H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
             NQ: tl.constexpr, NS: tl.constexpr):
    c, bh, b, hd, rows, t, m_t = _chunk_tokens(L, H, BT)
    DT = k_ptr.dtype.element_ty
    BQ: tl.constexpr = BT // NQ
    qi = tl.arange(0, BQ)
    p = qi * NQ + NQ - 1                      # in-chunk positions of the query rows
    offs_k = tl.arange(0, K)
    tok = c * BQ + qi
    m_q = (tok < L // NQ)[:, None]
    qq = tl.load(q_ptr + b * (L // NQ) * SQ + hd * K + tok[:, None] * SQ + offs_k[None, :], mask=m_q,
                 other=0.0)
    kk = tl.load(k_ptr + hd * K + _at(b, t, L, SK, SKS, NS)[:, None] + offs_k[None, :], mask=m_t, other=0.0)
    G = tl.load(G_ptr + bh * Lp + t)
    Gq = tl.load(G_ptr + bh * Lp + c * BT + p)
    causal = p[:, None] >= rows[None, :]
    Mi = tl.where(causal, tl.exp(tl.where(causal, Gq[:, None] - G[None, :], 0.0)), 0.0)
    P = (tl.dot(qq, tl.trans(kk), input_precision=_PREC) * (Mi * scale)).to(DT)
    eGq = scale * tl.exp(Gq)
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        S0 = tl.load(h_ptr + (bh * N + c) * K * V + offs_k[:, None] * V + offs_v[None, :])
        D = tl.load(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        o = tl.dot(qq, S0, input_precision=_PREC) * eGq[:, None]
        o = tl.dot(P, D, o, input_precision=_PREC)
        tl.store(o_ptr + (b * (L // NQ) * H + hd) * V + tok[:, None] * (H * V) + offs_v[None, :], o, mask=m_q)


# ---------------------------------------------------------------------------------------------------
# backward kernels
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_out(q_ptr, k_ptr, G_ptr, h_ptr, D_ptr, do_ptr, dq_ptr, dk_ptr, dG_ptr, dDo_ptr, scale, L, Lp, N, SQ, SK,
             SKS, SDQ, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
             BV: tl.constexpr, NQ: tl.constexpr, NS: tl.constexpr):
    c, bh, b, hd, rows, t, m_t = _chunk_tokens(L, H, BT)
    DT = k_ptr.dtype.element_ty
    BQ: tl.constexpr = BT // NQ
    qi = tl.arange(0, BQ)
    p = qi * NQ + NQ - 1
    offs_k = tl.arange(0, K)
    tok = c * BQ + qi
    m_q = (tok < L // NQ)[:, None]
    q_base = b * (L // NQ) * SQ + hd * K + tok[:, None] * SQ
    dq_base = b * (L // NQ) * SDQ + hd * K + tok[:, None] * SDQ
    k_base = hd * K + _at(b, t, L, SK, SKS, NS)[:, None]
    do_base = (b * (L // NQ) * H + hd) * V + tok[:, None] * (H * V)
    G = tl.load(G_ptr + bh * Lp + t)
    Gq = tl.load(G_ptr + bh * Lp + c * BT + p)
    causal = p[:, None] >= rows[None, :]
    qq = tl.load(q_ptr + q_base + offs_k[None, :], mask=m_q, other=0.0)
    kk = tl.load(k_ptr + k_base + offs_k[None, :], mask=m_t, other=0.0)
    # P = (Q K^T) * M in fp32 is all the loop below keeps of Q K^T and M (M is formed again after it: two fp32
    # tiles fewer live beside the loop's products)
    P = tl.dot(qq, tl.trans(kk), input_precision=_PREC) \
        * (tl.where(causal, tl.exp(tl.where(causal, Gq[:, None] - G[None, :], 0.0)), 0.0) * scale)
    Pd = P.to(DT)                                                            # (BQ, BT)
    dP = tl.zeros([BQ, BT], dtype=tl.float32)
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        D_T = tl.load(D_ptr + bh * Lp * V + offs_v[:, None] + t[None, :] * V)                # (BV, BT)
        do = tl.load(do_ptr + do_base + offs_v[None, :], mask=m_q, other=0.0)
        tl.store(dDo_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :],
                 tl.dot(tl.trans(Pd), do, input_precision=_PREC))
        dP = tl.dot(do, D_T, dP, input_precision=_PREC)
    dQK = dP * (tl.where(causal, tl.exp(tl.where(causal, Gq[:, None] - G[None, :], 0.0)), 0.0) * scale)
    dQKd = dQK.to(DT)
    Z = dP * P
    at_q = tl.sum(Z, 1)                                   # d/dG at the query rows (+ e^G Q h_c below)
    dG = -tl.sum(Z, 0)                                    # and at every column
    eGq = scale * tl.exp(Gq)
    # per K block: dQ = dQK K + e^G dO h_c^T, dK = dQK^T Q
    for ik in range(K // BK):
        offs_kb = ik * BK + tl.arange(0, BK)
        dqS = tl.zeros([BQ, BK], dtype=tl.float32)
        for iv in range(V // BV):
            offs_v = iv * BV + tl.arange(0, BV)
            S0T = tl.load(h_ptr + (bh * N + c) * K * V + offs_v[:, None] + offs_kb[None, :] * V)   # (BV, BK)
            do = tl.load(do_ptr + do_base + offs_v[None, :], mask=m_q, other=0.0)
            dqS = tl.dot(do, S0T, dqS, input_precision=_PREC)
        dqg = eGq[:, None] * dqS
        qb = tl.load(q_ptr + q_base + offs_kb[None, :], mask=m_q, other=0.0)
        kb = tl.load(k_ptr + k_base + offs_kb[None, :], mask=m_t, other=0.0)
        tl.store(dq_ptr + dq_base + offs_kb[None, :], tl.dot(dQKd, kb, dqg, input_precision=_PREC), mask=m_q)
        tl.store(dk_ptr + bh * Lp * K + t[:, None] * K + offs_kb[None, :],
                 tl.dot(tl.trans(dQKd), qb, input_precision=_PREC))
        at_q += tl.sum(dqg * qb.to(tl.float32), 1)
    if NQ == 1:
        dG += at_q
    else:
        dG += tl.sum(tl.where(p[:, None] == rows[None, :], at_q[:, None], 0.0), 0)
    tl.store(dG_ptr + bh * Lp + t, dG)


@triton.jit
def _bwd_state(q_ptr, k_ptr, G_ptr, W_ptr, do_ptr, dDo_ptr, dhT_ptr, dh_ptr, dU_ptr, dh0_ptr, scale, L, Lp, N, SQ, SK,
               SKS, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
               NQ: tl.constexpr, NS: tl.constexpr, HAS_DHT: tl.constexpr):
    iv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    hd = bh % H
    DT = W_ptr.dtype.element_ty
    BQ: tl.constexpr = BT // NQ
    rows = tl.arange(0, BT)
    qi = tl.arange(0, BQ)
    p = qi * NQ + NQ - 1
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    kv_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_DHT:
        dS = tl.load(dhT_ptr + bh * K * V + kv_off)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(N):
        c = N - 1 - i
        tl.store(dh_ptr + (bh * N + c) * K * V + kv_off, dS.to(DT))
        t = c * BT + rows
        tok = c * BQ + qi
        kk = tl.load(k_ptr + hd * K + _at(b, t, L, SK, SKS, NS)[:, None] + offs_k[None, :],
                     mask=(t < L)[:, None], other=0.0)
        G = tl.load(G_ptr + bh * Lp + t)
        gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
        dD = tl.load(dDo_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :]) \
            + tl.dot(kk, dS.to(DT), input_precision=_PREC) * tl.exp(gC - G)[:, None]
        tl.store(dU_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], dD.to(DT))
        qT = tl.load(q_ptr + b * (L // NQ) * SQ + hd * K + offs_k[:, None] + tok[None, :] * SQ,
                     mask=(tok < L // NQ)[None, :], other=0.0)
        Gq = tl.load(G_ptr + bh * Lp + c * BT + p)
        do = tl.load(do_ptr + (b * (L // NQ) * H + hd) * V + tok[:, None] * (H * V) + offs_v[None, :],
                     mask=(tok < L // NQ)[:, None], other=0.0)
        WT = tl.load(W_ptr + bh * Lp * K + offs_k[:, None] + t[None, :] * K)
        dS = dS * tl.exp(gC) + tl.dot(qT, (do * (scale * tl.exp(Gq))[:, None]).to(DT), input_precision=_PREC)
        dS = dS - tl.dot(WT, dD.to(DT), input_precision=_PREC)
    tl.store(dh0_ptr + bh * K * V + kv_off, dS)


@triton.jit
def _bwd_prep_state(k_ptr, G_ptr, h_ptr, D_ptr, dh_ptr, dU_ptr, dW_ptr, dko_ptr, dGo_ptr, L, Lp, N, SK, SKS,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, NS: tl.constexpr, HAS_G: tl.constexpr):
    """Step 1'a: the gradients through ``D = U - W h_c`` and the state update ``K^T (e^{gC - G} D)``: stores
    ``dW = -dU h_c^T`` and adds ``e^{gC - G} D dh_{c+1}^T`` to the partial ``dK`` and the gate terms to the partial
    ``dG`` (both read, added and written in place: each element belongs to one program)."""
    c, bh, b, hd, rows, t, m_t = _chunk_tokens(L, H, BT)
    DT = k_ptr.dtype.element_ty
    k_base = k_ptr + hd * K + _at(b, t, L, SK, SKS, NS)[:, None]
    G = tl.load(G_ptr + bh * Lp + t)
    gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
    e = tl.exp(gC - G)
    z = tl.zeros([BT], dtype=tl.float32)
    dgC = tl.zeros([BV], dtype=tl.float32)
    for ik in range(K // BK):
        offs_k = ik * BK + tl.arange(0, BK)
        dW = tl.zeros([BT, BK], dtype=tl.float32)
        dKd = tl.zeros([BT, BK], dtype=tl.float32)
        for iv in range(V // BV):
            offs_v = iv * BV + tl.arange(0, BV)
            vk_off = (bh * N + c) * K * V + offs_v[:, None] + offs_k[None, :] * V          # (BV, BK) of h_c^T
            S0T = tl.load(h_ptr + vk_off)
            dST = tl.load(dh_ptr + vk_off)
            D = tl.load(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
            dD = tl.load(dU_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
            dW = tl.dot(dD, S0T, dW, input_precision=_PREC)
            dKd = tl.dot(D, dST, dKd, input_precision=_PREC)
            if HAS_G:
                dgC += tl.sum(S0T.to(tl.float32) * dST.to(tl.float32), 1)
        k_off = bh * Lp * K + t[:, None] * K + offs_k[None, :]
        tl.store(dW_ptr + k_off, (-dW).to(DT))
        tl.store(dko_ptr + k_off, tl.load(dko_ptr + k_off) + e[:, None] * dKd)
        if HAS_G:
            kb = tl.load(k_base + offs_k[None, :], mask=m_t, other=0.0)
            z += e * tl.sum(dKd * kb.to(tl.float32), 1)
    if HAS_G:
        dG = tl.load(dGo_ptr + bh * Lp + t) - z
        dG += tl.where(rows == BT - 1, tl.sum(dgC, 0) * tl.exp(gC) + tl.sum(z, 0), 0.0)
        tl.store(dGo_ptr + bh * Lp + t, dG)


@triton.jit
def _bwd_prep_wy(k_ptr, v_ptr, b_ptr, G_ptr, Tm_ptr, dU_ptr, dW_ptr, dks_ptr, dGs_ptr,
                 dk_ptr, dv_ptr, db_ptr, dg_ptr, L, Lp, SK, SV, SDK, SDV, SKS, SVS, SDKS, SDVS,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, NQ: tl.constexpr, NS: tl.constexpr, HAS_G: tl.constexpr):
    """Step 1'b: the gradients through the UT transform, ``U = Tm diag(beta) V``, ``W = Tm diag(beta e^G) K`` and
    ``Tm = (I + A)^{-1}`` (``dTm = dU (beta V)^T + dW (beta e^G K)^T``, ``dA = -Tm^T dTm Tm^T``), to the inputs'
    ``dK`` (with the partial one of step 1'a), ``dV``, ``dbeta`` and ``dgamma``."""
    c, bh, b, hd, rows, t, m_t = _chunk_tokens(L, H, BT)
    DT = k_ptr.dtype.element_ty
    k_base = hd * K + _at(b, t, L, SK, SKS, NS)[:, None]
    dk_base = hd * K + _at(b, t, L, SDK, SDKS, NS)[:, None]
    beta = tl.load(b_ptr + b * L * H + hd + t * H, mask=t < L, other=0.0).to(tl.float32)
    G = tl.load(G_ptr + bh * Lp + t)
    TmT = tl.trans(tl.load(Tm_ptr + bh * Lp * BT + t[:, None] * BT + rows[None, :]))
    eG = tl.exp(G)
    bg = beta * eG

    # U = Tm diag(beta) V: dTm, dV, dbeta
    dTm = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        vv = tl.load(v_ptr + hd * V + _at(b, t, L, SV, SVS, NS)[:, None] + offs_v[None, :], mask=m_t, other=0.0)
        dD = tl.load(dU_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        dTm += tl.dot(dD, tl.trans(vv), input_precision=_PREC) * beta[None, :]
        dbv = tl.dot(TmT, dD, input_precision=_PREC)
        tl.store(dv_ptr + hd * V + _at(b, t, L, SDV, SDVS, NS)[:, None] + offs_v[None, :], beta[:, None] * dbv,
                 mask=m_t)
        db += tl.sum(dbv * vv.to(tl.float32), 1)
    # W = Tm diag(beta e^G) K: dTm, d(beta e^G)
    dbg = tl.zeros([BT], dtype=tl.float32)
    for ik in range(K // BK):
        offs_k = ik * BK + tl.arange(0, BK)
        kb = tl.load(k_ptr + k_base + offs_k[None, :], mask=m_t, other=0.0)
        dWd = tl.load(dW_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        dTm += tl.dot(dWd, tl.trans(kb), input_precision=_PREC) * bg[None, :]
        dbg += tl.sum(tl.dot(TmT, dWd, input_precision=_PREC) * kb.to(tl.float32), 1)
    db += dbg * eG
    # Tm = (I + A)^{-1}:  dA = -Tm^T dTm Tm^T  (strictly lower part), A = diag(beta) M K K^T
    strict = rows[:, None] > rows[None, :]
    X = tl.dot(dTm.to(DT), TmT, input_precision=_PREC)
    dA = tl.where(strict, -tl.dot(TmT, X.to(DT), input_precision=_PREC), 0.0)
    dAM = dA * tl.where(strict, tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)), 0.0)
    E = beta[:, None] * dAM
    Es = (E + tl.trans(E)).to(DT)      # dK of A's k_r . k_i: E K + E^T K
    # dK = step 1'a's partial + W's part (Tm^T dW, formed again: cheaper than a round trip of fp32 partials) + A's;
    # K K^T is summed here, where dTm is no longer live
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    for ik in range(K // BK):
        offs_k = ik * BK + tl.arange(0, BK)
        k_off = bh * Lp * K + t[:, None] * K + offs_k[None, :]
        kb = tl.load(k_ptr + k_base + offs_k[None, :], mask=m_t, other=0.0)
        dWd = tl.load(dW_ptr + k_off)
        KK = tl.dot(kb, tl.trans(kb), KK, input_precision=_PREC)
        dk = tl.load(dks_ptr + k_off) + bg[:, None] * tl.dot(TmT, dWd, input_precision=_PREC)
        dk = tl.dot(Es, kb, dk, input_precision=_PREC)
        tl.store(dk_ptr + dk_base + offs_k[None, :], dk, mask=m_t)
    dAMK = dAM * KK
    db += tl.sum(dAMK, 1)
    tl.store(db_ptr + b * L * H + hd + t * H, db, mask=t < L)
    if HAS_G:
        Z = beta[:, None] * dAMK                             # dA * A
        dG = dbg * bg + tl.sum(Z, 1) - tl.sum(Z, 0) + tl.load(dGs_ptr + bh * Lp + t)
        # G = in-chunk cumsum(gamma): dgamma_r = sum_{s >= r} dG_s
        dgam = tl.sum(dG, 0) - tl.cumsum(dG, 0) + dG
        tl.store(dg_ptr + b * (L // NQ) * H + hd + (t // NQ) * H, dgam, mask=(t < L) & (t % NQ == 0))


# ---------------------------------------------------------------------------------------------------
# launch choices
# ---------------------------------------------------------------------------------------------------
#: largest V (and K) block of one program of the state passes or of one step of a loop over the head dims
#: (tests lower it to exercise those loops)
BLOCK_V_MAX = 64
#: largest chunk the kernels use (the inverse's merges are written for BT / 16 a power of two)
MAX_CHUNK = 64


class KernelPlan(NamedTuple):
    """Block sizes and warps of one launch of the seven kernels."""

    bv_state: int            # V block of one program of the state passes
    bk: int                  # K block of the loops over K in the parallel kernels
    bv: int                  # V block of the loops over V in the parallel kernels
    warps: int               # num_warps of the parallel kernels
    warps_fwd_state: int
    warps_bwd_state: int
    stages_state: int = 3    # num_stages of the state passes: loads of how many chunks ahead are in flight


def kernel_plan(BT: int, K: int, V: int, low_precision: bool) -> KernelPlan:
    """Blocks and warps from the shapes (no autotuning: a first call compiles one configuration).

    Chosen by compiling for sm_80 / sm_90 (``python -m zoo.benchmark.compile_check``) for registers,
    spills and shared memory. 16-bit inputs: a chunk of 64 at head dim >= 64 keeps several (64 x block)
    fp32 accumulators live, so its parallel kernels run 8 warps and loop over head dims in blocks of 32
    (blocks of 64 spill in the backward's preparation); the state passes keep a K x BV fp32 state in registers, BV = 32
    at K >= 64 (more programs per head also shorten the sequential pass on a GPU with many SMs), the
    forward one in one warpgroup. fp32 inputs: products are not on tensor cores and their operands live in
    registers, so every tile is smaller (blocks of 32, a state of K x 16 at K >= 64) over 8 warps.
    """
    half, quarter = max(16, BLOCK_V_MAX // 2), max(16, BLOCK_V_MAX // 4)
    if low_precision:
        big = BT * max(K, V) >= 64 * 64
        loop = half if big else BLOCK_V_MAX
        state = half if K >= 64 else BLOCK_V_MAX
        warps = 8 if big else 4
        return KernelPlan(min(V, state), min(K, loop), min(V, loop), warps, 4, warps)
    state = quarter if K >= 64 else half
    warps = 8 if max(K, V) >= 32 else 4
    return KernelPlan(min(V, state), min(K, half), min(V, half), warps, warps, warps)


_tuned: KernelPlan | None = None


@contextlib.contextmanager
def using_plan(plan: KernelPlan):
    """Run the seven kernels with ``plan`` instead of :func:`kernel_plan`'s inside (the tuning sweep
    ``python -m zoo.benchmark.delta_tune`` times candidates this way; one plan serves every shape inside)."""
    global _tuned
    outer, _tuned = _tuned, plan
    try:
        yield plan
    finally:
        _tuned = outer


def block_chunk(chunk_size: int, K: int, V: int, low_precision: bool = False) -> int:
    """The chunk the kernels run: ``chunk_size`` rounded up to a power of two >= 16 (``tl.dot`` block
    limits), at most :data:`MAX_CHUNK`; with fp32 inputs at most 32 from head dim 32 on (fp32 products are
    not on tensor cores, their 64-long chunk tiles spill heavily, and at K = V = 128 they need more shared
    memory than an sm_80 block has). The result does not depend on it."""
    cap = MAX_CHUNK if low_precision or max(K, V) < 32 else 32
    return min(pow2(int(chunk_size), 16), cap)


def query_stride(num_householder: int, BT: int) -> int:
    """``NQ``: ``n_h`` when a chunk's query rows fill a tensor-core tile (``BT / n_h`` an integer >= 16), else 1
    (the glue then interleaves ``q`` and ``g`` with zeros)."""
    n = num_householder
    return n if n > 1 and BT % n == 0 and BT // n >= 16 else 1


# ---------------------------------------------------------------------------------------------------
# the stages: one launch each, each with its reference in kernels.delta.stages; layouts as in the module
# docstring, intermediates (B*H, Lp, ...) with Lp = N * BT, the chunk states (B*H, N, K, V)
# ---------------------------------------------------------------------------------------------------
def addressable(x: torch.Tensor) -> torch.Tensor:
    """``x (B, L, H, D)`` as the kernels read ``q``, ``k`` and ``v``: at its token stride
    (:func:`kernels.common.token_stride`) where it has one (a column block of a layer's fused projections), else
    a contiguous copy. Keys and values may also come as ``(B, T, n_h, H, D)``, ``n_h`` sub-steps a token at a
    stride of their own (the delta product's, cut from its projections), read in place the same way."""
    return x if _token_stride(x) is not None else standard_strides(x)


def grad_at_token_stride(x: torch.Tensor) -> torch.Tensor:
    """The buffer of ``x``'s gradient: in place in the gradient of the tensor ``x`` was cut from
    (:func:`kernels.grad_slots.grad_slot`) where that slot has a token stride the kernels can write at, else
    contiguous."""
    slot = grad_slot(x)
    return slot if slot is not None and _token_stride(slot) is not None else \
        torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _token_stride(x: torch.Tensor) -> int | None:
    """:func:`kernels.common.token_stride` of ``x``, of its first sub-step where it holds ``n_h`` a token (from
    the strides: a view made at every stage's launch costs the host a dispatch)."""
    if x.dim() != 5:
        return token_stride(x)
    (B, T, _, H, D), st = x.shape, x.stride()
    return token_stride_of((B, T, H, D), (st[0], st[1], st[3], st[4]))


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """``(S, SS)`` of ``k``, ``v`` or their gradients for the kernels' addressing (:func:`_at`): the token stride
    and, with sub-steps stored per token, theirs (else 0)."""
    return (x.stride(1), x.stride(2)) if x.dim() == 5 else (x.stride(1), 0)


def _positions_shape(k: torch.Tensor) -> tuple[int, int, int, int]:
    """``(B, L, H, K)`` of keys given as ``(B, L, H, K)`` or as ``(B, T, n_h, H, K)`` (``L = T n_h`` positions)."""
    return (k.shape[0], k.shape[1] * k.shape[2], *k.shape[3:]) if k.dim() == 5 else tuple(k.shape)


def _substeps(k: torch.Tensor) -> int:
    """``NS``: the sub-steps a token of ``k`` stores (1 for ``(B, L, H, K)``)."""
    return k.shape[2] if k.dim() == 5 else 1


def _dims(k, V: int, BT: int):
    """``(B, L, H, K, N, plan)``: the sizes of a launch on keys ``k`` and values of head dim ``V``, its number
    of chunks and its block plan (a tuning sweep's, else :func:`kernel_plan`'s)."""
    B, L, H, K = _positions_shape(k)
    return B, L, H, K, -(-L // BT), _tuned or kernel_plan(BT, K, V, k.dtype != torch.float32)


def prep(k, v, beta, g, NQ: int, BT: int):
    """``(G, Tm, U, W)``: the in-chunk cumulative gate (fp32), the UT transform ``Tm = (I + A)^{-1}``, and
    ``U = Tm diag(beta) V``, ``W = Tm diag(beta e^G) K`` (in ``k``'s dtype)."""
    V = v.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    k, v = addressable(k), addressable(v)
    lowp, dt = k.dtype != torch.float32, k.dtype
    G = torch.empty(B * H, N * BT, device=k.device, dtype=torch.float32)
    Tm = torch.empty(B * H, N * BT, BT, device=k.device, dtype=dt)
    U = torch.empty(B * H, N * BT, V, device=k.device, dtype=dt)
    W = torch.empty(B * H, N * BT, K, device=k.device, dtype=dt)
    (SK, SKS), (SV, SVS) = _rows(k), _rows(v)
    launch(_fwd_prep, (N, B * H), k, v, beta, g if g is not None else beta, G, Tm, U, W, L, N * BT, SK, SV, SKS, SVS,
           H=H, K=K, V=V, BT=BT, BK=plan.bk, BV=plan.bv, NQ=NQ, NS=_substeps(k), HAS_G=g is not None, LOWP=lowp,
           num_warps=plan.warps)
    return G, Tm, U, W


def state_pass(k, G, U, W, h0, BT: int):
    """``(h, D, hT)``: the state entering every chunk (in ``k``'s dtype), ``D = U - W h_c``, and the final
    state (fp32), from ``h0`` (fp32) or zero."""
    V = U.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    k = addressable(k)
    h = torch.empty(B * H, N, K, V, device=k.device, dtype=k.dtype)
    D = torch.empty(B * H, N * BT, V, device=k.device, dtype=k.dtype)
    hT = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32)
    launch(_fwd_state, (V // plan.bv_state, B * H), k, G, U, W, h0 if h0 is not None else hT, h, D, hT, L, N * BT,
           N, *_rows(k), H=H, K=K, V=V, BT=BT, BV=plan.bv_state, NS=_substeps(k), HAS_H0=h0 is not None,
           num_warps=plan.warps_fwd_state, num_stages=plan.stages_state)
    return h, D, hT


def output(q, k, G, h, D, scale: float, NQ: int, BT: int):
    """``o (B, L / NQ, H, V)`` at the query rows: ``scale (e^G Q h_c + ((Q K^T) * M) D)``."""
    V = D.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    q, k = addressable(q), addressable(k)
    o = torch.empty(B, L // NQ, H, V, device=k.device, dtype=k.dtype)
    launch(_fwd_out, (N, B * H), q, k, G, h, D, o, float(scale), L, N * BT, N, q.stride(1), *_rows(k),
           H=H, K=K, V=V, BT=BT, BV=plan.bv, NQ=NQ, NS=_substeps(k), num_warps=plan.warps)
    return o


def output_grads(q, k, G, h, D, do, scale: float, NQ: int, BT: int):
    """``(dq, dk_o, dG_o, dDo)``: the gradients of ``<dO, o>`` through :func:`output` w.r.t. ``q`` (whole),
    ``k``, ``G`` and ``D`` (fp32 partials, ``(B*H, Lp, ...)``), with ``h`` held fixed."""
    V = D.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    f32 = dict(device=k.device, dtype=torch.float32)
    q, k = addressable(q), addressable(k)
    dq = grad_at_token_stride(q)
    dk_o = torch.empty(B * H, N * BT, K, **f32)
    dG_o = torch.empty(B * H, N * BT, **f32)
    dDo = torch.empty(B * H, N * BT, V, **f32)
    launch(_bwd_out, (N, B * H), q, k, G, h, D, do, dq, dk_o, dG_o, dDo, float(scale), L, N * BT, N,
           q.stride(1), *_rows(k), dq.stride(1), H=H, K=K, V=V, BT=BT, BK=plan.bk, BV=plan.bv, NQ=NQ,
           NS=_substeps(k), num_warps=plan.warps)
    return dq, dk_o, dG_o, dDo


def state_grads(q, k, G, W, do, dDo, dhT, scale: float, NQ: int, BT: int):
    """``(dh, dU, dh0)``: the gradient of every chunk's exit state (in ``k``'s dtype), that of ``U`` (= of
    ``D``: ``dDo`` plus the state update's part) and of the initial state (fp32), from ``dhT`` (or zero)."""
    V = dDo.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    q, k = addressable(q), addressable(k)
    dh = torch.empty(B * H, N, K, V, device=k.device, dtype=k.dtype)
    dU = torch.empty(B * H, N * BT, V, device=k.device, dtype=k.dtype)
    dh0 = torch.empty(B, H, K, V, device=k.device, dtype=torch.float32)
    launch(_bwd_state, (V // plan.bv_state, B * H), q, k, G, W, do, dDo,
           dhT.float().contiguous() if dhT is not None else dh0, dh, dU, dh0, float(scale), L, N * BT, N,
           q.stride(1), *_rows(k), H=H, K=K, V=V, BT=BT, BV=plan.bv_state, NQ=NQ, NS=_substeps(k),
           HAS_DHT=dhT is not None, num_warps=plan.warps_bwd_state, num_stages=plan.stages_state)
    return dh, dU, dh0


def prep_state_grads(k, G, h, D, dh, dU, dk_o, dG_o, BT: int, gated: bool = True):
    """``(dW, dk_s, dG_s)``: the gradient of ``W`` (``-dU h_c^T``, in ``k``'s dtype) and the partial gradients of
    ``k`` and ``G`` with the state update's parts added to the output's ``dk_o`` and ``dG_o`` (in place: those
    buffers are returned; without a gate (``gated`` False) ``G`` is zero and ``dG_o`` is left as it is)."""
    V = D.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    k = addressable(k)
    dW = torch.empty(B * H, N * BT, K, device=k.device, dtype=k.dtype)
    launch(_bwd_prep_state, (N, B * H), k, G, h, D, dh, dU, dW, dk_o, dG_o, L, N * BT, N, *_rows(k),
           H=H, K=K, V=V, BT=BT, BK=plan.bk, BV=plan.bv, NS=_substeps(k), HAS_G=gated,
           num_warps=plan.warps)
    return dW, dk_o, dG_o


def prep_wy_grads(k, v, beta, g, G, Tm, dU, dW, dk_s, dG_s, NQ: int, BT: int):
    """``(dk, dv, dbeta, dg)``: the inputs' gradients through the UT transform (``U``, ``W`` and ``Tm``), with the
    partials ``dk_s`` and ``dG_s`` of :func:`prep_state_grads` added (``dg`` None without a gate)."""
    V = v.shape[-1]
    B, L, H, K, N, plan = _dims(k, V, BT)
    k, v = addressable(k), addressable(v)
    dk, dv, db = grad_at_token_stride(k), grad_at_token_stride(v), torch.empty_like(beta)
    dg = torch.empty_like(g) if g is not None else None
    (SK, SKS), (SV, SVS), (SDK, SDKS), (SDV, SDVS) = _rows(k), _rows(v), _rows(dk), _rows(dv)
    launch(_bwd_prep_wy, (N, B * H), k, v, beta, G, Tm, dU, dW, dk_s, dG_s, dk, dv, db,
           dg if g is not None else db, L, N * BT, SK, SV, SDK, SDV, SKS, SVS, SDKS, SDVS,
           H=H, K=K, V=V, BT=BT, BK=plan.bk, BV=plan.bv, NQ=NQ, NS=_substeps(k), HAS_G=g is not None,
           num_warps=plan.warps)
    return dk, dv, db, dg


class ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """The seven kernels with autograd.

    Inputs: ``q`` ``(B, L/NQ, H, K)``, ``k`` ``(B, L, H, K)``, ``v`` ``(B, L, H, V)`` (one dtype: fp32, bf16 or
    fp16, :func:`addressable`: read in place at their token strides, head dims powers of two >= 16), ``beta``
    ``(B, L, H)``, ``g`` ``(B, L/NQ, H)`` or None, ``h0`` ``(B, H, K, V)`` fp32 or None, ``scale``, ``NQ``, chunk
    ``BT``. Returns ``o`` ``(B, L/NQ, H, V)`` in the inputs' dtype and the final state ``(B, H, K, V)`` in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, scale: float, NQ: int, BT: int):
        ctx.set_materialize_grads(False)          # an unused final state gets no zero-filled gradient
        G, Tm, U, W = prep(k, v, beta, g, NQ, BT)
        h, D, hT = state_pass(k, G, U, W, h0, BT)
        o = output(q, k, G, h, D, scale, NQ, BT)
        ctx.save_for_backward(q, k, v, beta, g, G, Tm, W, h, D)
        ctx.args = (scale, NQ, BT, h0 is not None)
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, beta, g, G, Tm, W, h, D = ctx.saved_tensors
        scale, NQ, BT, has_h0 = ctx.args
        B, L, H = beta.shape
        do = torch.zeros(B, L // NQ, H, v.shape[-1], dtype=k.dtype, device=k.device) if do is None else \
            do.to(k.dtype).contiguous()
        dq, dk_o, dG_o, dDo = output_grads(q, k, G, h, D, do, scale, NQ, BT)
        dh, dU, dh0 = state_grads(q, k, G, W, do, dDo, dhT, scale, NQ, BT)
        dW, dk_s, dG_s = prep_state_grads(k, G, h, D, dh, dU, dk_o, dG_o, BT, g is not None)
        dk, dv, db, dg = prep_wy_grads(k, v, beta, g, G, Tm, dU, dW, dk_s, dG_s, NQ, BT)
        return dq, dk, dv, db, dg, (dh0 if has_h0 else None), None, None, None


def chunk_gated_delta_rule_triton(q, k, v, beta, gamma, initial_state=None, chunk_size: int = 64, scale: float = 1.0,
                                  query_stride: int = 1):
    """The gated delta rule on ``(B, L, H, D)`` inputs (same contract as
    :func:`kernels.delta.chunked.chunk_gated_delta_rule_torch` with ``q`` pre-scaled by ``scale``).

    ``query_stride = NQ > 1``: ``q`` ``(B, L / NQ, H, K)`` holds the queries of positions ``NQ-1, 2 NQ-1, ...``
    only (the others are zero), ``gamma`` ``(B, L / NQ, H)`` the gates of positions ``0, NQ, 2 NQ, ...`` (the
    others are zero), and ``o`` is returned at the query positions only (the delta product's layout); it
    must divide the chunk :func:`block_chunk` into tiles of at least 16 rows. bf16 / fp16 ``q, k, v`` of one
    dtype run the 16-bit kernels (tensor cores); anything else runs in fp32. Head dims above
    :data:`kernels.delta.TRITON_MAX_HEAD_DIM` are refused. Returns ``(o in the kernels' dtype, final state in fp32)``.
    """
    B, L, H, K = _positions_shape(k)
    V = v.shape[-1]
    if k.dim() != v.dim():
        raise ValueError(f"delta_product (triton): k {tuple(k.shape)} and v {tuple(v.shape)} must both hold one "
                         f"position a row or both n_h sub-steps a token")
    if max(K, V) > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"delta_product (triton): head dims K={K}, V={V} above {TRITON_MAX_HEAD_DIM} need more shared "
                         f"memory than a GPU block has; use backend='fla' or 'torch'")
    lowp = q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
    dt = q.dtype if lowp else torch.float32
    BT = block_chunk(chunk_size, K, V, lowp)
    NQ = int(query_stride)
    if NQ > 1 and (BT % NQ or BT // NQ < 16 or L % NQ):
        raise ValueError(f"delta_product (triton): query_stride {NQ} must divide the length {L} and the chunk {BT} "
                         f"into tiles of >= 16 rows; interleave the queries instead (query_stride=1)")
    Kp, Vp = pow2(K, 16), pow2(V, 16)
    if (L + BT) * H * max(Kp, Vp, BT) >= 2 ** 31:
        raise ValueError(f"delta_product (triton): {L} positions x {H} heads x head dim {max(K, V)} overflow the "
                         f"kernels' 32-bit row offsets; run the sequence in pieces with the state carried")

    def cols(x, D, Dp):   # zero columns up to a power-of-two head dim, in the compute dtype
        x = x.to(dt)
        return addressable(F.pad(x, (0, Dp - D)) if Dp != D else x)

    h0 = None
    if initial_state is not None:
        h0 = F.pad(initial_state.float(), (0, Vp - V, 0, Kp - K)).contiguous()
    o, S = ChunkGatedDeltaRuleTriton.apply(cols(q, K, Kp), cols(k, K, Kp), cols(v, V, Vp), beta.contiguous(),
                                           None if gamma is None else gamma.contiguous(), h0, float(scale), NQ, BT)
    return o[..., :V], S[..., :K, :V]


def delta_product_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    num_householder: int = 1,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta product (layout of :mod:`kernels.delta.reference`) with the Triton chunk kernels.

    The kernels read the ``n_h`` sub-steps in place (:func:`query_stride`), or, when a chunk holds too few
    queries for a tensor-core tile, after the queries and gates have been interleaved with zeros. The chunk
    the kernels run is :func:`block_chunk` of ``chunk_size``; it does not change the result. Returns
    ``(o in q's dtype, final state in fp32)``.
    """
    B, T, H, K = q.shape
    n = num_householder
    # keys and values given as (B, T, n_h, H, D) stay so: the kernels read their sub-steps in place
    substeps = [x for x in (k, v) if x.dim() == 5 and x.shape[1:3] == (T, n)]
    k, v = (x if len(substeps) == 2 else flatten_substeps(x, n, T, what) for x, what in ((k, "k"), (v, "v")))
    beta = flatten_substeps(beta, n, T, "beta")
    scale = K ** -0.5 if scale is None else scale
    lowp = q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
    NQ = query_stride(n, block_chunk(chunk_size, K, v.shape[-1], lowp))
    qi, gi = q, g
    if n > 1 and NQ == 1:            # queries on the last sub-step, the gate on sub-step 0, zeros elsewhere
        qi, gi = interleave_inputs(q, g, n, T * n)
    o, S = chunk_gated_delta_rule_triton(qi, k, v, beta, gi, initial_state, chunk_size, scale, NQ)
    if n > 1 and NQ == 1:
        o = o[:, n - 1::n]
    return o.to(q.dtype), S
