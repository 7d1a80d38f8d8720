"""The chunk stages of a gated linear recurrence in Triton: GLA's ``triton`` backend, shared with GKA.

A head's state after token ``t`` is ``S_t = e^{g_t} S_{t-1} + a_t k_t^T`` (rows ``a_t = v_t``: GLA's and GKA's
``U``; with ``KK`` the key covariance ``H`` = ``sum k k^T`` sits above it, rows ``a_t = k_t``, sharing the decay),
and the readout is ``o_t = scale U_t q_t``. Per chunk ``c`` of ``C`` tokens (``G_t`` the inclusive cumulative
log decay from the chunk start, computed in the kernels from ``g``; ``M_ts = e^{G_t - G_s}`` for ``s <= t``;
``S_c`` the state the chunk starts from; ``gl = G_{C-1}``):

    S_{c+1} = e^{gl} S_c + sum_s e^{gl - G_s} a_s k_s^T                                     (state pass)
    o_t = scale (sum_{s<=t} M_ts (q_t . k_s) v_s + e^{G_t} U_c q_t)                          (output)

Four kernels, one launch each (whatever the length). Their references are the PyTorch stages of the CPU path:
:func:`kernels.gla.chunked.gla_chunk_states` (GKA's ``(H, U)`` pair: :func:`kernels.gka.chunked.chunk_states`)
for the state pass, :func:`kernels.gla.chunked.gla_chunk_readout` for the output, and autograd through them for
the two backward kernels:

- ``_state_fwd`` (grid: row blocks of the state x heads): walks the chunks in order with its block of rows of
  ``S`` in registers, storing every chunk-start state ``S_c`` (fp32) and the final state.
- ``_output_fwd`` (grid: chunks x heads x value blocks): the output of one chunk from its start state.
- ``_state_bwd`` (grid as ``_state_fwd``): walks the chunks backwards with ``D_c = dL/dS_{c+1}`` in registers:
  ``D_{c-1} = e^{gl} D_c + J_c``, ``J_c = dL/dS_c`` from chunk c's own use of its start state: the readout,
  ``scale sum_t e^{G_t} do_t q_t^T`` for the ``U`` rows, or a given tensor ``E_c`` for the ``H`` rows (GKA's
  solve reads ``H_c``). Stores every ``D_c`` and ``dL/dS_0``.
- ``_chunk_bwd`` (grid: chunks x heads): with ``P = (Q K^T) * M`` and ``W = dP * P``: the readout's ``dq``,
  ``dk``, ``dv`` and ``dG_t = q_t . dq^{inter}_t + sum_s W_ts - sum_s W_st`` (``LOCAL``), and the chunk's
  contribution to the state pass (``STATE``): ``dk_s``, ``dv_s`` from ``e^{gl - G_s} D_c``, ``dG_s -=
  e^{gl - G_s} a_s^T D_c k_s`` and ``dG_{C-1} += e^{gl} <D_c, S_c> + sum_s e^{gl - G_s} a_s^T D_c k_s``; then
  ``dg`` is the reverse cumulative sum of ``dG`` within the chunk. GLA runs both parts in one launch; GKA runs
  ``LOCAL`` first (into fp32 partial buffers), its solve's backward, then ``STATE`` (which adds the partials).

Layouts: token tensors are ``(B, T, H, D)`` views with any strides (unit stride along ``D``): the kernels read
the strided ``q|k`` slices of a layer's projections without copies, and mask the tail of the last chunk (the
padding of the PyTorch path: ``q = k = v = 0``, ``g = 0``). States are ``(B, H, n, R, d_k)`` fp32.

Precision. fp32 inputs: exact fp32 products (``input_precision="ieee"``). bf16/fp16 inputs: every product takes
16-bit operands with fp32 accumulation (:mod:`kernels.pieces`); inputs enter exact, and an operand the kernel
computed in fp32 (a state, a decay-weighted tile, ``P``, ``dP``) enters as ``P`` 16-bit pieces: one for GLA
(its relative error is then the 16-bit rounding of those operands, as in flash-linear-attention's chunk
kernels), two for GKA, whose readout of a query ``x ~ (H + lam I)^{-1} q`` cancels (``U`` nearly annihilates
the large part of ``x`` the keys do not span: an operand error relative to ``|x|`` reaches ``o`` amplified up
to ``1 / ridge_a``). States and accumulators stay fp32; the query may itself be an fp32 buffer (``QP`` pieces).

Decays within a chunk. Each exponent is summed over its own segment (:func:`chunk_log_decays`,
:func:`segment_decay_mask`: the masked cumulative sum over the ``C x C`` tile, as Mamba-2's segsum, and the suffix
sum ``gl - G_s`` of the next steps), and with ``LOCAL`` and ``STATE`` in one launch (GLA) a step's gate gradient
sums the segments that hold it (``sum_{t>=r, s<r} W_ts`` from a reverse cumulative sum of the tile, ``sum_{s<r}``
of the state pass's terms), not the reverse cumulative sum of ``dG``, whose ``sum_s W_ts - sum_s W_st`` cancels
O(1) terms. As ``exp(G_t - G_s)`` of cumulative sums (flash-linear-attention's form) a weak segment after strong
steps (``G`` ~ -1000) kept only ``|G| eps`` ~ 6e-5 of its exponent. Measured in fp32 against fp64 (interpreter,
T 128, chunk 64, 2 heads of d 16, 60 draws; relative Frobenius error): with log decays of -20..-40 among -0.05..0
in one chunk, output and gradients <= 2e-7 (before: 6.7e-6..2.8e-5) and a strong step's own gate gradient
<= 3.2e-6 (before: ~1e3 times its size); at -40..-60 everywhere, output and gradients <= 2.2e-7 (the gate
gradient before: lost, 0.84..1.0). GKA's split launches (``LOCAL``, its solve, then ``STATE``) keep the
``dG`` form, to which the solve's backward adds (:mod:`kernels.gka.triton`). The chunked PyTorch path
(:func:`kernels.common.segment_log_decays`) sums the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_state, cdiv, pow2, unit_last
from ..grad_slots import empty_grad
from ..launch import launch
from ..pieces import OPERAND_CODES, mm, mm_acc, mm_rows, mm_tn, operand, state_pieces

#: 16-bit pieces per computed fp32 operand for GLA (GKA passes two)
GLA_PIECES = 1


# --------------------------------------------------------------------------------------------------
# loads
# --------------------------------------------------------------------------------------------------
@triton.jit
def tokens(ptr, b, h, offs_t, T, sb, st, sh, offs_d, D):
    """The ``(len(offs_t), len(offs_d))`` tile of a ``(B, T, H, D)`` token tensor (zero outside), fp32."""
    m = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    off = b * sb + h * sh + offs_t.to(tl.int64)[:, None] * st + offs_d[None, :]
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_tokens(ptr, x, b, h, offs_t, T, sb, st, sh, offs_d, D):
    """Store ``x`` into the tile :func:`tokens` reads (cast to the tensor's dtype)."""
    m = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    off = b * sb + h * sh + offs_t.to(tl.int64)[:, None] * st + offs_d[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def chunk_gates(G_ptr, b, h, offs_t, T, sb, st, sh, C: tl.constexpr, CUM: tl.constexpr):
    """``(G, gl)``: the chunk's inclusive cumulative log decays from ``g`` (``CUM``; else ``G`` is given) and
    its last one. Tokens past ``T`` have ``g = 0``."""
    g = tl.load(G_ptr + b * sb + h * sh + offs_t.to(tl.int64) * st, mask=offs_t < T, other=0.0).to(tl.float32)
    if CUM:
        G = tl.cumsum(g, 0)
    else:
        G = g
    gl = tl.sum(tl.where(tl.arange(0, C) == C - 1, G, 0.0), 0)
    return G, gl


@triton.jit
def chunk_log_decays(G_ptr, b, h, offs_t, T, sb, st, sh, C: tl.constexpr):
    """``(g, G, gl, to_end)``: the chunk's per-step log decays, their inclusive cumulative sums and its last one
    (:func:`chunk_gates`), and ``to_end_s = sum_{s<r<C} g_r`` (``gl - G_s``) as the suffix sum of the next steps
    (``g`` read one step on), rounded within its own segment: as ``gl - G_s`` a weak segment after strong steps
    (``G`` ~ -1000) kept only ``|G| eps`` ~ 6e-5 of its exponent."""
    g = tl.load(G_ptr + b * sb + h * sh + offs_t.to(tl.int64) * st, mask=offs_t < T, other=0.0).to(tl.float32)
    G = tl.cumsum(g, 0)
    gl = tl.sum(tl.where(tl.arange(0, C) == C - 1, G, 0.0), 0)
    nxt = (tl.arange(0, C) + 1 < C) & (offs_t + 1 < T)
    g_next = tl.load(G_ptr + b * sb + h * sh + (offs_t + 1).to(tl.int64) * st, mask=nxt, other=0.0).to(tl.float32)
    return g, G, gl, tl.cumsum(g_next, 0, reverse=True)


@triton.jit
def segment_decay_mask(g, offs_c):
    """``M_ts = e^{sum_{s<r<=t} g_r}`` for ``s <= t``, else 0, from the per-step log decays of a chunk: each
    exponent a masked cumulative sum over its own segment (as Mamba-2's segsum), not ``G_t - G_s``."""
    steps = tl.where(offs_c[:, None] > offs_c[None, :], g[:, None], 0.0)   # [r, s] = g_r where r > s
    causal = offs_c[:, None] >= offs_c[None, :]
    return tl.exp(tl.where(causal, tl.cumsum(steps, 0), float("-inf")))


@triton.jit
def state_tile(S_ptr, bh, c, n, R, DK, rows, mr, offs_k, mk):
    """Rows ``rows`` of the state ``(B*H, n, R, DK)`` of chunk ``c`` (fp32)."""
    off = ((bh * n + c) * R + rows)[:, None] * DK + offs_k[None, :]
    return tl.load(S_ptr + off, mask=mr[:, None] & mk[None, :], other=0.0)


@triton.jit
def _row_group(blk, DK, DV, BR: tl.constexpr, KK: tl.constexpr):
    """Which rows of the state the row block ``blk`` owns: ``(is_h, local rows, state rows, rows of its group)``;
    with ``KK`` the first ``cdiv(DK, BR)`` blocks are ``H``'s rows (``a = k``), the rest ``U``'s (``a = v``)."""
    if KK:
        nbk = tl.cdiv(DK, BR)
        u_base = DK
    else:
        nbk = 0
        u_base = 0
    is_h = blk < nbk
    local = tl.where(is_h, blk, blk - nbk) * BR + tl.arange(0, BR)
    base = tl.where(is_h, 0, u_base)
    n_rows = tl.where(is_h, DK, DV)
    return is_h, local, base + local, local < n_rows


# --------------------------------------------------------------------------------------------------
# state pass, forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _state_fwd_pass(s, A, b, h, bh, n, T, DA, sab, sat, sah, local, K, G, STARTS, R, DK, skb, skt, skh,
                    sgb, sgt, sgh, soff, smask, offs_k, C: tl.constexpr, OP: tl.constexpr, P: tl.constexpr):
    """The forward state pass of rows ``local`` of ``A`` (``k`` for ``H``'s rows, ``v`` for ``U``'s): stores the
    state entering every chunk and returns the final one. One loop per row group (not a branch inside one
    loop), so that the compiler can issue the next chunk's loads ahead of this one's arithmetic."""
    offs_c = tl.arange(0, C)
    for c in range(n):
        offs_t = c * C + offs_c
        tl.store(STARTS + (bh * n + c) * R * DK + soff, s, mask=smask)
        _g, _Gc, gl, to_end = chunk_log_decays(G, b, h, offs_t, T, sgb, sgt, sgh, C)
        k = operand(tokens(K, b, h, offs_t, T, skb, skt, skh, offs_k, DK), OP)
        a = tokens(A, b, h, offs_t, T, sab, sat, sah, local, DA)
        aw = tl.trans(a * tl.exp(to_end)[:, None])
        s = s * tl.exp(gl) + mm(aw, k, k, k, OP, P, 1)
    return s


@triton.jit
def _state_fwd(K, V, G, S0, STARTS, FIN, T, H, n, DK, DV,
               skb, skt, skh, svb, svt, svh, sgb, sgt, sgh,
               C: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, KK: tl.constexpr, HAS_INIT: tl.constexpr,
               OP: tl.constexpr, P: tl.constexpr):
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    R = DV + DK if KK else DV
    is_h, local, rows, mr = _row_group(blk, DK, DV, BR, KK)
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    smask = mr[:, None] & mk[None, :]
    soff = rows[:, None] * DK + offs_k[None, :]
    if HAS_INIT:
        s = tl.load(S0 + bh * R * DK + soff, mask=smask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BR, BK], dtype=tl.float32)
    if KK:
        if is_h:
            s = _state_fwd_pass(s, K, b, h, bh, n, T, DK, skb, skt, skh, local, K, G, STARTS, R, DK, skb, skt, skh,
                                sgb, sgt, sgh, soff, smask, offs_k, C, OP, P)
        else:
            s = _state_fwd_pass(s, V, b, h, bh, n, T, DV, svb, svt, svh, local, K, G, STARTS, R, DK, skb, skt, skh,
                                sgb, sgt, sgh, soff, smask, offs_k, C, OP, P)
    else:
        s = _state_fwd_pass(s, V, b, h, bh, n, T, DV, svb, svt, svh, local, K, G, STARTS, R, DK, skb, skt, skh,
                            sgb, sgt, sgh, soff, smask, offs_k, C, OP, P)
    tl.store(FIN + bh * R * DK + soff, s, mask=smask)


