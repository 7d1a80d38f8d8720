"""Slot memory in Triton, forward and backward; contract of :func:`kernels.slots.reference.slot_memory_reference`
(Xiao et al., "RAM-Net", arXiv 2602.11958). Also the Kronecker top-K addressing (:func:`kronecker_topk_triton`,
contract of :func:`kernels.slots.addressing.kronecker_topk`), at the end.

Two layouts of the memory, chosen by the number of slots ``M``:

**Chunked (M <= CHUNKED_MAX_SLOTS).** The memory with its normaliser as one more column, ``X = [S, z]``
(``M x (d_v + 1)`` per head), follows a diagonal linear recurrence, ``X_t = diag(e^{a_t}) X_{t-1} +
w_t [v_t, 1]^T`` (``a_t`` the log decays ``gamma log(1 - w)`` of the written slots, zero elsewhere); the read
``o_t = sum_i q_{t,i} S_t[R_{t,i}]``, ``q = r / (z_t[R] + eps)``, divides by the normaliser but is linear in
``S`` once ``z`` is known, and ``z`` is a column of the same linear recurrence. So time cuts into chunks of
``C`` tokens (``A_t`` the cumulative log decay from the chunk start, ``X_0`` the state entering the chunk):

1. ``_slots_state``, one program per (chunk, batch x head): the chunk's contribution to the state and its
   decay, ``U = F^T [V, 1]`` with ``F[s, m] = w_s[m] e^{A_C[m] - A_s[m]}`` (dense over the ``M`` slots, a
   ``(M x C) @ (C x d_v)`` product) and ``d = e^{A_C}``.
2. ``_slots_carry``: ``X_{c+1} = d_c X_c + U_c``, an element-wise pass over the chunks, one program per
   (batch x head, tile of the ``M (d_v + 1)`` entries); it records the state entering every chunk.
3. ``_slots_read``, one program per (chunk, batch x head): for each read slot ``i`` the
   chunk's interactions ``E_i[t, s] = w_s[m] e^{A_t[m] - A_s[m]}`` at ``m = R_{t,i}`` (``C x C``; the
   cumulative decays ``A_s[m]`` come from comparing the read slot with every write of the chunk, so no
   ``M``-sized tile appears), ``z_t[m] = e^{A_t[m]} z_0[m] + sum_s E_i[t, s]``, ``q``, then
   ``o = P V + sum_i q_i e^{A_t} S_0[R_i]`` with ``P = sum_i q_i E_i`` (a ``(C x C) @ (C x d_v)`` product
   and ``K`` row gathers of the start state, ``d_v`` columns a tile at a time after the interactions: a
   program per tile of ``d_v`` would compute the interactions, the kernel's main cost, once per tile). Every
   exponent is a difference ``A_t - A_s <= 0``. A program takes the chunk's reading tokens ``BR`` at a time
   (``READ_ROWS``; the rows ``t`` of ``E_i``, against all ``C`` writes ``s``): a read's output is its own.
   Row tiles narrower than the chunk spill nothing, but every tile computes the chunk's write-side terms again:
   on an H200 the whole chunk (``[C, C]`` tiles, some spills) ran fastest, so that is the default.

The backward runs the same three stages in reverse order: ``_slots_read_bwd`` (the reads' gradients, the
intra-chunk gradients of ``v``, ``w`` and the log decays, and the reads' adjoint of the start state ``L_c = Q^T
[dO, dz]`` as a product; over the row tiles the sums over reading tokens, ``P^T dO`` and ``L_c``, are added up in
their output buffers, each program owning its chunk's), ``_slots_carry`` reversed (``G_c = d_c G_{c+1} + L_c``),
and ``_slots_state_bwd`` (what the chunk's state contribution ``U`` and decay ``d`` pass back: ``dF = [V, 1]
G^T``, ``dV += F G``). Three launches forward, three backward, whatever ``T``, and no other operation: the log
decays ``gamma log(1 - min(w, W_MAX))`` are computed from ``w`` and ``gamma`` where they are used, and
``_slots_state_bwd`` ends by passing their gradient to ``w`` (the weights' final gradient) and to ``gamma`` (one
partial sum per chunk, added up by the launcher: the one torch operation of the backward); the addresses and
values are read through a token stride (:func:`kernels.common.token_stride`), so the halves of a joint
write-and-read address tensor and the value columns of a layer's projections are read in place; the final state
is written as ``S`` and ``z`` directly. Cost per head: time ``O(T (C K^2 + (K + C + M) d_v))``, and ``M (d_v +
1)`` numbers per chunk for the chunk states (written, carried and read again): the state stages grow with ``M``,
hence the cutoff.

Products. ``F^T V`` and ``P V`` (forward) and ``dO V^T`` and ``P^T dO`` (backward) take the 16-bit
``v``/``dO`` tile with the fp32 coefficients ``F`` (``<= 1``) or ``P`` (``<= sum_i |r_i|``, as each
``E_i[t, s]`` is a part of the nonnegative normaliser ``z_t``) rounded to the same type, accumulating in fp32.
The products with the fp32 adjoint state ``G`` (``V G^T``, ``F G``) and ``Q^T dO`` (``Q = q e^{A}``, which has no
bound: ``z`` can be tiny) keep that fp32 operand as two 16-bit tiles (:mod:`kernels.split_dot`).
fp32 inputs multiply exactly (``input_precision="ieee"``). The states ``X``, ``G`` and all decays stay fp32.
The rest is ``O(C^2 K^2)`` comparisons and exponentials per chunk, element-wise work with no product form
(each read slot has its own decay profile).

**Sparse (M > CHUNKED_MAX_SLOTS)**, ``_slots_fwd`` / ``_slots_bwd``: sequential over time, touching only the
``K`` written and ``K`` read rows of the ``M x d_v`` memory per token (time ``O(T K d_v)`` per head,
independent of ``M``; the memory lives in global memory). A program owns a tile of ``d_v`` columns of one
(batch, head) and keeps its own copy of the normaliser ``z`` (``K`` values a token, recomputed by every
tile), so ``B H ceil(d_v / BLOCK_DV)`` programs run in parallel instead of ``B H``. In the backward the
adjoint of ``z`` is linear in the read products, so each tile accumulates its share from its own columns
and the shares are summed. ``tl.debug_barrier()`` orders each token's stores before the next loads, since a
read slot may be the one just written (read-after-write). No products here (rows are gathered one token at
a time).

Parallelism at B = 1, d_model 1024 (8 heads, d_v 128, M = 64, K = 4), T 16384, C 64 (the GPU's chunk):
256 x 8 = 2048 programs in the chunk stages, 17 x 8 in the carries (256 steps each), where the sequential
kernel ran 8 programs of 16384 steps.

**Addressing**, ``_topk_fwd`` / ``_topk_bwd``, one program per ``BR`` addresses (rows of ``U d_p`` logits):
the softmax of every factor, then the search of :mod:`kernels.slots.addressing` (keep the ``K`` best partial
products after each factor: ``K`` picks of the best of ``K d_p`` candidates, ties to the lowest candidate), the
product weights, the renormalisation and the straight-through value, all in fp32 whatever the logits' type. The
backward recomputes the softmaxes and passes the weights' gradient through the renormalisation, the product
(the share of factor ``u`` is the product of the other factors' entries, never a division by a possibly zero
probability) and each softmax; the selection passes no gradient. One launch each way for any number of
addresses, such as a layer's write and read addresses together. No products: ``O(U K^2 d_p)`` comparisons per
address. A factor whose logits are not all finite has NaN probabilities: the search takes them as zeros (so the
slots are real, distinct slot numbers, which the memory kernels index with, never the padding's) and the
address's weights are NaN, as the torch backend's are.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import as_state, cdiv, pow2, token_stride
from ..launch import launch
from ..split_dot import dot_state_x, dot_x_state
from .reference import W_MAX, log_keep

__all__ = ["slot_memory_triton", "kronecker_topk_triton", "CHUNKED_MAX_SLOTS"]

#: the chunked kernels run up to this many slots; above it the sparse scan (its cost does not grow with M)
CHUNKED_MAX_SLOTS = 256
#: loads issued ahead by the carry's loop over chunks (tl.range num_stages)
_STAGES = 3
#: reading tokens a program of the read kernels takes at a time (at most the chunk). Measured side by side on one
#: H200 (Kronecker slots' layer at 16K tokens, chunks of 64, bf16; scripts/gpu_variants_ab.py): the read
#: backward 1.94 ms at 16 rows (no spills), 1.34 at 32, 1.13 at 64 (720 bytes a thread spilled on sm_90), the
#: read 0.60 / 0.57 / 0.39 ms: a narrower tile repeats the chunk's write-side work once per tile
READ_ROWS = 64
_W_MAX = tl.constexpr(W_MAX)
#: a padding candidate's slot number in the addressing kernel, above every real one (fewer than 2^40 slots)
_PAD_SLOT = tl.constexpr(2 ** 40)


@triton.jit
def _dot_coef(coef, x):
    # coef @ x: coef a bounded fp32 coefficient tile, x an input tile (rounded to x's 16-bit type, or exact fp32)
    if x.dtype == tl.float32:
        return tl.dot(coef, x, input_precision="ieee")
    return tl.dot(coef.to(x.dtype), x)


@triton.jit
def _dot_inputs(x, y):
    # x @ y for two input tiles of one type
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision="ieee")
    return tl.dot(x, y)


@triton.jit
def _log1p_neg(x):
    # log(1 - x) for x in [0, 1): log(u) x / (1 - u) with u = 1 - x rounded is exact to a few ulps (log(u) alone
    # loses the low bits of a small x), and -x where u rounds to 1
    u = 1.0 - x
    exact = u == 1.0
    return tl.where(exact, -x, tl.log(u) * (x / tl.where(exact, 1.0, 1.0 - u)))


@triton.jit
def _log_keep(w, gamma):
    # the log decay gamma log(1 - min(w, W_MAX)) of a write of weight w (kernels.slots.reference.log_keep)
    return gamma * _log1p_neg(tl.minimum(w, _W_MAX))


@triton.jit
def _chunk_decays(WI, WW, gam, atok, valid, slot, K):
    # dense per-slot log decays and write weights of the chunk's tokens: ad, wd [BT, BM]
    ad = tl.zeros([atok.shape[0], slot.shape[0]], dtype=tl.float32)
    wd = tl.zeros([atok.shape[0], slot.shape[0]], dtype=tl.float32)
    for j in range(K):
        wi = tl.load(WI + atok + j, mask=valid, other=-1)
        w = tl.load(WW + atok + j, mask=valid, other=0.0).to(tl.float32)
        la = _log_keep(w, gam)
        hit = wi[:, None] == slot[None, :]
        ad += tl.where(hit, la[:, None], 0.0)
        wd += tl.where(hit, w[:, None], 0.0)
    return ad, wd


@triton.jit
def _reading_rows(r0, c, b, h, T, H, K, SA, BT: tl.constexpr, BR: tl.constexpr):
    # the row tile of reading tokens r0 .. r0 + BR of chunk c: chunk positions, validity, token rows of the
    # (B, T, H) outputs and of the address tensors
    tr = r0 + tl.arange(0, BR)
    ts = c * BT + tr
    return tr, ts < T, (b * T + ts) * H + h, (b * T + ts) * SA + h * K


@triton.jit
def _read_interactions(WI, WW, gam, RI, RW, XS, atok_r, valid_r, tr, atok, valid, t, chunk, i, K, DV1, eps):
    # read slot i of the reading tokens tr (rows: a tile of the chunk) against every write of the chunk (columns:
    # its tokens t): E[t, s] (s <= t), its exponential part, A_t at the slot, the slot's start-state normaliser
    # z0, the normaliser z_t and q = r / (z_t + eps)
    ri = tl.load(RI + atok_r + i, mask=valid_r, other=-2)
    r = tl.load(RW + atok_r + i, mask=valid_r, other=0.0).to(tl.float32)
    D = tl.zeros([tr.shape[0], t.shape[0]], dtype=tl.float32)
    Wm = tl.zeros([tr.shape[0], t.shape[0]], dtype=tl.float32)
    for j in range(K):
        wi = tl.load(WI + atok + j, mask=valid, other=-1)
        w = tl.load(WW + atok + j, mask=valid, other=0.0).to(tl.float32)
        la = _log_keep(w, gam)
        hit = ri[:, None] == wi[None, :]
        D += tl.where(hit, la[None, :], 0.0)
        Wm += tl.where(hit, w[None, :], 0.0)
    Acs = tl.cumsum(D, axis=1)  # [t, s]: the cumulative log decay of slot R_{t,i} up to s
    Ar = tl.sum(tl.where(t[None, :] == tr[:, None], Acs, 0.0), axis=1)
    causal = t[None, :] <= tr[:, None]
    expo = tl.where(causal, tl.exp(tl.minimum(Ar[:, None] - Acs, 0.0)), 0.0)
    E = Wm * expo
    rows = chunk + ri.to(tl.int64) * DV1
    z0 = tl.load(XS + rows + DV1 - 1, mask=valid_r, other=0.0)
    eA = tl.exp(Ar)
    z = eA * z0 + tl.sum(E, axis=1)
    q = r / (z + eps)
    return ri, rows, E, expo, eA, z0, z, q


@triton.jit
def _slots_state(WI, WW, GAM, V, XS, DEC, T, H, M, K, DV, NC, SA, SV,
                 BT: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr):
    # the chunk's state contribution U (into XS[c]) and decay e^{A_C} (into DEC[c]), BM slots at a time (the
    # cumulative decays run along time, so slot tiles are independent)
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = tl.arange(0, BT)
    ts = c * BT + t
    valid = ts < T
    atok = (b * T + ts) * SA + h * K
    vtok = (b * T + ts) * SV + h * DV
    gam = tl.load(GAM + h).to(tl.float32)
    DV1 = DV + 1
    for m0 in range(0, M, BM):
        slot = m0 + tl.arange(0, BM)
        ms = slot < M
        ad, wd = _chunk_decays(WI, WW, gam, atok, valid, slot, K)
        Acs = tl.cumsum(ad, axis=0)
        Aend = tl.sum(ad, axis=0)
        F = wd * tl.exp(tl.minimum(Aend[None, :] - Acs, 0.0))
        rows = ((bh * NC + c) * M + slot) * DV1
        tl.store(DEC + (bh * NC + c) * M + slot, tl.exp(Aend), mask=ms)
        tl.store(XS + rows + DV, tl.sum(F, axis=0), mask=ms)
        Ft = tl.trans(F)
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = dd < DV
            vt = tl.load(V + vtok[:, None] + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            tl.store(XS + rows[:, None] + dd[None, :], _dot_coef(Ft, vt), mask=ms[:, None] & dm[None, :])


@triton.jit
def _slots_carry(XS, DEC, S0, Z0, SN, ZN, E, DV1, NC, HAS_X0: tl.constexpr, REVERSE: tl.constexpr,
                 BE: tl.constexpr, NS: tl.constexpr):
    # forward: XS[c] holds U_c and receives X_c; X_{c+1} = d_c X_c + U_c, from X_0 = [S0, Z0] to [SN, ZN] = X_NC.
    # REVERSE: XS[c] holds L_c and receives G_{c+1}; G_c = d_c G_{c+1} + L_c, from G_NC = [S0, Z0] (the
    # gradient of the final state) to [SN, ZN] = G_0. E = M (d_v + 1) entries per head; S (M, d_v) and z (M,)
    # are separate tensors outside.
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    bh = tl.program_id(1).to(tl.int64)
    me = e < E
    slot = e // DV1
    col = e % DV1
    M = E // DV1
    DV = DV1 - 1
    ins = me & (col < DV)
    inz = me & (col == DV)
    srow = (bh * M + slot) * DV + col
    zrow = bh * M + slot
    if HAS_X0:
        x = tl.where(ins, tl.load(S0 + srow, mask=ins, other=0.0), tl.load(Z0 + zrow, mask=inz, other=0.0))
    else:
        x = tl.zeros([BE], dtype=tl.float32)
    for k in tl.range(0, NC, num_stages=NS):
        if REVERSE:
            c = NC - 1 - k
        else:
            c = k
        u = tl.load(XS + (bh * NC + c) * E + e, mask=me, other=0.0)
        d = tl.load(DEC + (bh * NC + c) * M + slot, mask=me, other=0.0)
        tl.store(XS + (bh * NC + c) * E + e, x, mask=me)
        x = d * x + u
    tl.store(SN + srow, x, mask=ins)
    tl.store(ZN + zrow, x, mask=inz)


@triton.jit
def _slots_read(WI, WW, GAM, RI, RW, V, XS, O, T, H, M, K, DV, NC, SA, SV, eps,
                BT: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr):
    # BR reading tokens at a time (their outputs are independent): first the read slots' interactions with the
    # chunk's writes (the O(K^2 BR BT) part): P and, per read slot i, the start-state row it gathers and that
    # row's coefficient q_i e^{A_t}, kept as columns of (BR, BK) tiles; then the output BDV value columns at a time
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = tl.arange(0, BT)
    ts = c * BT + t
    valid = ts < T
    atok = (b * T + ts) * SA + h * K
    vtok = (b * T + ts) * SV + h * DV
    gam = tl.load(GAM + h).to(tl.float32)
    DV1 = DV + 1
    chunk = (bh * NC + c) * M * DV1
    kk = tl.arange(0, BK)
    for r0 in range(0, BT, BR):
        tr, valid_r, tok_r, atok_r = _reading_rows(r0, c, b, h, T, H, K, SA, BT, BR)
        P = tl.zeros([BR, BT], dtype=tl.float32)
        gather = tl.zeros([BR, BK], dtype=tl.int64)
        coef = tl.zeros([BR, BK], dtype=tl.float32)
        for i in range(K):
            ri, rows, E, expo, eA, z0, z, q = _read_interactions(WI, WW, gam, RI, RW, XS, atok_r, valid_r, tr,
                                                                 atok, valid, t, chunk, i, K, DV1, eps)
            P += q[:, None] * E
            col = (kk == i)[None, :]
            gather = tl.where(col, rows[:, None], gather)
            coef = tl.where(col, (q * eA)[:, None], coef)
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = (dd < DV)[None, :]
            vt = tl.load(V + vtok[:, None] + dd[None, :], mask=valid[:, None] & dm, other=0.0)
            o = _dot_coef(P, vt)
            tm = valid_r[:, None] & dm
            for i in range(K):
                col = (kk == i)[None, :]
                rows = tl.sum(tl.where(col, gather, 0), axis=1)
                s0 = tl.load(XS + rows[:, None] + dd[None, :], mask=tm, other=0.0)
                o += tl.sum(tl.where(col, coef, 0.0), axis=1)[:, None] * s0
            tl.store(O + tok_r[:, None] * DV + dd[None, :], o.to(O.dtype.element_ty), mask=tm)


@triton.jit
def _slots_read_bwd(WI, WW, GAM, RI, RW, V, XS, DO, LG, DR, DLA, DW, DVP, T, H, M, K, DV, NC, SA, SV, eps,
                    BT: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr):
    # the reads' gradients: dr (final), the intra-chunk parts of dla, dw and dv (DLA, DW, DVP: completed by
    # _slots_state_bwd), and L_c, the reads' adjoint of the chunk's start state (into LG[c]). BR reading tokens
    # at a time: dr is theirs alone; the sums over reading tokens (the writes' dla and dw, dv = P^T dO, L_c =
    # Q^T dO) are carried across the row tiles, dla and dw in registers ([BT, BK]), dv and L_c in DVP and LG
    # (written by the first row tile, read back and added to by the others: [BT, d_v] and [M, d_v + 1]
    # accumulators in registers would cost what the row tiles save). The read slots' coefficients are kept as
    # columns of [BR, BK] tiles in the loop over read slots and spread over the slots (Q, BM at a time) after
    # it, so that no slot-sized tile is live beside the interactions
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = tl.arange(0, BT)
    ts = c * BT + t
    valid = ts < T
    tok = (b * T + ts) * H + h
    atok = (b * T + ts) * SA + h * K
    vtok = (b * T + ts) * SV + h * DV
    gam = tl.load(GAM + h).to(tl.float32)
    DV1 = DV + 1
    chunk = (bh * NC + c) * M * DV1
    kk = tl.arange(0, BK)
    dla = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    for r0 in range(0, BT, BR):
        tr, valid_r, tok_r, atok_r = _reading_rows(r0, c, b, h, T, H, K, SA, BT, BR)
        causal = t[None, :] <= tr[:, None]
        dOV = tl.zeros([BR, BT], dtype=tl.float32)  # dO_t . v_s
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = (dd < DV)[None, :]
            do = tl.load(DO + tok_r[:, None] * DV + dd[None, :], mask=valid_r[:, None] & dm, other=0.0)
            vt = tl.load(V + vtok[:, None] + dd[None, :], mask=valid[:, None] & dm, other=0.0)
            dOV += _dot_inputs(do, tl.trans(vt))
        P = tl.zeros([BR, BT], dtype=tl.float32)
        # per read slot i (column i): the slot, q e^{A_t} and dz e^{A_t}, spread over the slots after the loop
        rslot = tl.zeros([BR, BK], dtype=tl.int32)
        qa = tl.zeros([BR, BK], dtype=tl.float32)
        dza = tl.zeros([BR, BK], dtype=tl.float32)
        for i in range(K):
            ri, rows, E, expo, eA, z0, z, q = _read_interactions(WI, WW, gam, RI, RW, XS, atok_r, valid_r, tr,
                                                                 atok, valid, t, chunk, i, K, DV1, eps)
            sd = tl.zeros([BR], dtype=tl.float32)  # dO_t . S_0[R_{t,i}]
            for d0 in range(0, DV, BDV):
                dd = d0 + tl.arange(0, BDV)
                tm = valid_r[:, None] & (dd < DV)[None, :]
                do = tl.load(DO + tok_r[:, None] * DV + dd[None, :], mask=tm, other=0.0).to(tl.float32)
                sd += tl.sum(do * tl.load(XS + rows[:, None] + dd[None, :], mask=tm, other=0.0), axis=1)
            dq = eA * sd + tl.sum(E * dOV, axis=1)
            dr = dq / (z + eps)
            tl.store(DR + tok_r * K + i, dr.to(DR.dtype.element_ty), mask=valid_r)
            dz = -dr * q
            P += q[:, None] * E
            coli = (kk == i)[None, :]
            rslot = tl.where(coli, ri.to(tl.int32)[:, None], rslot)
            qa = tl.where(coli, (q * eA)[:, None], qa)
            dza = tl.where(coli, (dz * eA)[:, None], dza)
            dE = tl.where(causal, q[:, None] * dOV + dz[:, None], 0.0)
            dEE = dE * E  # the gradient of the exponent A_t - A_s
            dAr = eA * (q * sd + dz * z0) + tl.sum(dEE, axis=1)
            dD = tl.where(causal, dAr[:, None], 0.0) - tl.cumsum(dEE, axis=1, reverse=True)
            dWm = dE * expo
            for j in range(K):
                wi = tl.load(WI + atok + j, mask=valid, other=-1)
                hitw = ri[:, None] == wi[None, :]
                col = (kk == j)[None, :]
                dla += tl.where(col, tl.sum(tl.where(hitw, dD, 0.0), axis=0)[:, None], 0.0)
                dw += tl.where(col, tl.sum(tl.where(hitw, dWm, 0.0), axis=0)[:, None], 0.0)
        more = r0 > 0  # not the first row tile: add to what the earlier ones stored
        Pt = tl.trans(P)
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = (dd < DV)[None, :]
            do = tl.load(DO + tok_r[:, None] * DV + dd[None, :], mask=valid_r[:, None] & dm, other=0.0)
            dv_ptr = DVP + tok[:, None] * DV + dd[None, :]
            tl.store(dv_ptr, _dot_coef(Pt, do) + tl.load(dv_ptr, mask=valid[:, None] & dm & more, other=0.0),
                     mask=valid[:, None] & dm)
        for m0 in range(0, M, BM):  # the reads of the start state, BM slots at a time
            slot = m0 + tl.arange(0, BM)
            ms = slot < M
            lrows = chunk + slot * DV1
            Q = tl.zeros([BR, BM], dtype=tl.float32)  # q e^{A_t} at the read slots: the reads of S_0
            Lz = tl.zeros([BM], dtype=tl.float32)     # sum_t dz_t e^{A_t} per slot: the reads' gradient of z_0
            for i in range(K):
                coli = (kk == i)[None, :]
                hit = tl.sum(tl.where(coli, rslot, 0), axis=1)[:, None] == slot[None, :]
                Q += tl.where(hit, tl.sum(tl.where(coli, qa, 0.0), axis=1)[:, None], 0.0)
                Lz += tl.sum(tl.where(hit, tl.sum(tl.where(coli, dza, 0.0), axis=1)[:, None], 0.0), axis=0)
            tl.store(LG + lrows + DV, Lz + tl.load(LG + lrows + DV, mask=ms & more, other=0.0), mask=ms)
            Qt = tl.trans(Q)
            for d0 in range(0, DV, BDV):
                dd = d0 + tl.arange(0, BDV)
                dm = (dd < DV)[None, :]
                do = tl.load(DO + tok_r[:, None] * DV + dd[None, :], mask=valid_r[:, None] & dm, other=0.0)
                lg_ptr = LG + lrows[:, None] + dd[None, :]
                tl.store(lg_ptr, dot_state_x(Qt, do) + tl.load(lg_ptr, mask=ms[:, None] & dm & more, other=0.0),
                         mask=ms[:, None] & dm)
        tl.debug_barrier()  # the next row tile reads what this one stored
    tk = valid[:, None] & (kk < K)[None, :]
    tl.store(DLA + tok[:, None] * K + kk[None, :], dla, mask=tk)
    tl.store(DW + tok[:, None] * K + kk[None, :], dw, mask=tk)


@triton.jit
def _slots_state_bwd(WI, WW, GAM, V, XS, LG, DEC, DLA, DW, DWO, DG, DVP, DVO, T, H, M, K, DV, NC, SA, SV,
                     BT: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr, ONE_TILE: tl.constexpr):
    # what the chunk's contribution U = F^T [V, 1] and decay d = e^{A_C} pass back, given G = LG[c] (the
    # adjoint of the state after the chunk) and X = XS[c] (the state entering it), BM slots at a time; the
    # shares of every slot tile are added into DLA, DW and DVP (this program's rows only), then DVP -> DVO
    # (ONE_TILE: M <= BM, dv is final at once). Last, the log decays' gradient DLA passes to the weights
    # (into DWO) and to gamma (this chunk's share into DG)
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = tl.arange(0, BT)
    ts = c * BT + t
    valid = ts < T
    tok = (b * T + ts) * H + h
    atok = (b * T + ts) * SA + h * K
    vtok = (b * T + ts) * SV + h * DV
    gam = tl.load(GAM + h).to(tl.float32)
    DV1 = DV + 1
    for m0 in range(0, M, BM):
        slot = m0 + tl.arange(0, BM)
        ms = slot < M
        ad, wd = _chunk_decays(WI, WW, gam, atok, valid, slot, K)
        Acs = tl.cumsum(ad, axis=0)
        Aend = tl.sum(ad, axis=0)
        expo = tl.exp(tl.minimum(Aend[None, :] - Acs, 0.0))
        F = wd * expo
        rows = ((bh * NC + c) * M + slot) * DV1
        Gz = tl.load(LG + rows + DV, mask=ms, other=0.0)
        ddec = Gz * tl.load(XS + rows + DV, mask=ms, other=0.0)
        dF = tl.zeros([BT, BM], dtype=tl.float32) + Gz[None, :]
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = dd < DV
            G = tl.load(LG + rows[:, None] + dd[None, :], mask=ms[:, None] & dm[None, :], other=0.0)
            X = tl.load(XS + rows[:, None] + dd[None, :], mask=ms[:, None] & dm[None, :], other=0.0)
            ddec += tl.sum(G * X, axis=1)
            tm = valid[:, None] & dm[None, :]
            vt = tl.load(V + vtok[:, None] + dd[None, :], mask=tm, other=0.0)
            dF += dot_x_state(vt, tl.trans(G))
        # dv in a second pass over the value tiles: fewer tiles live at once
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            dm = dd < DV
            tm = valid[:, None] & dm[None, :]
            G = tl.load(LG + rows[:, None] + dd[None, :], mask=ms[:, None] & dm[None, :], other=0.0)
            p = tok[:, None] * DV + dd[None, :]
            dv = tl.load(DVP + p, mask=tm, other=0.0) + dot_x_state(F.to(V.dtype.element_ty), G)
            if ONE_TILE:
                tl.store(DVO + p, dv.to(DVO.dtype.element_ty), mask=tm)
            else:
                tl.store(DVP + p, dv, mask=tm)
        dWd = dF * expo
        dEx = dF * F  # the gradient of the exponent A_C - A_s
        dAend = tl.sum(dEx, axis=0) + ddec * tl.exp(Aend)
        dad = dAend[None, :] - tl.cumsum(dEx, axis=0, reverse=True)
        for j in range(K):
            wi = tl.load(WI + atok + j, mask=valid, other=-1)
            hit = wi[:, None] == slot[None, :]
            p = tok * K + j
            tl.store(DLA + p, tl.load(DLA + p, mask=valid, other=0.0) + tl.sum(tl.where(hit, dad, 0.0), axis=1),
                     mask=valid)
            tl.store(DW + p, tl.load(DW + p, mask=valid, other=0.0) + tl.sum(tl.where(hit, dWd, 0.0), axis=1),
                     mask=valid)
    # la = gamma log(1 - min(w, W_MAX)): dw += dla gamma d/dw log(1 - min(w, W_MAX)), dgamma = sum dla log(..)
    dg = tl.zeros([BT], dtype=tl.float32)
    for j in range(K):
        p = tok * K + j
        w = tl.load(WW + atok + j, mask=valid, other=0.0).to(tl.float32)
        x = tl.minimum(w, _W_MAX)
        dla = tl.load(DLA + p, mask=valid, other=0.0)
        dw = tl.load(DW + p, mask=valid, other=0.0) + tl.where(w <= _W_MAX, -dla * gam / (1.0 - x), 0.0)
        tl.store(DWO + p, dw.to(DWO.dtype.element_ty), mask=valid)
        dg += dla * _log1p_neg(x)
    tl.store(DG + bh * NC + c, tl.sum(dg, axis=0))
    if not ONE_TILE:
        for d0 in range(0, DV, BDV):
            dd = d0 + tl.arange(0, BDV)
            tm = valid[:, None] & (dd < DV)[None, :]
            p = tok[:, None] * DV + dd[None, :]
            tl.store(DVO + p, tl.load(DVP + p, mask=tm, other=0.0).to(DVO.dtype.element_ty), mask=tm)


@triton.jit
def _slots_fwd(
    WI, WW, DEC, RI, RW, V, S, Z, P, PZ, O,
    T, H, M, K, DV, eps,
    READ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # sparse: one program per (batch x head, d_v tile); Z is this tile's own copy of the normaliser
    bh = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    km = offs_k < K
    dm = offs_d < DV
    kd = km[:, None] & dm[None, :]
    s_base = S + bh * M * DV
    z_base = Z + (bh * tl.num_programs(1) + tile) * M
    for t in range(T):
        tok = (b * T + t) * H + h
        wi = tl.load(WI + tok * K + offs_k, mask=km, other=0)
        w = tl.load(WW + tok * K + offs_k, mask=km, other=0.0)
        dec = tl.load(DEC + tok * K + offs_k, mask=km, other=0.0)
        v = tl.load(V + tok * DV + offs_d, mask=dm, other=0.0)
        rows = tl.load(s_base + wi[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        zr = tl.load(z_base + wi, mask=km, other=0.0)
        if READ:
            save = (bh * T + t) * K
            tl.store(P + (save + offs_k)[:, None] * DV + offs_d[None, :], rows, mask=kd)
            tl.store(PZ + save + offs_k, zr, mask=km & (tile == 0))
        tl.store(s_base + wi[:, None] * DV + offs_d[None, :], dec[:, None] * rows + w[:, None] * v[None, :], mask=kd)
        tl.store(z_base + wi, dec * zr + w, mask=km)
        tl.debug_barrier()
        if READ:
            ri = tl.load(RI + tok * K + offs_k, mask=km, other=0)
            r = tl.load(RW + tok * K + offs_k, mask=km, other=0.0)
            rrows = tl.load(s_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
            rz = tl.load(z_base + ri, mask=km, other=1.0)
            o = tl.sum((r / (rz + eps))[:, None] * rrows, 0)
            tl.store(O + tok * DV + offs_d, o, mask=dm)
            tl.debug_barrier()


@triton.jit
def _slots_bwd(
    WI, WW, DEC, RI, RW, V, S, Z, P, PZ, DO, GS, GZ, DR, DW, DDEC, DVO,
    T, H, M, K, DV, BTH, eps,
    BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # sparse reverse scan of one (batch x head, d_v tile): GZ is this tile's share of the adjoint of z, and DR,
    # DW, DDEC receive this tile's shares (summed over tiles by the launcher)
    bh = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    km = offs_k < K
    dm = offs_d < DV
    kd = km[:, None] & dm[None, :]
    s_base = S + bh * M * DV
    z_base = Z + (bh * n_tiles + tile) * M
    g_base = GS + bh * M * DV
    gz_base = GZ + (bh * n_tiles + tile) * M
    for i in range(T):
        t = T - 1 - i
        tok = (b * T + t) * H + h
        out = (tile * BTH + tok) * K  # this tile's share in the (tiles, B, T, H, K) outputs
        # read of token t (it came after the write of t)
        ri = tl.load(RI + tok * K + offs_k, mask=km, other=0)
        r = tl.load(RW + tok * K + offs_k, mask=km, other=0.0)
        do = tl.load(DO + tok * DV + offs_d, mask=dm, other=0.0)
        rows = tl.load(s_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        rz = tl.load(z_base + ri, mask=km, other=1.0)
        inv = 1.0 / (rz + eps)
        dot = tl.sum(rows * do[None, :], 1)
        tl.store(DR + out + offs_k, dot * inv, mask=km)
        g = tl.load(g_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        tl.store(g_base + ri[:, None] * DV + offs_d[None, :], g + (r * inv)[:, None] * do[None, :], mask=kd)
        gz = tl.load(gz_base + ri, mask=km, other=0.0)
        tl.store(gz_base + ri, gz - r * inv * inv * dot, mask=km)
        tl.debug_barrier()
        # write of token t
        wi = tl.load(WI + tok * K + offs_k, mask=km, other=0)
        w = tl.load(WW + tok * K + offs_k, mask=km, other=0.0)
        dec = tl.load(DEC + tok * K + offs_k, mask=km, other=0.0)
        v = tl.load(V + tok * DV + offs_d, mask=dm, other=0.0)
        save = (bh * T + t) * K
        prow = tl.load(P + (save + offs_k)[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        pz = tl.load(PZ + save + offs_k, mask=km, other=0.0)
        gs = tl.load(g_base + wi[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        gzw = tl.load(gz_base + wi, mask=km, other=0.0)
        tl.store(DVO + tok * DV + offs_d, tl.sum(w[:, None] * gs, 0), mask=dm)
        tl.store(DDEC + out + offs_k, tl.sum(gs * prow, 1) + gzw * pz, mask=km)
        tl.store(DW + out + offs_k, tl.sum(gs * v[None, :], 1) + gzw, mask=km)
        tl.store(g_base + wi[:, None] * DV + offs_d[None, :], dec[:, None] * gs, mask=kd)
        tl.store(gz_base + wi, dec * gzw, mask=km)
        tl.store(s_base + wi[:, None] * DV + offs_d[None, :], prow, mask=kd)
        tl.store(z_base + wi, pz, mask=km)
        tl.debug_barrier()


# ------------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------------
class _ChunkPlan:
    """Tiles of one chunked call: chunk ``BT`` (a power of two in [16, 64]), reading tokens ``BR`` a program of
    the read kernels takes at a time, slot tile ``BMS`` of the state kernels and of the read backward's reads of
    the start state, value columns ``BDV``."""

    def __init__(self, T, M, dv, K, chunk_size):
        self.BMS = min(max(16, pow2(M)), 64)  # slots a state kernel (and the read backward's reads of S_0) takes at once
        self.BT = max(16, min(64, pow2(chunk_size)))
        self.BDV = min(32, max(16, pow2(dv)))
        # value columns of the state backward: 32 spill 392 bytes a thread beside its [BT, BMS] tiles on sm_90 and
        # still run faster than 16 (H200, 16K tokens: 0.56 ms against 0.68; scripts/gpu_variants_ab.py)
        self.BDV_STATE_BWD = 32
        self.BK = pow2(K)
        self.BR = min(self.BT, READ_ROWS)
        self.NC = cdiv(T, self.BT)
        self.warps = 8
        self.BE = 512


def _addressable(*xs):
    """``(tensors, stride)``: the tensors as they are when they share one token stride, else contiguous copies."""
    strides = {token_stride(x) for x in xs}
    if len(strides) == 1 and None not in strides:
        return xs, strides.pop()
    xs = tuple(x.contiguous() for x in xs)
    return xs, xs[0].shape[2] * xs[0].shape[3]


class _ChunkedSlots(torch.autograd.Function):
    """Inputs ``wi, w, ri, r (B, T, H, K)``, ``v (B, T, H, d_v)`` (each may be a slice with a token stride, see
    :func:`kernels.common.token_stride`), ``gamma (H,)``, ``S0 (B, H, M, d_v)``, ``z0 (B, H, M)`` (fp32) or None; returns
    ``(o (B, T, H, d_v), S_T (B, H, M, d_v), z_T (B, H, M))``. The log decays of the writes are computed from
    ``w`` and ``gamma`` inside the kernels, and their gradient passed to ``w`` and ``gamma`` there."""

    @staticmethod
    def forward(ctx, wi, w, ri, r, v, gamma, S0, z0, num_slots, eps, chunk_size):
        ctx.set_materialize_grads(False)
        B, T, H, K = wi.shape
        dv, M = v.shape[-1], num_slots
        pl = _ChunkPlan(T, M, dv, K, chunk_size)
        (wi, w, ri, r), SA = _addressable(wi, w, ri, r)
        (v,), SV = _addressable(v)
        gamma = gamma.contiguous()
        BH, E = B * H, M * (dv + 1)
        XS = torch.empty(BH, pl.NC, M, dv + 1, dtype=torch.float32, device=v.device)
        DEC = torch.empty(BH, pl.NC, M, dtype=torch.float32, device=v.device)
        S = torch.empty(B, H, M, dv, dtype=torch.float32, device=v.device)
        z = torch.empty(B, H, M, dtype=torch.float32, device=v.device)
        O = torch.empty(B, T, H, dv, dtype=v.dtype, device=v.device)
        launch(_slots_state, (pl.NC, BH), wi, w, gamma, v, XS, DEC, T, H, M, K, dv, pl.NC, SA, SV,
               BT=pl.BT, BM=pl.BMS, BDV=pl.BDV, num_warps=pl.warps)
        has_init = S0 is not None
        launch(_slots_carry, (cdiv(E, pl.BE), BH), XS, DEC, S0 if has_init else XS, z0 if has_init else XS,
               S, z, E, dv + 1, pl.NC, HAS_X0=has_init, REVERSE=False, BE=pl.BE, NS=_STAGES, num_warps=4)
        launch(_slots_read, (pl.NC, BH), wi, w, gamma, ri, r, v, XS, O, T, H, M, K, dv,
               pl.NC, SA, SV, eps, BT=pl.BT, BR=pl.BR, BDV=pl.BDV, BK=pl.BK, num_warps=pl.warps)
        ctx.save_for_backward(wi, w, ri, r, v, gamma, XS, DEC)
        ctx.meta = (M, eps, chunk_size, SA, SV, has_init)
        return O, S, z

    @staticmethod
    def backward(ctx, dO, dS, dz):
        wi, w, ri, r, v, gamma, XS, DEC = ctx.saved_tensors
        M, eps, chunk_size, SA, SV, has_init = ctx.meta
        B, T, H, K = wi.shape
        dv = v.shape[-1]
        pl = _ChunkPlan(T, M, dv, K, chunk_size)
        BH, E = B * H, M * (dv + 1)
        f32 = dict(dtype=torch.float32, device=v.device)
        dO = torch.zeros(B, T, H, dv, dtype=v.dtype, device=v.device) if dO is None else dO.to(v.dtype).contiguous()
        has_final = dS is not None or dz is not None
        if has_final:
            dS = torch.zeros(B, H, M, dv, **f32) if dS is None else dS.float().contiguous()
            dz = torch.zeros(B, H, M, **f32) if dz is None else dz.float().contiguous()
        LG = torch.empty_like(XS)
        dS0, dz0 = torch.empty(B, H, M, dv, **f32), torch.empty(B, H, M, **f32)
        DR = torch.empty(B, T, H, K, dtype=r.dtype, device=v.device)
        DLA, DW = (torch.empty(B, T, H, K, **f32) for _ in range(2))
        DWO = torch.empty(B, T, H, K, dtype=w.dtype, device=v.device)
        DG = torch.empty(BH, pl.NC, **f32)
        DVP = torch.empty(B, T, H, dv, **f32)
        DVO = torch.empty(B, T, H, dv, dtype=v.dtype, device=v.device)
        launch(_slots_read_bwd, (pl.NC, BH), wi, w, gamma, ri, r, v, XS, dO, LG, DR, DLA, DW, DVP, T, H, M, K, dv,
               pl.NC, SA, SV, eps, BT=pl.BT, BR=pl.BR, BM=pl.BMS, BDV=pl.BDV, BK=pl.BK, num_warps=pl.warps)
        launch(_slots_carry, (cdiv(E, pl.BE), BH), LG, DEC, dS if has_final else LG, dz if has_final else LG,
               dS0, dz0, E, dv + 1, pl.NC, HAS_X0=has_final, REVERSE=True, BE=pl.BE, NS=_STAGES, num_warps=4)
        launch(_slots_state_bwd, (pl.NC, BH), wi, w, gamma, v, XS, LG, DEC, DLA, DW, DWO, DG, DVP, DVO, T, H, M, K,
               dv, pl.NC, SA, SV, BT=pl.BT, BM=pl.BMS, BDV=pl.BDV_STATE_BWD, ONE_TILE=M <= pl.BMS,
               num_warps=pl.warps)
        dgamma = DG.view(B, H, pl.NC).sum((0, 2)).to(gamma.dtype) if ctx.needs_input_grad[5] else None
        init = (dS0, dz0) if has_init else (None, None)
        return None, DWO, None, DR, DVO, dgamma, *init, None, None, None


def _sparse_blocks(K, dv):
    return pow2(K), min(32, pow2(dv))


def _sparse_state(S0, z0, B, H, M, dv, tiles, like):
    """The working memory of the sparse kernels, which write it in place: ``S (B, H, M, d_v)`` and one copy of the
    normaliser per ``d_v`` tile, ``(B H, tiles, M)``, always new tensors (never the caller's initial state, which
    the backward reads again)."""
    if S0 is None:
        return like.new_zeros(B, H, M, dv), like.new_zeros(B * H, tiles, M)
    return S0.float().clone(memory_format=torch.contiguous_format), z0.float().reshape(B * H, 1, M).repeat(1, tiles, 1)


class _SparseSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wi, w, dec, ri, r, v, S0, z0, num_slots, eps):
        B, T, H, K = wi.shape
        dv = v.shape[-1]
        BK, BD = _sparse_blocks(K, dv)
        tiles = cdiv(dv, BD)
        wi, ri = wi.contiguous(), ri.contiguous()
        w, dec, r, v = (x.float().contiguous() for x in (w, dec, r, v))
        S, Z = _sparse_state(S0, z0, B, H, num_slots, dv, tiles, v)
        P = v.new_empty(B, H, T, K, dv)
        Pz = v.new_empty(B, H, T, K)
        o = v.new_empty(B, T, H, dv)
        launch(_slots_fwd, (B * H, tiles), wi, w, dec, ri, r, v, S, Z, P, Pz, o, T, H, num_slots, K, dv, eps,
               READ=True, BLOCK_K=BK, BLOCK_DV=BD)
        ctx.save_for_backward(wi, w, dec, ri, r, v, P, Pz, *(() if S0 is None else (S0, z0)))
        ctx.meta = (num_slots, eps, S0 is None)
        return o, S, Z.view(B, H, tiles, num_slots)[:, :, 0].contiguous()

    @staticmethod
    def backward(ctx, do, dS, dz):
        wi, w, dec, ri, r, v, P, Pz, *init = ctx.saved_tensors
        M, eps, no_init = ctx.meta
        B, T, H, K = wi.shape
        dv = v.shape[-1]
        BK, BD = _sparse_blocks(K, dv)
        tiles = cdiv(dv, BD)
        S, Z = _sparse_state(*(init if init else (None, None)), B, H, M, dv, tiles, v)
        # rebuild the final memory by replaying the writes (nothing M-sized was saved)
        launch(_slots_fwd, (B * H, tiles), wi, w, dec, ri, r, v, S, Z, P, Pz, v, T, H, M, K, dv, eps,
               READ=False, BLOCK_K=BK, BLOCK_DV=BD)
        GS = v.new_zeros(B, H, M, dv) if dS is None else dS.float().contiguous().clone()
        GZ = v.new_zeros(B * H, tiles, M)
        if dz is not None:
            GZ[:, 0] = dz.float().reshape(B * H, M)
        do = v.new_zeros(B, T, H, dv) if do is None else do.float().contiguous()
        dr, dw, ddec = (v.new_empty(tiles, B, T, H, K) for _ in range(3))
        dvo = v.new_empty(B, T, H, dv)
        launch(_slots_bwd, (B * H, tiles), wi, w, dec, ri, r, v, S, Z, P, Pz, do, GS, GZ, dr, dw, ddec, dvo,
               T, H, M, K, dv, B * T * H, eps, BLOCK_K=BK, BLOCK_DV=BD)
        dS0, dz0 = (None, None) if no_init else (GS, GZ.view(B, H, tiles, M).sum(2))
        return None, dw.sum(0), ddec.sum(0), None, dr.sum(0), dvo, dS0, dz0, None, None


def slot_memory_triton(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                       initial_state=None, chunk_size: int = 32):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))`` (state in fp32). The chunked kernels
    run for ``num_slots <= CHUNKED_MAX_SLOTS`` with chunks of ``chunk_size`` tokens (a power of two in
    [16, 64]; it does not change the result), the sparse scan above."""
    if v.dtype == torch.float64:
        raise TypeError("slot_memory_triton: fp64 is not supported by the Triton kernels; use backend='torch' "
                        "or 'reference' for fp64")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"slot_memory_triton: chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, dv = v.shape
    M = num_slots
    S0, z0 = (None, None) if initial_state is None else initial_state
    if M <= CHUNKED_MAX_SLOTS:
        if initial_state is not None:
            S0, z0 = S0.float().contiguous(), z0.float().contiguous()
        o, S, z = _ChunkedSlots.apply(write_idx, write_w, read_idx, read_w, v, gamma, S0, z0, M, eps, chunk_size)
        return o, as_state((S, z), v)
    decay = torch.exp(log_keep(write_w.float(), gamma.float()[:, None]))
    o, S, z = _SparseSlots.apply(write_idx, write_w, decay, read_idx, read_w, v, S0, z0, M, eps)
    return o.to(v.dtype), as_state((S, z), v)


