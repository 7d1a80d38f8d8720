"""Triton kernels for the chunked gated delta rule / delta product, forward and backward.

Same algorithm and notation as :mod:`kernels.delta.chunked` (read its docstring first): the product's
``n_h`` sub-steps are interleaved into a sequence ``L = n_h * T`` long, the gate sits on sub-step 0
and the query on the last sub-step (that interleaving, the padding and the layout changes are torch
glue with autograd; everything below works on one interleaved, padded sequence per (batch, head)).

Per chunk ``c`` of ``BT`` positions (``G`` = in-chunk cumulative log gate, ``gC = G[BT-1]``):

forward
  1. ``_fwd_prep``  (parallel over chunks): ``G``; ``A = tril_strict(beta_r e^{G_r-G_i} k_r.k_i)``;
     ``Tm = (I + A)^{-1}`` by forward substitution; ``U = Tm diag(beta) V``, ``W = Tm diag(beta e^G) K``.
  2. ``_fwd_state`` (sequential over chunks, parallel over V blocks): stores the entry state ``h_c``,
     ``D = U - W h_c`` and ``h_{c+1} = e^{gC} h_c + (e^{gC-G} K)^T D``.
  3. ``_fwd_out``   (parallel over chunks): ``O = e^G Q h_c + ((Q K^T) * M) D``.

backward (``dO``, ``dh_final``)
  3'. ``_bwd_out``  (parallel): ``dD_o = ((QK^T)*M)^T dO``, ``dQ``, the ``dK`` and ``dG`` terms of step 3.
  2'. ``_bwd_state`` (sequential, reverse): stores ``dh_{c+1}`` (gradient of the chunk's exit state),
      ``dD = dD_o + e^{gC-G} K dh_{c+1}``, ``dh_c = e^{gC} dh_{c+1} + (e^G Q)^T dO - W^T dD``.
  1'. ``_bwd_prep`` (parallel): gradients through ``D = U - W h_c``, the state update and the UT
      transform (``dTm = dU (beta V)^T + dW (beta e^G K)^T``, ``dA = -Tm^T dTm Tm^T``) to ``dK, dV,
      dbeta, dG``.
  The two ``dK``/``dG`` partials are added in torch and ``dgamma`` is the in-chunk reverse cumulative
  sum of ``dG`` (elementwise glue).

All arithmetic is fp32 (``tl.dot`` with ``input_precision="ieee"``). Sizes are padded by the wrapper:
``L`` to a multiple of ``BT`` (zero ``k``, ``beta``, ``gamma``, ``q``: identity steps), ``K`` and ``V``
to powers of two >= 16 (zero rows/columns), so the kernels need no masks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..launch import launch
from .chunked import delta_product_via_rule

#: fp32 products in every tl.dot (a constexpr: a jitted kernel may read no other kind of global)
_PREC = tl.constexpr("ieee")


# ---------------------------------------------------------------------------------------------------
# forward kernels
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_prep(k_ptr, v_ptr, b_ptr, gam_ptr, G_ptr, Tm_ptr, U_ptr, W_ptr, Lp,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    t = c * BT + rows
    kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    vv = tl.load(v_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
    b = tl.load(b_ptr + bh * Lp + t)
    G = tl.cumsum(tl.load(gam_ptr + bh * Lp + t), 0)
    tl.store(G_ptr + bh * Lp + t, G)

    strict = rows[:, None] > rows[None, :]
    diff = G[:, None] - G[None, :]
    Ms = tl.where(strict, tl.exp(tl.where(strict, diff, 0.0)), 0.0)
    KK = tl.dot(kk, tl.trans(kk), input_precision=_PREC)
    A = b[:, None] * Ms * KK
    # Tm = (I + A)^{-1}, unit lower triangular: row r = e_r - sum_{i<r} A_ri Tm_i
    Tm = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for r in range(1, BT):
        a_r = tl.sum(tl.where(rows[:, None] == r, A, 0.0), 0)             # A[r, :]
        new = tl.where(rows == r, 1.0, 0.0) - tl.sum(a_r[:, None] * Tm, 0)
        Tm = tl.where(rows[:, None] == r, new[None, :], Tm)
    tl.store(Tm_ptr + bh * Lp * BT + t[:, None] * BT + rows[None, :], Tm)
    U = tl.dot(Tm, b[:, None] * vv, input_precision=_PREC)
    W = tl.dot(Tm, (b * tl.exp(G))[:, None] * kk, input_precision=_PREC)
    tl.store(U_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], U)
    tl.store(W_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :], W)


@triton.jit
def _fwd_state(k_ptr, G_ptr, U_ptr, W_ptr, h0_ptr, h_ptr, D_ptr, hT_ptr, Lp, N,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    kv_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + bh * K * V + kv_off)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for c in range(N):
        tl.store(h_ptr + (bh * N + c) * K * V + kv_off, S)
        t = c * BT + rows
        kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        W = tl.load(W_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        U = tl.load(U_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        G = tl.load(G_ptr + bh * Lp + t)
        gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
        D = U - tl.dot(W, S, input_precision=_PREC)
        tl.store(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], D)
        kd = kk * tl.exp(gC - G)[:, None]
        S = S * tl.exp(gC) + tl.dot(tl.trans(kd), D, input_precision=_PREC)
    tl.store(hT_ptr + bh * K * V + kv_off, S)


@triton.jit
def _fwd_out(q_ptr, k_ptr, G_ptr, h_ptr, D_ptr, o_ptr, Lp, N,
             K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    t = c * BT + rows
    qq = tl.load(q_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    G = tl.load(G_ptr + bh * Lp + t)
    incl = rows[:, None] >= rows[None, :]
    Mi = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    P = tl.dot(qq, tl.trans(kk), input_precision=_PREC) * Mi
    qg = qq * tl.exp(G)[:, None]
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        S0 = tl.load(h_ptr + (bh * N + c) * K * V + offs_k[:, None] * V + offs_v[None, :])
        D = tl.load(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        o = tl.dot(qg, S0, input_precision=_PREC) + tl.dot(P, D, input_precision=_PREC)
        tl.store(o_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], o)


# ---------------------------------------------------------------------------------------------------
# backward kernels
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_out(q_ptr, k_ptr, G_ptr, h_ptr, D_ptr, do_ptr, dq_ptr, dk_ptr, dG_ptr, dDo_ptr, Lp, N,
             K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    t = c * BT + rows
    qq = tl.load(q_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    G = tl.load(G_ptr + bh * Lp + t)
    eG = tl.exp(G)
    incl = rows[:, None] >= rows[None, :]
    Mi = tl.where(incl, tl.exp(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0)
    QK = tl.dot(qq, tl.trans(kk), input_precision=_PREC)
    P = QK * Mi
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dqS = tl.zeros([BT, K], dtype=tl.float32)       # dO h_c^T
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        S0 = tl.load(h_ptr + (bh * N + c) * K * V + offs_k[:, None] * V + offs_v[None, :])
        D = tl.load(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        do = tl.load(do_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        dDo = tl.dot(tl.trans(P), do, input_precision=_PREC)
        tl.store(dDo_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], dDo)
        dP += tl.dot(do, tl.trans(D), input_precision=_PREC)
        dqS += tl.dot(do, tl.trans(S0), input_precision=_PREC)
    dQK = dP * Mi
    dq = eG[:, None] * dqS + tl.dot(dQK, kk, input_precision=_PREC)
    dk = tl.dot(tl.trans(dQK), qq, input_precision=_PREC)
    Z = dP * P
    # d/dG of e^G (Q h_c): e^G_r * sum_v dO_rv (q_r h_c)_v = e^G_r * q_r . (dO h_c^T)_r
    dG = eG * tl.sum(qq * dqS, 1) + tl.sum(Z, 1) - tl.sum(Z, 0)
    tl.store(dq_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :], dq)
    tl.store(dk_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :], dk)
    tl.store(dG_ptr + bh * Lp + t, dG)


@triton.jit
def _bwd_state(q_ptr, k_ptr, G_ptr, W_ptr, do_ptr, dDo_ptr, dhT_ptr, dh_ptr, dU_ptr, dh0_ptr, Lp, N,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr):
    iv = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    offs_v = iv * BV + tl.arange(0, BV)
    kv_off = offs_k[:, None] * V + offs_v[None, :]
    if HAS_DHT:
        dS = tl.load(dhT_ptr + bh * K * V + kv_off)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(N):
        c = N - 1 - i
        tl.store(dh_ptr + (bh * N + c) * K * V + kv_off, dS)
        t = c * BT + rows
        qq = tl.load(q_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        W = tl.load(W_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
        G = tl.load(G_ptr + bh * Lp + t)
        gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
        do = tl.load(do_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        dD = tl.load(dDo_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        kd = kk * tl.exp(gC - G)[:, None]
        dD += tl.dot(kd, dS, input_precision=_PREC)
        tl.store(dU_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], dD)
        qg = qq * tl.exp(G)[:, None]
        dS = dS * tl.exp(gC) + tl.dot(tl.trans(qg), do, input_precision=_PREC) \
            - tl.dot(tl.trans(W), dD, input_precision=_PREC)
    tl.store(dh0_ptr + bh * K * V + kv_off, dS)


@triton.jit
def _bwd_prep(k_ptr, v_ptr, b_ptr, G_ptr, Tm_ptr, h_ptr, D_ptr, dh_ptr, dU_ptr,
              dk_ptr, dv_ptr, db_ptr, dG_ptr, Lp, N,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.arange(0, BT)
    offs_k = tl.arange(0, K)
    t = c * BT + rows
    kk = tl.load(k_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :])
    b = tl.load(b_ptr + bh * Lp + t)
    G = tl.load(G_ptr + bh * Lp + t)
    gC = tl.load(G_ptr + bh * Lp + c * BT + BT - 1)
    Tm = tl.load(Tm_ptr + bh * Lp * BT + t[:, None] * BT + rows[None, :])
    eG = tl.exp(G)
    bg = b * eG
    e = tl.exp(gC - G)

    dW = tl.zeros([BT, K], dtype=tl.float32)
    dKd = tl.zeros([BT, K], dtype=tl.float32)
    dTm = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    dgC = tl.sum(tl.zeros([BT], dtype=tl.float32), 0)
    for iv in range(V // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        kv_off = offs_k[:, None] * V + offs_v[None, :]
        S0 = tl.load(h_ptr + (bh * N + c) * K * V + kv_off)
        dS = tl.load(dh_ptr + (bh * N + c) * K * V + kv_off)
        vv = tl.load(v_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        D = tl.load(D_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        dD = tl.load(dU_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :])
        dW -= tl.dot(dD, tl.trans(S0), input_precision=_PREC)
        dKd += tl.dot(D, tl.trans(dS), input_precision=_PREC)
        dgC += tl.sum(tl.sum(S0 * dS, 1), 0)
        bv = b[:, None] * vv
        dTm += tl.dot(dD, tl.trans(bv), input_precision=_PREC)
        dbv = tl.dot(tl.trans(Tm), dD, input_precision=_PREC)
        tl.store(dv_ptr + bh * Lp * V + t[:, None] * V + offs_v[None, :], b[:, None] * dbv)
        db += tl.sum(dbv * vv, 1)
    dgC = dgC * tl.exp(gC)
    # exit state: (e^{gC - G} K)^T D
    dk = e[:, None] * dKd
    z = e * tl.sum(dKd * kk, 1)
    dG = -z
    dgC += tl.sum(z, 0)
    # W = Tm diag(beta e^G) K
    dTm += tl.dot(dW, tl.trans(bg[:, None] * kk), input_precision=_PREC)
    dbgk = tl.dot(tl.trans(Tm), dW, input_precision=_PREC)
    dk += bg[:, None] * dbgk
    dbg = tl.sum(dbgk * kk, 1)
    db += dbg * eG
    dG += dbg * bg
    # Tm = (I + A)^{-1}:  dA = -Tm^T dTm Tm^T  (strictly lower part)
    strict = rows[:, None] > rows[None, :]
    dA = -tl.dot(tl.trans(Tm), tl.dot(dTm, tl.trans(Tm), input_precision=_PREC), input_precision=_PREC)
    dA = tl.where(strict, dA, 0.0)
    Ms = tl.where(strict, tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0)), 0.0)
    KK = tl.dot(kk, tl.trans(kk), input_precision=_PREC)
    dAM = dA * Ms
    db += tl.sum(dAM * KK, 1)
    E = b[:, None] * dAM
    dk += tl.dot(E, kk, input_precision=_PREC) + tl.dot(tl.trans(E), kk, input_precision=_PREC)
    Z = E * KK                                           # dA * A
    dG += tl.sum(Z, 1) - tl.sum(Z, 0)
    dG += tl.where(rows == BT - 1, dgC, 0.0)
    tl.store(dk_ptr + bh * Lp * K + t[:, None] * K + offs_k[None, :], dk)
    tl.store(db_ptr + bh * Lp + t, db)
    tl.store(dG_ptr + bh * Lp + t, dG)


# ---------------------------------------------------------------------------------------------------
# autograd wrapper
# ---------------------------------------------------------------------------------------------------
#: largest V block of one program (tests lower it to exercise the loop over V blocks)
BLOCK_V_MAX = 64


def _block_v(K: int, V: int) -> int:
    """V block of one program: BLOCK_V_MAX, halved at K > 64 (the K x BV state tile lives in registers)."""
    return min(V, BLOCK_V_MAX if K <= 64 else BLOCK_V_MAX // 2)


def _num_warps(K: int) -> int:
    """8 warps above K = 64: the fp32 (K x BT) and (K x BV) tiles then spread over 256 threads' registers."""
    return 8 if K > 64 else 4


class ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """Chunked gated delta rule on padded, contiguous fp32 ``(BH, Lp, D)`` tensors.

    Inputs: ``q, k`` ``(BH, Lp, K)``, ``v`` ``(BH, Lp, V)``, ``beta, gamma`` ``(BH, Lp)``, ``h0``
    ``(BH, K, V)`` or None, chunk ``BT``. Returns ``o`` ``(BH, Lp, V)`` and the final state.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, gamma, h0, BT: int):
        BH, Lp, K = k.shape
        V = v.shape[-1]
        N = Lp // BT
        BV = _block_v(K, V)
        f32 = dict(device=k.device, dtype=torch.float32)
        G = torch.empty(BH, Lp, **f32)
        Tm = torch.empty(BH, Lp, BT, **f32)
        U = torch.empty(BH, Lp, V, **f32)
        W = torch.empty(BH, Lp, K, **f32)
        launch(_fwd_prep, (N, BH), k, v, beta, gamma, G, Tm, U, W, Lp, K=K, V=V, BT=BT, num_warps=_num_warps(K))
        h = torch.empty(BH, N, K, V, **f32)
        D = torch.empty(BH, Lp, V, **f32)
        hT = torch.empty(BH, K, V, **f32)
        has_h0 = h0 is not None
        launch(_fwd_state, (V // BV, BH), k, G, U, W, h0 if has_h0 else hT, h, D, hT, Lp, N,
                                  K=K, V=V, BT=BT, BV=BV, HAS_H0=has_h0,
                                  num_warps=_num_warps(K))
        o = torch.empty(BH, Lp, V, **f32)
        launch(_fwd_out, (N, BH), q, k, G, h, D, o, Lp, N, K=K, V=V, BT=BT, BV=BV, num_warps=_num_warps(K))
        ctx.save_for_backward(q, k, v, beta, G, Tm, W, h, D)
        ctx.BT, ctx.has_h0 = BT, has_h0
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, beta, G, Tm, W, h, D = ctx.saved_tensors
        BT = ctx.BT
        BH, Lp, K = k.shape
        V = v.shape[-1]
        N = Lp // BT
        BV = _block_v(K, V)
        do = do.contiguous().float()
        f32 = dict(device=k.device, dtype=torch.float32)
        dq = torch.empty(BH, Lp, K, **f32)
        dk_o = torch.empty(BH, Lp, K, **f32)
        dG_o = torch.empty(BH, Lp, **f32)
        dDo = torch.empty(BH, Lp, V, **f32)
        launch(_bwd_out, (N, BH), q, k, G, h, D, do, dq, dk_o, dG_o, dDo, Lp, N, K=K, V=V, BT=BT, BV=BV,
               num_warps=_num_warps(K))
        has_dht = dhT is not None
        dh = torch.empty(BH, N, K, V, **f32)
        dU = torch.empty(BH, Lp, V, **f32)
        dh0 = torch.empty(BH, K, V, **f32)
        launch(_bwd_state, (V // BV, BH), q, k, G, W, do, dDo, dhT.contiguous().float() if has_dht else dh0,
                                  dh, dU, dh0, Lp, N, K=K, V=V, BT=BT, BV=BV, HAS_DHT=has_dht,
                                  num_warps=_num_warps(K))
        dk_p = torch.empty(BH, Lp, K, **f32)
        dv = torch.empty(BH, Lp, V, **f32)
        db = torch.empty(BH, Lp, **f32)
        dG_p = torch.empty(BH, Lp, **f32)
        launch(_bwd_prep, (N, BH), k, v, beta, G, Tm, h, D, dh, dU, dk_p, dv, db, dG_p, Lp, N,
                           K=K, V=V, BT=BT, BV=BV, num_warps=_num_warps(K))
        dG = (dG_o + dG_p).view(BH, N, BT)
        dgamma = dG.flip(-1).cumsum(-1).flip(-1).reshape(BH, Lp)   # G = in-chunk cumsum(gamma)
        return dq, dk_o + dk_p, dv, db, dgamma, (dh0 if ctx.has_h0 else None), None


def _next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


#: largest key / value head dim: at 256 the chunk tiles need ~190 KB of shared memory, above an sm_80
#: block's 163 KB (python -m zoo.benchmark.compile_check), so the launcher refuses it
MAX_HEAD_DIM = 128
#: largest chunk the kernels use (the forward substitution is BT steps long, and the tiles grow with BT)
MAX_CHUNK = 64


def block_chunk(chunk_size: int, K: int, V: int) -> int:
    """The chunk the kernels run: ``chunk_size`` rounded up to a power of two >= 16 (``tl.dot`` block
    limits), at most :data:`MAX_CHUNK`, and at most 32 when a head dim is above 64 (at K = V = 128 a
    64-long chunk's state kernels need more shared memory than an sm_80 block has). The result does not
    depend on it."""
    return min(_next_pow2(int(chunk_size)), MAX_CHUNK if max(K, V) <= 64 else 32)


def chunk_gated_delta_rule_triton(q, k, v, beta, gamma, initial_state=None, chunk_size: int = 64):
    """Same contract as :func:`kernels.delta.chunked.chunk_gated_delta_rule_torch` (``q`` pre-scaled).

    The chunk the kernels run is :func:`block_chunk` of ``chunk_size``; it does not change the result.
    Head dims above :data:`MAX_HEAD_DIM` are refused.
    """
    B, L, H, K = k.shape
    V = v.shape[-1]
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"delta_product (triton): head dims K={K}, V={V} above {MAX_HEAD_DIM} need more shared "
                         f"memory than a GPU block has; use backend='fla' or 'torch'")
    # tl.dot needs blocks >= 16 and power-of-two shapes: round the chunk up (the result does not depend on it)
    BT = block_chunk(chunk_size, K, V)
    Kp, Vp = _next_pow2(K), _next_pow2(V)
    pad = (-L) % BT
    Lp = L + pad

    def to_inner(x, D, Dp):  # (B, L, H, D) -> (B*H, Lp, Dp) fp32 contiguous
        x = F.pad(x.float(), (0, Dp - D, 0, 0, 0, pad))
        return x.transpose(1, 2).reshape(B * H, Lp, Dp).contiguous()

    def to_inner1(x):       # (B, L, H) -> (B*H, Lp)
        x = F.pad(x.float(), (0, 0, 0, pad))
        return x.transpose(1, 2).reshape(B * H, Lp).contiguous()

    qi, ki, vi = to_inner(q, K, Kp), to_inner(k, K, Kp), to_inner(v, V, Vp)
    bi = to_inner1(beta)
    gi = to_inner1(gamma) if gamma is not None else torch.zeros_like(bi)
    h0 = None
    if initial_state is not None:
        h0 = F.pad(initial_state.float(), (0, Vp - V, 0, Kp - K)).reshape(B * H, Kp, Vp).contiguous()
    o, hT = ChunkGatedDeltaRuleTriton.apply(qi, ki, vi, bi, gi, h0, BT)
    o = o.view(B, H, Lp, Vp)[:, :, :L, :V].transpose(1, 2)
    hT = hT.view(B, H, Kp, Vp)[..., :K, :V]
    return o, hT


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
    """Gated delta product (layout of :mod:`kernels.delta.reference`) with the Triton chunk kernels."""
    o, S = delta_product_via_rule(chunk_gated_delta_rule_triton, q.float(), k, v, beta, g, num_householder, scale,
                                  initial_state, chunk_size)  # the kernels compute in fp32
    return o.to(q.dtype), S