# --------------------------------------------------------------------------------------------------
# output, forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _output_fwd(Q, K, V, G, STARTS, O, scale, T, H, n, DK, DV, R, U_ROW,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sob, sot, soh,
                C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, OP: tl.constexpr, QP: tl.constexpr,
                P: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_c = tl.arange(0, C)
    offs_t = c * C + offs_c
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mv = offs_v < DV
    gs, Gc, _gl, _to_end = chunk_log_decays(G, b, h, offs_t, T, sgb, sgt, sgh, C)
    q = tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_k, DK)
    kt = tl.trans(operand(tokens(K, b, h, offs_t, T, skb, skt, skh, offs_k, DK), OP))
    p = mm_rows(q, kt, kt, kt, OP, QP, 1) * segment_decay_mask(gs, offs_c)
    v = operand(tokens(V, b, h, offs_t, T, svb, svt, svh, offs_v, DV), OP)
    o = mm_rows(p, v, v, v, OP, P, 1)
    s0 = state_tile(STARTS, bh, c, n, R, DK, U_ROW + offs_v, mv, offs_k, mk)
    s1, s2, s3, ss = state_pieces(tl.trans(s0), OP, P)
    o += tl.exp(Gc)[:, None] * (mm_rows(q, s1, s2, s3, OP, QP, P) * ss)
    store_tokens(O, o * scale, b, h, offs_t, T, sob, sot, soh, offs_v, DV)