# ------------------------------------------------------------------------------------------------------
# Kronecker top-K addressing (kernels.slots.addressing.kronecker_topk)
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _factor_probs(L, roff, rm, u: tl.constexpr, DP: tl.constexpr, tau, BD: tl.constexpr):
    # softmax(l_u / tau) of factor u of every row: [BR, BD], zero in the padding
    d = tl.arange(0, BD)
    dm = d < DP
    lg = tl.load(L + roff[:, None] + u * DP + d[None, :], mask=rm[:, None] & dm[None, :], other=0.0)
    zt = tl.where(dm[None, :], lg.to(tl.float32) / tau, float("-inf"))
    e = tl.exp(zt - tl.max(zt, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _digit(slot, u: tl.constexpr, U: tl.constexpr, DP: tl.constexpr):
    # digit u (most significant first) of slot numbers in base DP
    for _ in tl.static_range(U - 1 - u):
        slot = slot // DP
    return slot % DP


@triton.jit
def _at_digits(p, digit, BD: tl.constexpr):
    # p [BR, BD] read at digit [BR, BC] -> [BR, BC]
    d = tl.arange(0, BD)
    return tl.sum(tl.where(digit[:, :, None] == d[None, None, :], p[:, None, :], 0.0), axis=2)


@triton.jit
def _topk_fwd(L, IDX, W, R, NI, SO, SI, tau, U: tl.constexpr, DP: tl.constexpr, K: tl.constexpr,
              RENORM: tl.constexpr, HARD: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    # BR rows (addresses) per program; row r's U DP logits start at (r // NI) SO + (r % NI) SI. The K best
    # partial products are kept after every factor: candidates [BR, BC (kept prefixes), BD (digits)], the
    # best taken K times, ties to the lower (partial) slot number as the torch backend breaks them; a padding
    # candidate (value -1, a number above every slot's) never beats a real one
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = row < R
    roff = (row // NI) * SO + (row % NI) * SI
    a = tl.arange(0, BC)
    d = tl.arange(0, BD)
    n = (a[:, None] * BD + d[None, :]).to(tl.int64)
    val = tl.where(a == 0, 1.0, -1.0)[None, :] + tl.zeros([BR, BC], dtype=tl.float32)  # one empty prefix
    slot = tl.zeros([BR, BC], dtype=tl.int64)
    nan = tl.zeros([BR], dtype=tl.float32)  # 1 where a factor's probabilities are NaN (a non-finite logit)
    for u in tl.static_range(U):
        p = _factor_probs(L, roff, rm, u, DP, tau, BD)
        nan = tl.maximum(nan, tl.max(tl.where(p == p, 0.0, 1.0), axis=1))
        p = tl.where(p == p, p, 0.0)
        ok = (val[:, :, None] >= 0.0) & (d < DP)[None, None, :]
        cand = tl.where(ok, val[:, :, None] * p[:, None, :], -1.0)
        cslot = tl.where(ok, slot[:, :, None] * DP + d[None, None, :], n[None, :, :] + _PAD_SLOT)
        val = tl.full([BR, BC], -1.0, dtype=tl.float32)
        slot = tl.zeros([BR, BC], dtype=tl.int64)
        for j in range(K):
            best = tl.max(tl.max(cand, axis=2), axis=1)
            at = tl.min(tl.min(tl.where(cand == best[:, None, None], cslot, 2 * _PAD_SLOT), axis=2), axis=1)
            hit = cslot == at[:, None, None]
            val = tl.where(a[None, :] == j, best[:, None], val)
            slot = tl.where(a[None, :] == j, at[:, None], slot)
            cand = tl.where(hit, -2.0, cand)
    km = a < K
    w = tl.where(km[None, :], val, 0.0)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    if HARD:
        w = tl.zeros([BR, BC], dtype=tl.float32) + 1.0 / K
    w = tl.where(nan[:, None] > 0.0, float("nan"), w)
    out = row[:, None] * K + a[None, :]
    m2 = rm[:, None] & km[None, :]
    tl.store(IDX + out, slot, mask=m2)
    tl.store(W + out, w, mask=m2)


@triton.jit
def _topk_bwd(L, IDX, DW, DL, R, NI, SO, SI, tau, U: tl.constexpr, DP: tl.constexpr, K: tl.constexpr,
              RENORM: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    # the gradient of the logits from that of the weights: through the renormalisation, then the product
    # w_j = prod_u p_u[i_uj] (the factor u's share is the product of the other factors, never a division), then
    # each factor's softmax; the selection itself passes nothing. DL: contiguous rows of U DP.
    row = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = row < R
    roff = (row // NI) * SO + (row % NI) * SI
    a = tl.arange(0, BC)
    d = tl.arange(0, BD)
    km = a < K
    out = row[:, None] * K + a[None, :]
    m2 = rm[:, None] & km[None, :]
    slot = tl.load(IDX + out, mask=m2, other=0)
    g = tl.load(DW + out, mask=m2, other=0.0).to(tl.float32)
    if RENORM:  # wn = w / s: dw = (g - sum_j g_j wn_j) / s
        w = tl.where(km[None, :], 1.0, 0.0) + tl.zeros([BR, BC], dtype=tl.float32)
        for u in tl.static_range(U):
            w *= _at_digits(_factor_probs(L, roff, rm, u, DP, tau, BD), _digit(slot, u, U, DP), BD)
        s = tl.sum(w, axis=1)
        g = tl.where(km[None, :], (g - (tl.sum(g * w, axis=1) / s)[:, None]) / s[:, None], 0.0)
    for u in tl.static_range(U):
        others = tl.zeros([BR, BC], dtype=tl.float32) + 1.0
        for u2 in tl.static_range(U):
            if u2 != u:
                others *= _at_digits(_factor_probs(L, roff, rm, u2, DP, tau, BD), _digit(slot, u2, U, DP), BD)
        p = _factor_probs(L, roff, rm, u, DP, tau, BD)
        du = _digit(slot, u, U, DP)
        gp = tl.sum(tl.where(du[:, :, None] == d[None, None, :], (g * others)[:, :, None], 0.0), axis=1)
        dl = p * (gp - tl.sum(p * gp, axis=1)[:, None]) / tau
        tl.store(DL + row[:, None] * (U * DP) + u * DP + d[None, :], dl.to(DL.dtype.element_ty),
                 mask=rm[:, None] & (d < DP)[None, :])


def _logit_rows(logits: torch.Tensor):
    """``(rows, NI, SO, SI)``: ``logits (..., U, d_p)`` as ``(outer, NI, U d_p)`` rows that the kernels address as
    ``(r // NI) SO + (r % NI) SI`` without a copy where the strides allow it (a slice of a wider tensor whose
    leading dimensions merge into two), else a contiguous copy."""
    lead, width = logits.shape[:-2], logits.shape[-2] * logits.shape[-1]
    for j in range(len(lead) + 1):
        try:
            rows = logits.view(math.prod(lead[:j]), math.prod(lead[j:]), width)
        except RuntimeError:
            continue
        if rows.stride(2) == 1 or width == 1:
            return rows, rows.shape[1], rows.stride(0), rows.stride(1)
    rows = logits.contiguous().view(1, -1, width)
    return rows, rows.shape[1], rows.stride(0), rows.stride(1)


def _topk_blocks(K: int, dp: int):
    """Rows per program ``BR`` and tiles ``BC`` (kept prefixes, >= K) and ``BD`` (digits): ``BR BC BD <= 2048``
    candidates per program."""
    BC, BD = pow2(K), pow2(dp)
    return max(1, min(64, 2048 // (BC * BD))), BC, BD


class _KroneckerTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, tau, renormalize, hard):
        ctx.set_materialize_grads(False)
        lead, (U, dp) = logits.shape[:-2], logits.shape[-2:]
        R = math.prod(lead)
        idx = torch.empty(*lead, k, dtype=torch.int64, device=logits.device)
        w = torch.empty(*lead, k, dtype=torch.float32, device=logits.device)
        BR, BC, BD = _topk_blocks(k, dp)
        if R:
            rows, NI, SO, SI = _logit_rows(logits)
            launch(_topk_fwd, (cdiv(R, BR),), rows, idx, w, R, NI, SO, SI, float(tau), U=U, DP=dp, K=k,
                   RENORM=renormalize, HARD=hard, BR=BR, BC=BC, BD=BD, num_warps=4)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(logits, idx)
        ctx.meta = (k, tau, renormalize)
        return idx, w

    @staticmethod
    def backward(ctx, didx, dw):
        logits, idx = ctx.saved_tensors
        k, tau, renormalize = ctx.meta
        if dw is None:
            return None, None, None, None, None
        U, dp = logits.shape[-2:]
        R = math.prod(logits.shape[:-2])
        dl = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        BR, BC, BD = _topk_blocks(k, dp)
        if R:
            rows, NI, SO, SI = _logit_rows(logits)
            launch(_topk_bwd, (cdiv(R, BR),), rows, idx, dw.contiguous(), dl, R, NI, SO, SI, float(tau),
                   U=U, DP=dp, K=k, RENORM=renormalize, BR=BR, BC=BC, BD=BD, num_warps=4)
        return dl, None, None, None, None


def kronecker_topk_triton(logits: torch.Tensor, k: int, tau: float = 1.0, renormalize: bool = False,
                          straight_through: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.slots.addressing.kronecker_topk` in one kernel forward and one backward: ``logits (..., U, d_p)``
    (fp32, bf16 or fp16; any strides that merge the leading dimensions into two, such as the address columns
    of a layer's projections) -> ``(idx (..., k) int64, weights (..., k) fp32)``, best first."""
    if logits.dtype == torch.float64:
        raise TypeError("kronecker_topk_triton: fp64 is not supported by the Triton kernels; use backend='torch'")
    if logits.shape[-1] ** logits.shape[-2] >= 2 ** 40:
        raise ValueError(f"kronecker_topk_triton: d_p^U = {logits.shape[-1]}^{logits.shape[-2]} slots exceed the "
                         "kernel's 2^40 slot numbers; use backend='torch' or fewer slots")
    return _KroneckerTopk.apply(logits, k, tau, renormalize, straight_through)