# --------------------------------------------------------------------------------------------------
# state pass, backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _state_bwd_h(d, E, G, DS, b, h, bh, n, T, DK, R, local, soff, smask, offs_k, sgb, sgt, sgh,
                 C: tl.constexpr, HAS_E: tl.constexpr):
    """The backward state pass of ``H``'s rows: ``E`` (the solve's and the norm's ``dL/dH_0``) enters each chunk."""
    for i in range(n):
        c = n - 1 - i
        tl.store(DS + (bh * n + c) * R * DK + soff, d, mask=smask)
        _Gc, gl = chunk_gates(G, b, h, c * C + tl.arange(0, C), T, sgb, sgt, sgh, C, True)
        d = d * tl.exp(gl)
        if HAS_E:
            d += tl.load(E + ((bh * n + c) * DK + local)[:, None] * DK + offs_k[None, :], mask=smask, other=0.0)
    return d


@triton.jit
def _state_bwd_u(d, Q, DO, G, DS, scale, b, h, bh, n, T, DK, DV, R, local, soff, smask, offs_k,
                 sqb, sqt, sqh, sdb, sdt, sdh, sgb, sgt, sgh, C: tl.constexpr, OP: tl.constexpr, P: tl.constexpr):
    """The backward state pass of ``U``'s rows: the readout's gradient ``scale (e^G dO)^T Q`` enters each chunk."""
    for i in range(n):
        c = n - 1 - i
        offs_t = c * C + tl.arange(0, C)
        tl.store(DS + (bh * n + c) * R * DK + soff, d, mask=smask)
        Gc, gl = chunk_gates(G, b, h, offs_t, T, sgb, sgt, sgh, C, True)
        do = tokens(DO, b, h, offs_t, T, sdb, sdt, sdh, local, DV) * tl.exp(Gc)[:, None]
        q = tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_k, DK)
        d = d * tl.exp(gl) + mm_tn(do, q, OP, P) * scale
    return d


@triton.jit
def _state_bwd(Q, DO, G, E, DFIN, DS, DS0, scale, T, H, n, DK, DV,
               sqb, sqt, sqh, sdb, sdt, sdh, sgb, sgt, sgh,
               C: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, KK: tl.constexpr, HAS_E: tl.constexpr,
               HAS_DFIN: tl.constexpr, HAS_INIT: tl.constexpr, OP: tl.constexpr, P: tl.constexpr):
    """The backward state pass, one loop per row group (a branch on the group inside one loop kept the compiler
    from issuing the next chunk's loads ahead of this one's arithmetic)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    R = DV + DK if KK else DV
    is_h, local, rows, mr = _row_group(blk, DK, DV, BR, KK)
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    smask = mr[:, None] & mk[None, :]
    soff = rows[:, None] * DK + offs_k[None, :]
    if HAS_DFIN:
        d = tl.load(DFIN + bh * R * DK + soff, mask=smask, other=0.0).to(tl.float32)
    else:
        d = tl.zeros([BR, BK], dtype=tl.float32)
    if KK:
        if is_h:
            d = _state_bwd_h(d, E, G, DS, b, h, bh, n, T, DK, R, local, soff, smask, offs_k, sgb, sgt, sgh, C, HAS_E)
        else:
            d = _state_bwd_u(d, Q, DO, G, DS, scale, b, h, bh, n, T, DK, DV, R, local, soff, smask, offs_k,
                             sqb, sqt, sqh, sdb, sdt, sdh, sgb, sgt, sgh, C, OP, P)
    else:
        d = _state_bwd_u(d, Q, DO, G, DS, scale, b, h, bh, n, T, DK, DV, R, local, soff, smask, offs_k,
                         sqb, sqt, sqh, sdb, sdt, sdh, sgb, sgt, sgh, C, OP, P)
    if HAS_INIT:
        tl.store(DS0 + bh * R * DK + soff, d, mask=smask)


# --------------------------------------------------------------------------------------------------
# chunk backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _chunk_bwd(Q, K, V, G, DO, STARTS, DS, DQ, DKO, DVO, DGO, DKP, DVP, DGP, scale, T, TQ, H, n, DK, DV, R, U_ROW,
               sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sdb, sdt, sdh,
               sqob, sqot, sqoh, skob, skot, skoh, svob, svot, svoh, sgob, sgot, sgoh,
               C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KK: tl.constexpr, LOCAL: tl.constexpr,
               STATE: tl.constexpr, OP: tl.constexpr, QP: tl.constexpr, P: tl.constexpr):
    """``LOCAL``: the readout's gradients; ``STATE``: the state pass's. With ``STATE`` the outputs are final
    (``dk, dv, dg`` into ``DKO, DVO, DGO``, ``dq`` into ``DQ``) and partials ``DKP, DVP, DGP`` (fp32,
    ``(B*H, n*C, .)``) are added when ``LOCAL`` is off; ``LOCAL`` alone writes ``dq`` into ``DQ`` and
    ``dk, dv, dG`` (not yet summed within the chunk) into the partials. ``dq`` is stored for tokens below
    ``TQ`` (``T``, or ``n C`` for a padded buffer: zeros past ``T``)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Tp = n * C
    offs_c = tl.arange(0, C)
    offs_t = c * C + offs_c
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    g, Gc, gl, to_end = chunk_log_decays(G, b, h, offs_t, T, sgb, sgt, sgh, C)
    w = tl.exp(to_end)
    later = offs_c[None, :] < offs_c[:, None]   # [r, s]: s < r
    kop = operand(tokens(K, b, h, offs_t, T, skb, skt, skh, offs_k, DK), OP)
    dks = tl.zeros([C, BK], dtype=tl.float32)   # sum over U's row blocks of V D (the state part, before w)
    gc = tl.zeros([C], dtype=tl.float32)        # <D, S_c> (in its first entry)
    p = tl.zeros([C, C], dtype=tl.float32)
    dp = tl.zeros([C, C], dtype=tl.float32)
    dqi = tl.zeros([C, BK], dtype=tl.float32)
    if LOCAL:
        kt = tl.trans(kop)
        p = mm_rows(tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_k, DK), kt, kt, kt, OP, QP, 1) \
            * segment_decay_mask(g, offs_c)
    for vb in range(tl.cdiv(DV, BV)):
        offs_v = vb * BV + tl.arange(0, BV)
        mv = offs_v < DV
        vop = operand(tokens(V, b, h, offs_t, T, svb, svt, svh, offs_v, DV), OP)
        if LOCAL:
            do = operand(tokens(DO, b, h, offs_t, T, sdb, sdt, sdh, offs_v, DV), OP)
            vt = tl.trans(vop)
            dp = mm_acc(dp, do, vt, vt, vt, 1.0, OP, 1, 1)
            s1, s2, s3, ss = state_pieces(state_tile(STARTS, bh, c, n, R, DK, U_ROW + offs_v, mv, offs_k, mk), OP, P)
            dqi = mm_acc(dqi, do, s1, s2, s3, ss, OP, 1, P)
            dv = mm_rows(tl.trans(p), do, do, do, OP, P, 1) * scale
        else:
            dv = tl.load(DVP + (bh * Tp + offs_t)[:, None] * DV + offs_v[None, :], mask=mv[None, :], other=0.0)
        if STATE:
            dsu = state_tile(DS, bh, c, n, R, DK, U_ROW + offs_v, mv, offs_k, mk)
            e1, e2, e3, es = state_pieces(dsu, OP, P)
            dv += w[:, None] * (mm(kop, tl.trans(e1), tl.trans(e2), tl.trans(e3), OP, 1, P) * es)
            dks = mm_acc(dks, vop, e1, e2, e3, es, OP, 1, P)
            s0u = state_tile(STARTS, bh, c, n, R, DK, U_ROW + offs_v, mv, offs_k, mk)
            gc += tl.where(offs_c == 0, tl.sum(tl.sum(dsu * s0u, axis=1), axis=0), 0.0)
            store_tokens(DVO, dv, b, h, offs_t, T, svob, svot, svoh, offs_v, DV)
        else:
            tl.store(DVP + (bh * Tp + offs_t)[:, None] * DV + offs_v[None, :], dv, mask=mv[None, :])
    dG = tl.zeros([C], dtype=tl.float32)   # d/dG_t, summed to dg by a reverse cumulative sum
    dgs = tl.zeros([C], dtype=tl.float32)  # d/dg_r already (LOCAL and STATE in one launch)
    st = tl.zeros([C], dtype=tl.float32)
    if STATE:
        st = tl.sum(dks * kop.to(tl.float32), axis=1)     # a_s^T D k_s over U's rows
        dk = w[:, None] * dks
    else:
        dk = tl.zeros([C, BK], dtype=tl.float32)
    if LOCAL:   # in this order, so that each C x C and C x d_k tile dies before the next is formed
        dp = dp * scale
        wm = dp * p
        if STATE:   # each step's gradient from the segments s < r <= t that hold it: sum_{t>=r, s<r} W_ts, not
            # the reverse cumulative sum of rowsum(W) - colsum(W), which cancels O(1) terms to leave a strong
            # step's e^{-20}-sized gradient
            dgs += tl.sum(tl.where(later, tl.cumsum(wm, 0, reverse=True), 0.0), axis=1)
        else:       # GKA's split launches: d/dG_t, to which the solve's backward adds its own
            dG += tl.sum(wm, axis=1) - tl.sum(wm, axis=0)
        ds = dp * segment_decay_mask(g, offs_c)
        q = tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_k, DK)
        dqi = dqi * (scale * tl.exp(Gc))[:, None]
        dG += tl.sum(q * dqi, axis=1)
        store_tokens(DQ, mm_rows(ds, kop, kop, kop, OP, P, 1) + dqi, b, h, offs_t, TQ, sqob, sqot, sqoh, offs_k, DK)
        dk += mm_tn(ds, q, OP, P)
    if STATE:
        if KK:   # H's rows (a = k): dk_s += w_s (D + D^T) k_s, and k_s^T D k_s = k_s^T (D + D^T) k_s / 2
            rows = tl.arange(0, BK)
            dsh = state_tile(DS, bh, c, n, R, DK, rows, mk, offs_k, mk)
            gc += tl.where(offs_c == 0, tl.sum(tl.sum(dsh * state_tile(STARTS, bh, c, n, R, DK, rows, mk, offs_k, mk),
                                                      axis=1), axis=0), 0.0)
            h1, h2, h3, hs = state_pieces(dsh + tl.trans(dsh), OP, P)
            kd = mm(kop, h1, h2, h3, OP, 1, P) * hs
            dk += w[:, None] * kd
            st += 0.5 * tl.sum(kd * kop.to(tl.float32), axis=1)
        wst = w * st
        if LOCAL:   # the state's term from s reaches each step s < r < C (summed so, not as a difference)
            dgs += tl.sum(tl.where(later, wst[None, :], 0.0), axis=1) + tl.exp(gl) * tl.sum(gc, axis=0)
        else:
            dG += tl.where(offs_c == C - 1, tl.exp(gl) * tl.sum(gc, axis=0) + tl.sum(wst, axis=0), 0.0) - wst
            dk += tl.load(DKP + (bh * Tp + offs_t)[:, None] * DK + offs_k[None, :], mask=mk[None, :], other=0.0)
            dG += tl.load(DGP + bh * Tp + offs_t)
        dg = tl.cumsum(dG, 0, reverse=True) + dgs
        store_tokens(DKO, dk, b, h, offs_t, T, skob, skot, skoh, offs_k, DK)
        tl.store(DGO + b * sgob + h * sgoh + offs_t.to(tl.int64) * sgot, dg.to(DGO.dtype.element_ty),
                 mask=offs_t < T)
    else:
        tl.store(DKP + (bh * Tp + offs_t)[:, None] * DK + offs_k[None, :], dk, mask=mk[None, :])
        tl.store(DGP + bh * Tp + offs_t, dG)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def operand_code(*tensors) -> int:
    """The product operand dtype: 16-bit when every input is that same 16-bit dtype (then exact in it), else fp32."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return OPERAND_CODES.get(str(next(iter(dtypes))).removeprefix("torch."), 0)
    return 0


def block(d: int) -> int:
    """The padded head dimension of a tile (a power of two, at least 16 for ``tl.dot``)."""
    return max(16, pow2(d))


def tok_strides(t: torch.Tensor) -> tuple:
    """``(batch, time, head)`` strides of a ``(B, T, H, ...)`` token tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def state_config(DK: int, rows: int, P: int = 1):
    """``(BK, BR, warps)`` of the state passes: a program keeps ``BR x d_k`` fp32 state rows in registers next
    to a chunk's ``C x d_k`` operand (in ``P`` pieces)."""
    BK = block(DK)
    BR = min(block(rows), 64 if BK <= 64 else 32)
    return BK, BR, 4 if BK * BR * P <= 64 * 64 else 8


def output_config(DK: int, DV: int, fp32_operands: bool = False):
    """``(BK, BV, warps)`` of the output kernel (a value block per program, the whole ``d_k``). fp32 operands
    (exact fp32 products, not on tensor cores) hold whole operand slices per thread: at ``d_k`` 64 a value block
    of 64 on 4 warps spills 19 KB per thread, one of 32 on 8 warps none."""
    BK = block(DK)
    if fp32_operands and BK <= 64:
        return BK, min(block(DV), 32), 8
    return BK, min(block(DV), 64), 4 if BK <= 64 else 8


def chunk_bwd_config(DK: int, DV: int, fp32_operands: bool):
    """``(BK, BV, warps)`` of the chunk backward (the whole ``d_k``, value blocks in a loop). fp32 operands
    take twice the shared memory of 16-bit ones: at ``d_k`` 64 a value block of 64 needs 176 KB, above an
    A100's 163 KB, so they take blocks of 32."""
    BK = block(DK)
    widest = 16 if BK > 64 else 32 if fp32_operands else 64
    return BK, min(block(DV), widest), 4 if BK <= 32 else 8


def state_pass(k, v, g, initial, C: int, KK: bool, op: int, P: int):
    """``(starts (B, H, n, R, d_k), final (B, H, R, d_k))``, fp32, ``R = [d_k +] d_v``."""
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    n = cdiv(T, C)
    R = DV + (DK if KK else 0)
    starts = torch.empty(B, H, n, R, DK, device=k.device, dtype=torch.float32)
    fin = torch.empty(B, H, R, DK, device=k.device, dtype=torch.float32)
    BK, BR, warps = state_config(DK, min(DK, DV) if KK else DV, P)
    blocks = cdiv(DV, BR) + (cdiv(DK, BR) if KK else 0)
    launch(_state_fwd, (blocks, B * H), k, v, g, fin if initial is None else initial, starts, fin, T, H, n, DK, DV,
           *tok_strides(k), *tok_strides(v), *tok_strides(g), C=C, BK=BK, BR=BR, KK=KK,
           HAS_INIT=initial is not None, OP=op, P=P, num_warps=warps)
    return starts, fin


def output(q, k, v, g, starts, scale: float, C: int, op: int, QP: int, P: int, dtype):
    """``o (B, T, H, d_v)`` in ``dtype`` from the chunk-start states (their ``U`` rows are the last ``d_v``)."""
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    n, R = starts.shape[2], starts.shape[3]
    o = torch.empty(B, T, H, DV, device=k.device, dtype=dtype)
    BK, BV, warps = output_config(DK, DV, fp32_operands=op == 0)
    launch(_output_fwd, (n, B * H, cdiv(DV, BV)), q, k, v, g, starts, o, float(scale), T, H, n, DK, DV, R,
           R - DV, *tok_strides(q), *tok_strides(k), *tok_strides(v), *tok_strides(g), *tok_strides(o),
           C=C, BK=BK, BV=BV, OP=op, QP=QP, P=P, num_warps=warps)
    return o


def state_grads(q, do, g, E, dfin, has_init: bool, scale: float, C: int, R: int, DK: int, op: int, P: int):
    """``(D (B, H, n, R, d_k): dL/dS_{c+1} for every chunk, dL/dS_0 or None)``, fp32."""
    B, T, H, DV = do.shape
    n = cdiv(T, C)
    KK = R > DV
    ds = torch.empty(B, H, n, R, DK, device=do.device, dtype=torch.float32)
    ds0 = torch.empty(B, H, R, DK, device=do.device, dtype=torch.float32) if has_init else None
    BK, BR, warps = state_config(DK, min(DK, DV) if KK else DV, P)
    blocks = cdiv(DV, BR) + (cdiv(DK, BR) if KK else 0)
    launch(_state_bwd, (blocks, B * H), q, do, g, ds if E is None else E, ds if dfin is None else dfin, ds,
           ds if ds0 is None else ds0, float(scale), T, H, n, DK, DV, *tok_strides(q), *tok_strides(do),
           *tok_strides(g), C=C, BK=BK, BR=BR, KK=KK, HAS_E=E is not None, HAS_DFIN=dfin is not None,
           HAS_INIT=has_init, OP=op, P=P, num_warps=warps)
    return ds, ds0


def chunk_grads(q, k, v, g, do, starts, ds, dq, outs, partials, scale: float, C: int, local: bool, state: bool,
                op: int, QP: int, P: int, dq_len: int | None = None):
    """Run ``_chunk_bwd``: ``outs = (dk, dv, dg)`` final tensors (with ``state``), ``partials = (dkp, dvp, dgp)``
    fp32 ``(B*H, n*C, .)`` buffers; ``dq`` receives the readout's query gradient (with ``local``)."""
    B, T, H, DK = k.shape
    DV = v.shape[-1]
    n, R = starts.shape[2], starts.shape[3]
    KK = R > DV
    BK, BV, warps = chunk_bwd_config(DK, DV, fp32_operands=op == 0)
    dk, dv, dg = outs
    dkp, dvp, dgp = partials
    launch(_chunk_bwd, (n, B * H), q, k, v, g, do, starts, ds, dq, dk, dv, dg, dkp, dvp, dgp, float(scale), T,
           T if dq_len is None else dq_len, H,
           n, DK, DV, R, R - DV, *tok_strides(q), *tok_strides(k), *tok_strides(v), *tok_strides(g),
           *tok_strides(do), *tok_strides(dq), *tok_strides(dk), *tok_strides(dv), *tok_strides(dg),
           C=C, BK=BK, BV=BV, KK=KK, LOCAL=local, STATE=state, OP=op, QP=QP, P=P, num_warps=warps)


class _GLATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial, scale, C):
        ctx.set_materialize_grads(False)
        op = operand_code(q, k, v)
        starts, fin = state_pass(k, v, g, initial, C, False, op, GLA_PIECES)
        o = output(q, k, v, g, starts, scale, C, op, 1, GLA_PIECES, q.dtype)
        ctx.save_for_backward(q, k, v, g, starts)
        ctx.meta = (scale, C, op, None if initial is None else initial.dtype)
        return o, fin

    @staticmethod
    def backward(ctx, do, dfin):
        q, k, v, g, starts = ctx.saved_tensors
        scale, C, op, init_dtype = ctx.meta
        if do is None:
            do = torch.zeros(*v.shape, device=v.device, dtype=v.dtype)
        do = unit_last(do)
        dfin = None if dfin is None else dfin.contiguous()
        ds, ds0 = state_grads(q, do, g, None, dfin, init_dtype is not None, scale, C, v.shape[-1], k.shape[-1],
                              op, GLA_PIECES)
        dq, dk, dv = empty_grad(q), empty_grad(k), empty_grad(v)     # in place where they were cut from a tensor
        dg = torch.empty(g.shape, device=g.device, dtype=g.dtype)
        chunk_grads(q, k, v, g, do, starts, ds, dq, (dk, dv, dg), (ds, ds, ds), scale, C, True, True, op, 1,
                    GLA_PIECES)
        return dq, dk, dv, dg, None if ds0 is None else ds0.to(init_dtype), None, None


def gla_triton(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None):
    """Same contract as :func:`kernels.gla.chunked.gla_chunked` (``q, k`` may have one head shared by all)."""
    if q.dtype == torch.float64:
        raise TypeError("gla triton backend: fp64 is not supported by the Triton kernels; use backend='torch'")
    check_chunk(chunk_size, "gla")
    B, T, H, DV = v.shape
    if T == 0:     # nothing to launch
        from .chunked import gla_chunked
        return gla_chunked(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[2] != H:      # one query/key head shared by every value head: read with a zero head stride
        q, k = q.expand(B, T, H, q.shape[-1]), k.expand(B, T, H, k.shape[-1])
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    init = None if initial_state is None else initial_state.contiguous()
    o, fin = _GLATriton.apply(q, k, v, g, init, scale, chunk_size)
    return o, as_state(fin, q)     # the fp32 state the kernel accumulated


def check_chunk(C: int, family: str):
    if C < 16 or C & (C - 1):
        raise ValueError(f"{family} triton backend: chunk_size must be a power of two >= 16, got {C}")
