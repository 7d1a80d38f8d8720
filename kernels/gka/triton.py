"""GKA's ``triton`` backend: the whole layer core in a fixed number of Triton launches, forward and backward.

Per chunk of ``C`` tokens (``G_t`` the inclusive cumulative log decay from the chunk start, ``M_ts = e^{G_t -
G_s}`` for ``s <= t``, ``H_0, U_0`` the states the chunk starts from), as in :mod:`kernels.gka.chunked`:

    n2_t = ||H_t||_F^2 (closed form),   lam_t = a sqrt(n2_t) + eps,   bounds [lam_t, lam_t + sqrt(n2_t)]
    A_t xi = e^{G_t} H_0 xi + sum_{s<=t} M_ts (k_s . xi) k_s + lam_t xi,   x_t ~= A_t^{-1} q_t (r Chebyshev steps)
    q~_t = q_t + alpha_t (x_t - q_t),   o_t = scale (e^{G_t} U_0 q~_t + sum_{s<=t} M_ts (k_s . q~_t) v_s)

Forward, four launches: the state pass of ``(H, U)`` (one state of ``d_k + d_v`` rows sharing the decay) and the
readout are the gated-linear-recurrence stages of :mod:`kernels.gla.triton`; between them ``_norm_fwd`` (``n2`` of
every token from ``H_0``, the keys and the decays) and ``_solve_kernel`` (the ridge and bounds from ``n2``, ``r``
iterations, and the alpha-connection ``q~`` in its epilogue). Backward, six: the readout's own gradients
(``_chunk_bwd`` with ``LOCAL``), the solve's (``grad="implicit"``: ``_solve_kernel`` again on ``A z = alpha dq~``
(``A`` is symmetric), with ``dq = z + (1 - alpha) dq~``, ``dalpha = (x - q) . dq~`` and the backward's per-token
terms (``dn2_t`` and the ``t`` part of ``dG_t``) in its epilogue, then ``_vjp_kernel``; ``"reverse_chebyshev"``:
``_reverse_kernel``, the paper's Algorithm 2), ``_norm_bwd`` (the closed-form norm's gradients from ``dn2``), the
state pass backwards over ``(H, U)`` (``H``'s rows take the ``dL/dH_0`` of the solve and the norm, ``U``'s the
readout's) and the chunk's state gradients (``_chunk_bwd`` with ``STATE``, which also adds the fp32 partial
gradients of the steps before and sums ``dG`` into ``dg`` within the chunk). Every sum over tokens stays inside one
program (no atomics); the partial buffers are written by one kernel and read-added-written by the next, each element
owned by one program. Each stage keeps its reference: :func:`kernels.gka.chunked.chunk_states`, ``frob_norm_sq``,
:mod:`reference`'s ``ridge``/``mix_query``, :class:`kernels.gka.chebyshev.ChunkOp` with ``iterative_solve``, and
:func:`kernels.gla.chunked.gla_chunk_readout`.

The solve. Every token ``t`` of a chunk solves its own system. In row-vector form, for a tile of tokens
``Xi (BT x d)``::

    A Xi = e^{G} * (Xi H0^T) + ((Xi K^T) * M) K + lam * Xi

— three ``tl.dot`` products per iteration, shaped ``(BT x d) (d x d)``, ``(BT x d) (d x C)`` and ``(BT x C)
(C x d)``, every dimension >= 16 (tensor-core tiles). The systems of different tokens are independent, so a
program holds a tile of ``BT`` tokens x the whole head dimension and runs all ``r`` iterations in registers; the
grid is (chunks, heads, token tiles). The head dimension cannot be split across programs: every product of an
iteration mixes all of ``d``, and the iteration is sequential. The element-wise work of an iteration (the
Chebyshev step, the ``e^G`` and ``lam`` terms, the decay mask) is not a product. ``_vjp_kernel`` forms the
implicit backward's parameter gradients of ``<-z, A x>`` but the per-token ones, which the backward's solve
forms (their ``e^{G_t} u_t.H0 x_t`` needs ``H0``, 64 KB at d 128, which the solve's tile holds in pieces
already and a key tile would load and split again); its grid splits each chunk into key tiles (a program sums
``dK_s`` and the ``s`` part of ``dG`` over the tokens ``t >= s``) and row tiles of ``dH0``. ``_reverse_kernel``
walks the iteration backwards from ``xi_r, xi_{r-1}`` (one program per chunk; its weight schedule ``omega_i``
is computed forwards into a scratch buffer and read back in reverse, see :mod:`kernels.gka.chebyshev`).

Precision. fp32 inputs: every product is exact fp32 (``input_precision="ieee"``). bf16/fp16 inputs: every
product takes 16-bit operands (:mod:`kernels.pieces`) with fp32 accumulation; iterates, residuals, weights,
states and accumulators stay fp32, and an fp32 operand enters a product as ``PREC`` 16-bit pieces. The solve's
default is ``PREC = 2`` (:data:`SOLVE_PIECES`), 2.5x the tensor-core work of one piece, because GKA's readout
cancels: ``x`` is large (``~q / lam``) along the directions the keys do not span and ``U`` nearly annihilates
them, so an error of ``x`` relative to ``|x|`` reaches ``o = U x`` amplified up to ``~1 / a`` (``a`` =
ridge_a = 0.02). Measured against fp64 on GKA's solves (d 64-128, C 64, r 30, output error of the layer core):
one bf16 piece 1.2e-2..3.0e-2 (fp16: 1.2e-3..4.1e-3), two pieces of every operand 1.8e-5..4.7e-5 (fp16:
1.1e-6..1.3e-6); two pieces in the key products only, 3.4e-3..5.1e-3. For the same reason the state pass, the
norm and the readout take two pieces too (:data:`STAGE_PIECES`: ``q~``, the states and every decay-weighted
operand). Through the whole op with fp16 inputs (T 128, d 32 and 64, C 64, unit queries, keys of norm 0.2-1),
one fp16 piece in the solve leaves 5.3e-3..5.5e-3 in the output and up to 9e-3 in the gradients, twenty-five
times the 2.0e-4..2.3e-4 of two pieces (the outputs' own fp16 rounding); ``scripts/gpu_ska_gka_check.py
--solve-only`` measures the choices (bf16, one piece of bf16 or of fp16) and their times on a GPU: on an H200
(d 128, C 64, bf16, T 16384) one piece runs the solve in 0.90 ms where two take 2.30, but leaves up to 4.7e-2
(bf16) or 7.9e-2 (fp16) in the output and gradients through the whole op (T 2048) where two leave 1.7e-3, the
outputs' own bf16 rounding: two pieces stay the default.
``grad="reverse_chebyshev"`` reconstructs ``xi_{i-2}`` from ``xi_{i-1}, xi_i`` by running the
recurrence backwards, which amplifies any difference between the forward's products and the reconstruction's
by ~1e4-1e6 at r = 30 (measured dK error against fp64 with one bf16 piece 0.16-0.52, fp16 2e-2..4e-2, fp32
products 2.5e-4..5.3e-4; d 32 and 64, C 64): that mode's forward solve and its reconstruction take ``PREC = 3``
(fp32's products on tensor cores); its adjoint recursion and gradient products take the solve's ``PREC``.

fp16 range: a 16-bit operand must stay below 65504. The solve iterates on ``y_t = xi_t / (s_t max|q_t|)``
(``s_t = 2 / (L_t + mu_t)``; the iteration is linear per row, so rows may be scaled), and divides ``H0`` by a
power of two near its largest entry; the other kernels scale the rows (products over ``d``) or columns
(products over tokens) of an operand by a power of two near its largest magnitude. bf16 has fp32's range.

``chunk_size`` must be a power of two >= 16 (``tl.dot`` block sizes). :func:`chunk_solve_heads_first` is the
solve stage alone on heads-first tensors (its tests compare it with ``iterative_solve``).

Decays within a chunk are ``exp(G_t - G_s)`` of cumulative sums (:func:`decay_mask`). Measured
in fp32 against fp64 (interpreter, T 128, chunk 64, d 16): with log decays of -20..-40 among -0.05..0 in one
chunk the output and gradients are 7e-6..3e-5 off and a strong step's gate gradient 3e2 times its size; at
-40..-60 the gate gradient is lost (relative error ~1). The chunked PyTorch path sums each segment instead
(:func:`kernels.common.segment_log_decays`), in its solve too: 1e-7..4e-6, the solves' own rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_state, cdiv, unit_last
from ..gla import triton as stages
from ..gla.triton import chunk_gates, state_tile, store_tokens, tok_strides, tokens
from ..grad_slots import empty_grad
from ..launch import launch
from ..pieces import mm, mm_rows, mm_tn, operand, pieces, pow2_scale
from .chebyshev import _REVERSE_MIN_MOMENTUM
from .reference import NORM_FLOOR

#: 16-bit pieces per fp32 operand in the solve's products for bf16/fp16 inputs (see the module docstring)
SOLVE_PIECES = 2
#: pieces of the reverse-Chebyshev reconstruction's products (and of that mode's forward): fp32's products
EXACT_PIECES = 3
#: the reversal's settling threshold: its reconstructed iterates are fp32
_SETTLE_EPS = torch.finfo(torch.float32).eps
#: pieces of the computed operands of the state pass, the norm and the readout (``q~``, states, weighted tiles)
STAGE_PIECES = 2

_FLOOR = tl.constexpr(NORM_FLOOR)


# --------------------------------------------------------------------------------------------------
# shared pieces of the kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_h0(STARTS, bh, c, n, R, D, BD: tl.constexpr, OP: tl.constexpr):
    """``H0`` (the first ``D`` rows of the chunk-start state) divided by a power of two ``hs`` near its largest
    entry (16-bit operands; else ``hs = 1``)."""
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    h0 = state_tile(STARTS, bh, c, n, R, D, offs_d, md, offs_d, md)
    if OP == 0:
        hs = 1.0
    else:
        hs = pow2_scale(tl.max(tl.max(tl.abs(h0), axis=1), axis=0))
        h0 = h0 / hs
    return h0, hs


@triton.jit
def _bounds(N2, bh, Tp, offs_t, ridge_a, ridge_eps):
    """``(lam, mu, L, nrm)`` of tokens ``offs_t`` from ``n2 = ||H_t||_F^2`` (:func:`kernels.gka.reference.ridge`)."""
    n2 = tl.load(N2 + bh * Tp + offs_t)
    nrm = tl.sqrt(tl.maximum(n2, _FLOOR))
    lam = ridge_a * nrm + ridge_eps
    return lam, lam, lam + nrm, nrm


@triton.jit
def _apply(y, h1, h2, h3, kt, k, eGh, M, lam, OP: tl.constexpr, P: tl.constexpr):
    """``A y`` for a token tile, ``H0^T`` as pieces ``h1..h3``; returns ``(A y, y K^T)``. The keys are inputs
    (one exact piece): the key products split only the iterate side."""
    yh = mm(y, h1, h2, h3, OP, P, P)
    yk = mm(y, kt, kt, kt, OP, P, 1)
    ay = eGh[:, None] * yh + mm(yk * M, k, k, k, OP, P, 1) + lam[:, None] * y
    return ay, yk


@triton.jit
def _vec(ptr, bh, Tp, offs_t, offs_d, D):
    """Rows ``offs_t`` of an fp32 ``(B*H, Tp, D)`` buffer."""
    return tl.load(ptr + (bh * Tp + offs_t)[:, None] * D + offs_d[None, :], mask=(offs_d < D)[None, :], other=0.0)


@triton.jit
def decay_mask(Gt, Gs, offs_t, offs_s):
    """``M_ts = e^{G_t - G_s}`` for ``s <= t``, else 0."""
    causal = offs_t[:, None] >= offs_s[None, :]
    return tl.exp(tl.where(causal, Gt[:, None] - Gs[None, :], float("-inf")))


@triton.jit
def _put(ptr, x, bh, Tp, offs_t, offs_d, D):
    tl.store(ptr + (bh * Tp + offs_t)[:, None] * D + offs_d[None, :], x, mask=(offs_d < D)[None, :])


@triton.jit
def _gate(ALPHA, b, h, offs_t, T, sab, sat, sah):
    """``alpha`` of tokens ``offs_t`` (0 past ``T``)."""
    return tl.load(ALPHA + b * sab + h * sah + offs_t.to(tl.int64) * sat, mask=offs_t < T, other=0.0).to(tl.float32)


@triton.jit
def _dn2(dlam, N2, bh, Tp, offs_t, ridge_a):
    """``dL/dn2`` from ``dL/dlam``: ``lam = a sqrt(max(n2, floor)) + eps``."""
    n2 = tl.load(N2 + bh * Tp + offs_t)
    nrm = tl.sqrt(tl.maximum(n2, _FLOOR))
    return tl.where(n2 >= _FLOOR, dlam * ridge_a * 0.5 / nrm, 0.0)


# --------------------------------------------------------------------------------------------------
# ||H_t||_F^2, forward and backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _norm_terms(K, G, STARTS, b, h, bh, c, T, n, D, R, skb, skt, skh, sgb, sgt, sgh,
                C: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr, P: tl.constexpr, CUM: tl.constexpr):
    """The pieces of the closed-form norm of one chunk (:func:`kernels.gka.chunked.frob_norm_sq`)."""
    offs_c = tl.arange(0, C)
    offs_t = c * C + offs_c
    offs_d = tl.arange(0, BD)
    Gc, _gl = chunk_gates(G, b, h, offs_t, T, sgb, sgt, sgh, C, CUM)
    eG = tl.exp(Gc)
    M = decay_mask(Gc, Gc, offs_c, offs_c)
    kop = operand(tokens(K, b, h, offs_t, T, skb, skt, skh, offs_d, D), OP)
    h0, hs = _load_h0(STARTS, bh, c, n, R, D, BD, OP)
    h0n = tl.sum(tl.sum(h0 * h0, axis=1), axis=0) * hs * hs
    h1, h2, h3 = pieces(tl.trans(h0), OP, P)
    kh = mm(kop, h1, h2, h3, OP, 1, P) * hs                        # rows H0 k_s
    khk = tl.sum(kh * kop.to(tl.float32), axis=1)                   # k_s^T H0 k_s
    kt = tl.trans(kop)
    kk = mm(kop, kt, kt, kt, OP, 1, 1)                              # k_s . k_u
    qm = kk * kk
    mq = M * qm
    diag = tl.sum(tl.where(offs_c[:, None] == offs_c[None, :], qm, 0.0), axis=1)
    cs = 2.0 * (eG * khk + tl.sum(mq, axis=1)) - diag
    n2 = eG * eG * h0n + tl.sum(M * M * cs[None, :], axis=1)
    return offs_c, offs_t, eG, M, kop, kh, khk, kk, mq, cs, n2


@triton.jit
def _norm_fwd(K, G, STARTS, N2, T, H, n, D, R, skb, skt, skh, sgb, sgt, sgh,
              C: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr, P: tl.constexpr, CUM: tl.constexpr):
    """``n2_t = ||H_t||_F^2`` of every token of one chunk, ``O(C^2 + C d^2)``."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_c, offs_t, eG, M, kop, kh, khk, kk, mq, cs, n2 = _norm_terms(
        K, G, STARTS, b, h, bh, c, T, n, D, R, skb, skt, skh, sgb, sgt, sgh, C, BD, OP, P, CUM)
    tl.store(N2 + bh * (n * C) + offs_t, n2)


@triton.jit
def _norm_bwd(K, G, STARTS, DN2, E, DKP, DGP, T, H, n, D, R, skb, skt, skh, sgb, sgt, sgh,
              C: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr, OP: tl.constexpr, P: tl.constexpr,
              CUM: tl.constexpr, ACC: tl.constexpr):
    """Gradients of the chunk's ``n2`` (given ``dn2``) w.r.t. ``H0``, the keys and ``G``, added to ``E``, ``DKP``
    and ``DGP`` (``ACC``; else written). With ``c_s = 2 e^{G_s} k_s^T H0 k_s + 2 sum_{u<=s} M_su (k_s.k_u)^2 -
    |k_s|^4`` and ``n2_t = e^{2G_t} |H0|^2 + sum_{s<=t} M_ts^2 c_s``: ``dc_s = sum_{t>=s} M_ts^2 dn2_t``."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Tp = n * C
    offs_c, offs_t, eG, M, kop, kh, khk, kk, mq, cs, n2 = _norm_terms(
        K, G, STARTS, b, h, bh, c, T, n, D, R, skb, skt, skh, sgb, sgt, sgh, C, BD, OP, P, CUM)
    dn2 = tl.load(DN2 + bh * Tp + offs_t)
    dh0 = tl.sum(eG * eG * dn2, axis=0)
    dc = tl.sum(M * M * dn2[:, None], axis=0)
    dkhk = 2.0 * eG * dc
    dG = 2.0 * dn2 * n2 - 2.0 * cs * dc + dkhk * khk + 2.0 * dc * tl.sum(mq, axis=1) \
        - 2.0 * tl.sum(dc[:, None] * mq, axis=0)
    eye = offs_c[:, None] == offs_c[None, :]
    bm = (2.0 * dc[:, None] * M - tl.where(eye, dc[:, None], 0.0)) * 2.0 * kk
    dk = mm_rows(bm, kop, kop, kop, OP, P, 1) + mm_rows(tl.trans(bm), kop, kop, kop, OP, P, 1) \
        + 2.0 * dkhk[:, None] * kh
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    for rb in range(tl.cdiv(D, RB)):   # dH0 rows: 2 dh0 H0 + K^T diag(dkhk) K
        offs_r = rb * RB + tl.arange(0, RB)
        mr = offs_r < D
        kw_r = tl.trans(tokens(K, b, h, offs_t, T, skb, skt, skh, offs_r, D) * dkhk[:, None])
        e_off = ((bh * n + c) * D + offs_r)[:, None] * D + offs_d[None, :]
        upd = mm_rows(kw_r, kop, kop, kop, OP, P, 1) + 2.0 * dh0 * state_tile(STARTS, bh, c, n, R, D, offs_r, mr,
                                                                             offs_d, md)
        if ACC:
            upd += tl.load(E + e_off, mask=mr[:, None] & md[None, :], other=0.0)
        tl.store(E + e_off, upd, mask=mr[:, None] & md[None, :])
    if ACC:
        dk += _vec(DKP, bh, Tp, offs_t, offs_d, D)
        dG += tl.load(DGP + bh * Tp + offs_t)
    _put(DKP, dk, bh, Tp, offs_t, offs_d, D)
    tl.store(DGP + bh * Tp + offs_t, dG)


# --------------------------------------------------------------------------------------------------
# the solve (forward, and the implicit backward's A z = dx)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _solve_kernel(RHS, ALPHA, Q, K, G, STARTS, N2, X, XP, QT, XF, DQ, DA, DN2, DGP, ridge_a, ridge_eps, T, TR, H, n,
                  D, R, srb, srt, srh, sab, sat, sah, sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sdb, sdt, sdh,
                  sdab, sdat, sdah,
                  RITER: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                  P: tl.constexpr, CUM: tl.constexpr, STORE_PREV: tl.constexpr, MIX: tl.constexpr,
                  HAS_ALPHA: tl.constexpr, VJP: tl.constexpr, ACC_G: tl.constexpr):
    """``r`` Chebyshev iterations for one tile of ``BT`` tokens of one chunk. ``MIX`` 0: solve ``A x = rhs``
    into ``X``; 1 (forward): also ``q~ = q + alpha (x - q)`` into ``QT`` (``rhs`` is ``q``); 2 (backward,
    ``rhs = dq~``): solve ``A z = alpha dq~`` into ``X``, ``dq = z + (1 - alpha) dq~`` into ``DQ`` and
    ``dalpha = (x - q) . dq~`` into ``DA`` (``x`` from ``XF``). ``VJP`` (the implicit backward's solve, ``XF``
    the forward's ``x``): also the per-token terms of that backward (:func:`_vjp_tokens`)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Tp = n * C
    offs_s = tl.arange(0, C)
    offs_t = c * C + tl.program_id(2) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    k = tokens(K, b, h, c * C + offs_s, T, skb, skt, skh, offs_d, D)
    kt = operand(tl.trans(k), OP)
    k = operand(k, OP)
    h0, hs = _load_h0(STARTS, bh, c, n, R, D, BD, OP)
    h1, h2, h3 = pieces(tl.trans(h0), OP, P)
    Gs, _gl = chunk_gates(G, b, h, c * C + offs_s, T, sgb, sgt, sgh, C, CUM)
    Gt = tl.sum(tl.where(offs_t[:, None] == (c * C + offs_s)[None, :], Gs[None, :], 0.0), axis=1)
    M = decay_mask(Gt, Gs, offs_t - c * C, offs_s)
    eGh = tl.exp(Gt) * hs
    lam, mu, L, _nrm = _bounds(N2, bh, Tp, offs_t, ridge_a, ridge_eps)
    rhs = tokens(RHS, b, h, offs_t, TR, srb, srt, srh, offs_d, D)
    q = rhs
    if MIX == 2:
        if HAS_ALPHA:
            q = rhs * _gate(ALPHA, b, h, offs_t, T, sab, sat, sah)[:, None]
    s = 2.0 / (L + mu)
    rho = (L - mu) / (L + mu)
    rho2 = rho * rho
    if OP == 0:
        rs = tl.full([BT], 1.0, tl.float32)
    else:  # iterate on xi / (s max|q|): |y| stays near 1 (fp16's range)
        rs = s * tl.max(tl.abs(q), axis=1)
        rs = tl.where(rs > 0, rs, 1.0)
        q = q / rs[:, None]
    om = tl.full([BT], 2.0, tl.float32)
    y = s[:, None] * q
    dy = y  # y_0 - y_{-1}
    for _ in range(RITER):
        om = 4.0 / (4.0 - rho2 * om)
        ay, _yk = _apply(y, h1, h2, h3, kt, k, eGh, M, lam, OP, P)
        dy = (om - 1.0)[:, None] * dy + (s * om)[:, None] * (q - ay)
        y += dy
    x = y * rs[:, None]
    _put(X, x, bh, Tp, offs_t, offs_d, D)
    if VJP or MIX == 2:
        xf = _vec(XF, bh, Tp, offs_t, offs_d, D)
    if VJP:
        _vjp_tokens(x, xf, N2, DN2, DGP, h1, h2, h3, kt, M, eGh, bh, Tp, offs_t, ridge_a, OP, P, ACC_G)
    if STORE_PREV:
        _put(XP, (y - dy) * rs[:, None], bh, Tp, offs_t, offs_d, D)
    if MIX == 1:
        if HAS_ALPHA:
            a = _gate(ALPHA, b, h, offs_t, T, sab, sat, sah)
            _put(QT, rhs + a[:, None] * (x - rhs), bh, Tp, offs_t, offs_d, D)
    if MIX == 2:
        if HAS_ALPHA:
            a = _gate(ALPHA, b, h, offs_t, T, sab, sat, sah)
            qin = tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_d, D)
            tl.store(DA + b * sdab + h * sdah + offs_t.to(tl.int64) * sdat,
                     tl.sum((xf - qin) * rhs, axis=1).to(DA.dtype.element_ty), mask=offs_t < T)
            x += (1.0 - a)[:, None] * rhs
        store_tokens(DQ, x, b, h, offs_t, T, sdb, sdt, sdh, offs_d, D)


# --------------------------------------------------------------------------------------------------
# backward of the solve
# --------------------------------------------------------------------------------------------------
@triton.jit
def _vjp_tokens(z, x, N2, DN2, DGP, h1, h2, h3, kt, M, eGh, bh, Tp, offs_t, ridge_a, OP: tl.constexpr,
                P: tl.constexpr, ACC: tl.constexpr):
    """The per-token terms of the gradients of ``<u, A x>`` (``u = -z``, ``x`` the forward's solution), formed
    at the end of the backward's solve, whose tile already holds ``H0`` and the chunk's keys: ``dL/dn2_t``
    (through ``lam_t``) into ``DN2`` and the ``t`` part of ``dG_t``, ``e^{G_t} u_t.H0 x_t + sum_s M_ts
    (x_t.k_s)(u_t.k_s)``, into ``DGP`` (added where ``ACC``). ``eGh`` is ``e^{G_t}`` times the power of two
    ``H0``'s pieces were divided by."""
    u = -z
    xh = mm_rows(x, h1, h2, h3, OP, P, P)
    w = mm_rows(x, kt, kt, kt, OP, P, 1) * M * mm_rows(u, kt, kt, kt, OP, P, 1)
    dG = eGh * tl.sum(u * xh, axis=1) + tl.sum(w, axis=1)
    tl.store(DN2 + bh * Tp + offs_t, _dn2(tl.sum(u * x, axis=1), N2, bh, Tp, offs_t, ridge_a))
    if ACC:
        dG += tl.load(DGP + bh * Tp + offs_t)
    tl.store(DGP + bh * Tp + offs_t, dG)


@triton.jit
def _vjp_kernel(X, Z, K, G, E, DKP, DGP, T, H, n, D, skb, skt, skh, sgb, sgt, sgh,
                C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr, OP: tl.constexpr,
                P: tl.constexpr, CUM: tl.constexpr, ACC: tl.constexpr):
    """Gradients of ``<u, A x>`` (``u = -z``) w.r.t. ``H0`` and the keys, and the ``s`` part of ``dG_s``
    (``-sum_{t>=s} M_ts (x_t.k_s)(u_t.k_s)``); the per-token terms came with the solve (:func:`_vjp_tokens`).
    Program ``j < C / BT`` of a chunk owns keys ``j BT ..``; program ``C / BT + i`` owns rows ``i RB ..`` of
    ``dH0`` (into ``E``). ``dK`` is added to ``DKP`` (``ACC``; else written), ``dG`` always to ``DGP``."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Tp = n * C
    j = tl.program_id(2)
    NB: tl.constexpr = C // BT
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    offs_s = tl.arange(0, C)
    Gs, _gl = chunk_gates(G, b, h, c * C + offs_s, T, sgb, sgt, sgh, C, CUM)
    if j < NB:
        # own keys s: dK_s and the s part of dG, summed over the tokens t >= s
        offs_j = j * BT + tl.arange(0, BT)
        kj = tokens(K, b, h, c * C + offs_j, T, skb, skt, skh, offs_d, D)
        kjt = operand(tl.trans(kj), OP)
        Gjs = tl.sum(tl.where(offs_j[:, None] == offs_s[None, :], Gs[None, :], 0.0), axis=1)
        dG = tl.zeros([BT], dtype=tl.float32)
        dk = tl.zeros([BT, BD], dtype=tl.float32)
        for tb in range(j, NB):
            offs_tt = tb * BT + tl.arange(0, BT)
            Gtt = tl.sum(tl.where(offs_tt[:, None] == offs_s[None, :], Gs[None, :], 0.0), axis=1)
            Mt = decay_mask(Gtt, Gjs, offs_tt, offs_j)
            xt = _vec(X, bh, Tp, c * C + offs_tt, offs_d, D)
            ut = -_vec(Z, bh, Tp, c * C + offs_tt, offs_d, D)
            a = mm_rows(xt, kjt, kjt, kjt, OP, P, 1) * Mt            # M_ts (x_t . k_s)
            uk = mm_rows(ut, kjt, kjt, kjt, OP, P, 1)                # (u_t . k_s)
            dG -= tl.sum(a * uk, axis=0)
            dk += mm_tn(uk * Mt, xt, OP, P) + mm_tn(a, ut, OP, P)
        if ACC:
            dk += _vec(DKP, bh, Tp, c * C + offs_j, offs_d, D)
        tl.store(DGP + bh * Tp + c * C + offs_j, dG + tl.load(DGP + bh * Tp + c * C + offs_j))
        _put(DKP, dk, bh, Tp, c * C + offs_j, offs_d, D)
    else:
        # rows i of dH0 = sum_t e^{G_t} u_t[i] x_t^T
        offs_r = (j - NB) * RB + tl.arange(0, RB)
        mr = offs_r < D
        acc = tl.zeros([RB, BD], dtype=tl.float32)
        for tb in range(NB):
            offs_tt = tb * BT + tl.arange(0, BT)
            eGt = tl.exp(tl.sum(tl.where(offs_tt[:, None] == offs_s[None, :], Gs[None, :], 0.0), axis=1))
            ur = -tl.load(Z + (bh * Tp + c * C + offs_tt)[:, None] * D + offs_r[None, :], mask=mr[None, :], other=0.0)
            xt = _vec(X, bh, Tp, c * C + offs_tt, offs_d, D)
            acc += mm_tn(ur * eGt[:, None], xt, OP, P)
        tl.store(E + ((bh * n + c) * D + offs_r)[:, None] * D + offs_d[None, :], acc, mask=mr[:, None] & md[None, :])


@triton.jit
def _reverse_kernel(RHS, ALPHA, Q, K, G, STARTS, N2, X, XP, DQT, DQ, DA, E, DKP, DGP, DN2, OM,
                    ridge_a, ridge_eps, min_momentum, settle_eps, T, TR, H, n, D, R,
                    srb, srt, srh, sab, sat, sah, sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sdb, sdt, sdh,
                    sdab, sdat, sdah,
                    RITER: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                    P: tl.constexpr, PX: tl.constexpr, CUM: tl.constexpr, MIX: tl.constexpr,
                    HAS_ALPHA: tl.constexpr, ACC: tl.constexpr):
    """The paper's Algorithm 2 for one chunk: exact gradients of r Chebyshev iterations.

    ``RHS`` is the forward's right-hand side (``q``); ``DQT`` the upstream gradient (of ``x``; with ``MIX`` 2 of
    ``q~``: then ``dx = alpha dq~``, and ``dq`` and ``dalpha`` take the alpha-connection's terms as in
    :func:`_solve_kernel`). The reconstruction of the iterates takes its products in ``PX`` pieces (fp32's
    products); the adjoint recursion ``dxi_{i-1} = omega_i dxi_i - c_i A dxi_i - (omega_{i+1} - 1) dxi_{i+1}``
    and the gradient products in ``P`` pieces. ``OM_ptr``: scratch ``(R, C)`` per chunk for the weight
    schedule, written forwards and read backwards. A row stops reconstructing once its adjoint has fallen to
    ``settle_eps`` of its peak (:func:`kernels.gka.chebyshev.reverse_settled`)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Tp = n * C
    sys = bh * n + c
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k = tokens(K, b, h, c * C + offs_s, T, skb, skt, skh, offs_d, D)
    kt = operand(tl.trans(k), OP)
    k = operand(k, OP)
    h0, hs = _load_h0(STARTS, bh, c, n, R, D, BD, OP)
    h1, h2, h3 = pieces(tl.trans(h0), OP, PX)
    Gs, _gl = chunk_gates(G, b, h, c * C + offs_s, T, sgb, sgt, sgh, C, CUM)
    dh0 = tl.zeros([BD, BD], dtype=tl.float32)
    dk = tl.zeros([C, BD], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    for tb in range(C // BT):
        offs_l = tb * BT + tl.arange(0, BT)
        offs_t = c * C + offs_l
        Gt = tl.sum(tl.where(offs_l[:, None] == offs_s[None, :], Gs[None, :], 0.0), axis=1)
        M = decay_mask(Gt, Gs, offs_l, offs_s)
        eG = tl.exp(Gt)
        eGh = eG * hs
        q = tokens(RHS, b, h, offs_t, TR, srb, srt, srh, offs_d, D)
        lam, mu, L, _nrm = _bounds(N2, bh, Tp, offs_t, ridge_a, ridge_eps)
        s = 2.0 / (L + mu)
        rho = (L - mu) / (L + mu)
        rho2 = rho * rho
        xi_cur = _vec(X, bh, Tp, offs_t, offs_d, D)
        xi_prev = _vec(XP, bh, Tp, offs_t, offs_d, D)
        g_cur = _vec(DQT, bh, Tp, offs_t, offs_d, D)
        if MIX == 2:
            if HAS_ALPHA:
                g_cur = g_cur * _gate(ALPHA, b, h, offs_t, T, sab, sat, sah)[:, None]
        if OP == 0:
            rx = tl.full([BT], 1.0, tl.float32)
            rg = tl.full([BT], 1.0, tl.float32)
        else:  # both recursions are linear per row: run them on rows scaled near 1 (fp16's range)
            rx = s * tl.max(tl.abs(q), axis=1)
            rx = tl.where(rx > 0, rx, 1.0)
            q = q / rx[:, None]
            xi_cur = xi_cur / rx[:, None]
            xi_prev = xi_prev / rx[:, None]
            rg = tl.max(tl.abs(g_cur), axis=1)
            rg = tl.where(rg > 0, rg, 1.0)
            g_cur = g_cur / rg[:, None]
        # omega_1..omega_R forwards (the reversed recursion is unstable), read back in reverse order
        om = tl.full([BT], 2.0, tl.float32)
        for i in range(RITER):
            om = 4.0 / (4.0 - rho2 * om)
            tl.store(OM + (sys * RITER + i) * C + offs_l, om)
        tl.debug_barrier()
        g_next = tl.zeros([BT, BD], dtype=tl.float32)
        g_peak = tl.max(tl.abs(g_cur), axis=1)
        settled = tl.zeros([BT], dtype=tl.int32)
        om_next = tl.full([BT], 1.0, tl.float32)
        dq = tl.zeros([BT, BD], dtype=tl.float32)
        dG_rows = tl.zeros([BT], dtype=tl.float32)
        dlam = tl.zeros([BT], dtype=tl.float32)
        for it in range(RITER):
            i = RITER - it  # R, ..., 1
            om = tl.load(OM + (sys * RITER + i - 1) * C + offs_l)
            cw = s * om
            dq += cw[:, None] * g_cur
            # xi_{i-1}'s products in PX pieces: its matvec (the reconstruction) and dG's x H0^T, x K^T
            xh = mm(xi_prev, h1, h2, h3, OP, PX, PX)
            xk = mm(xi_prev, kt, kt, kt, OP, PX, 1)
            a = xk * M
            ax = eGh[:, None] * xh + mm(a, k, k, k, OP, PX, 1) + lam[:, None] * xi_prev
            # the adjoint A dxi_i in P pieces
            ag, gk = _apply(g_cur, h1, h2, h3, kt, k, eGh, M, lam, OP, P)
            # parameter gradients of <u, A xi_{i-1}>, u = -c_i dxi_i: u = -c g_cur rg, xi_{i-1} = xi_prev rx
            cu = -cw * rg
            w = a * gk
            dG_rows += (eGh * tl.sum(g_cur * xh, axis=1) + tl.sum(w, axis=1)) * cu * rx
            dG += tl.sum(w * (cu * rx)[:, None], axis=0) * -1.0
            dh0 += mm_tn(g_cur * (cu * eG)[:, None], xi_prev * rx[:, None], OP, P)
            dk += mm_tn(gk * (cu[:, None] * M), xi_prev * rx[:, None], OP, P) \
                + mm_tn(a * rx[:, None], g_cur * cu[:, None], OP, P)
            dlam += tl.sum(g_cur * xi_prev, axis=1) * cu * rx
            g_prev = om[:, None] * g_cur - cw[:, None] * ag - (om_next - 1.0)[:, None] * g_next
            # xi_{i-2} = (omega_i xi_{i-1} - c_i A xi_{i-1} + c_i q - xi_i) / (omega_i - 1)
            m = om - 1.0
            g_mag = tl.max(tl.abs(g_prev), axis=1)     # xi_{i-2} meets dxi_{i-1}
            g_peak = tl.maximum(g_peak, g_mag)
            settled = tl.where(g_mag <= settle_eps * g_peak, 1, settled)
            ok = (m > min_momentum) & (settled == 0)
            recon = (om[:, None] * xi_prev - cw[:, None] * ax + cw[:, None] * q - xi_cur) / tl.where(ok, m, 1.0)[:, None]
            xi_pp = tl.where(ok[:, None], recon, xi_prev)
            xi_pp = tl.where(i >= 2, xi_pp, 0.0)
            g_next = g_cur
            g_cur = g_prev
            xi_cur = xi_prev
            xi_prev = xi_pp
            om_next = om
        dq = (dq + s[:, None] * g_cur) * rg[:, None]
        if MIX == 2:
            if HAS_ALPHA:
                al = _gate(ALPHA, b, h, offs_t, T, sab, sat, sah)
                dqt = _vec(DQT, bh, Tp, offs_t, offs_d, D)      # read again: not held through the iterations
                qin = tokens(Q, b, h, offs_t, T, sqb, sqt, sqh, offs_d, D)
                xf = _vec(X, bh, Tp, offs_t, offs_d, D)
                tl.store(DA + b * sdab + h * sdah + offs_t.to(tl.int64) * sdat,
                         tl.sum((xf - qin) * dqt, axis=1).to(DA.dtype.element_ty), mask=offs_t < T)
                dq += (1.0 - al)[:, None] * dqt
            store_tokens(DQ, dq, b, h, offs_t, T, sdb, sdt, sdh, offs_d, D)
        else:
            _put(DQ, dq, bh, Tp, offs_t, offs_d, D)
        dG += tl.sum(tl.where(offs_l[:, None] == offs_s[None, :], dG_rows[:, None], 0.0), axis=0)
        tl.store(DN2 + bh * Tp + offs_t, _dn2(dlam, N2, bh, Tp, offs_t, ridge_a))
    tl.store(E + (sys * D + offs_d)[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    if ACC:
        dk += _vec(DKP, bh, Tp, c * C + offs_s, offs_d, D)
        dG += tl.load(DGP + bh * Tp + c * C + offs_s)
    _put(DKP, dk, bh, Tp, c * C + offs_s, offs_d, D)
    tl.store(DGP + bh * Tp + c * C + offs_s, dG)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _solve_config(C, BD, op=1):
    """``(tokens per program, warps)`` of the solve: a tile keeps its iterate, step, right-hand side and
    products (fp32, BT x BD each) in registers next to the loop-invariant operands. From ptxas for sm_90,
    bf16, C 64, two pieces: d 128 at 32 tokens and 8 warps 255 registers, no spills (64 tokens spilled
    832 bytes at 8 warps, 2 KB at 4); d 64 at 32 tokens and 4 warps 235 registers, no spills. fp32
    products run on the CUDA cores, whose operand layouts take more registers (d 64 at 4 warps spilled
    368 bytes): 8 warps."""
    if BD <= 64 and op != 0:
        return min(C, 32), 4
    return min(C, 32 if BD <= 128 else 16), 8


def _backward_config(C, BD, reverse=False):
    """``(token tile, warps)`` of the backward kernels. The reverse kernel holds dH0 and dK (fp32) next to
    its token tile: 8 warps (at 4 it spilled 1.6 KB for d 32 on sm_90). On sm_80 with 16-bit inputs it does
    not fit at any warp count (d 64, C 64: ptxas keeps 32 registers and spills 26-32 KB per thread, at 4, 8
    or 16 warps, with the loop-invariant operands reloaded every iteration too): there, where mma operands
    live in registers, the reconstruction's three-piece products need more than 255; sm_90's wgmma reads
    them from shared memory (16 B spilled). On an A100, ``grad="implicit"`` (the default) is the fast
    backward."""
    return min(C, 16), (8 if reverse or BD > 32 else 4)


def _pieces_for(op, exact=False):
    return 1 if op == 0 else (EXACT_PIECES if exact else SOLVE_PIECES)


def operand_code(dtype: torch.dtype) -> int:
    """The product operand dtype for inputs of ``dtype``: 16-bit inputs give 16-bit operands, else fp32."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


class _Layout:
    """Sizes and token strides shared by the launches of one call: ``n`` chunks of ``C``, ``Tp = n C``."""

    def __init__(self, k, C):
        self.B, self.T, self.H, self.D = k.shape
        self.C = C
        self.n = cdiv(self.T, C)
        self.Tp = self.n * C
        self.BD = stages.block(self.D)

    def buf(self, k, *tail):
        """An fp32 heads-first buffer ``(B*H, Tp, *tail)``."""
        return torch.empty(self.B * self.H, self.Tp, *tail, device=k.device, dtype=torch.float32)

    def view(self, buf):
        """A ``(B*H, Tp, D)`` buffer as a ``(B, Tp, H, D)`` token tensor (for the shared stages' loads)."""
        return buf.view(self.B, self.H, self.Tp, -1).transpose(1, 2)


def _norm_warps(BD: int, op: int) -> int:
    """Warps of the norm kernels. fp32 operands (``op`` 0: exact fp32 products, whose operand slices live in
    registers) take 16 at ``d >= 64``: spills per thread, forward / backward, fall from 5-17 / 10-29 KB on 8
    warps to 1.7-4 / 2.7-15 KB (sm_80 and sm_90, d 64 and 128); 16-bit operands spill nothing on 8."""
    return 4 if BD <= 32 else 16 if op == 0 else 8


def _norm(k, g, starts, lay, op, cum=True):
    n2 = lay.buf(k)
    launch(_norm_fwd, (lay.n, lay.B * lay.H), k, g, starts, n2, lay.T, lay.H, lay.n, lay.D, starts.shape[3],
           *tok_strides(k), *tok_strides(g), C=lay.C, BD=lay.BD, OP=op, P=STAGE_PIECES, CUM=cum,
           num_warps=_norm_warps(lay.BD, op))
    return n2


def _norm_grads(k, g, starts, dn2, E, dkp, dgp, lay, op, acc, cum=True):
    launch(_norm_bwd, (lay.n, lay.B * lay.H), k, g, starts, dn2, E, dkp, dgp, lay.T, lay.H, lay.n, lay.D,
           starts.shape[3], *tok_strides(k), *tok_strides(g), C=lay.C, BD=lay.BD, RB=min(lay.BD, 32), OP=op,
           P=STAGE_PIECES, CUM=cum, ACC=acc, num_warps=_norm_warps(lay.BD, op))


def _solve(rhs, rhs_len, alpha, q, k, g, starts, n2, lay, r, op, ridge, *, mix, store_prev=False, exact=False,
           xf=None, dq=None, dalpha=None, vjp=None, cum=True):
    """One launch of ``_solve_kernel``; returns ``(X, XP, QT)`` (fp32 heads-first buffers, XP/QT None if
    unused). ``vjp = (dn2, dgp, acc)``: the implicit backward's solve (``xf`` the forward's ``x``), which also
    writes ``dn2`` and adds (``acc``; else writes) the per-token part of ``dG`` into ``dgp``."""
    X = lay.buf(k, lay.D)
    XP = lay.buf(k, lay.D) if store_prev else None
    QT = lay.buf(k, lay.D) if mix == 1 and alpha is not None else None
    BT, warps = _solve_config(lay.C, lay.BD, op)
    dummy = X
    launch(_solve_kernel, (lay.n, lay.B * lay.H, lay.C // BT), rhs, dummy if alpha is None else alpha,
           dummy if q is None else q, k, g, starts, n2, X, dummy if XP is None else XP,
           dummy if QT is None else QT, dummy if xf is None else xf, dummy if dq is None else dq,
           dummy if dalpha is None else dalpha, *(vjp[:2] if vjp else (dummy, dummy)), float(ridge[0]),
           float(ridge[1]), lay.T, rhs_len, lay.H, lay.n,
           lay.D, starts.shape[3], *tok_strides(rhs), *_strides3(alpha), *_strides3(q), *tok_strides(k),
           *tok_strides(g), *_strides3(dq), *_strides3(dalpha), RITER=r, C=lay.C, BT=BT, BD=lay.BD, OP=op,
           P=_pieces_for(op, exact), CUM=cum, STORE_PREV=store_prev, MIX=mix, HAS_ALPHA=alpha is not None,
           VJP=vjp is not None, ACC_G=bool(vjp and vjp[2]), num_warps=warps)
    return X, XP, QT


def _strides3(t):
    return (0, 0, 0) if t is None else tok_strides(t)


def _vjp(X, Z, k, g, E, dkp, dgp, lay, op, acc, cum=True):
    BT, warps = _backward_config(lay.C, lay.BD)
    RB = min(lay.BD, 32)
    launch(_vjp_kernel, (lay.n, lay.B * lay.H, lay.C // BT + lay.BD // RB), X, Z, k, g, E, dkp, dgp, lay.T, lay.H,
           lay.n, lay.D, *tok_strides(k), *tok_strides(g), C=lay.C, BT=BT, BD=lay.BD, RB=RB, OP=op,
           P=_pieces_for(op), CUM=cum, ACC=acc, num_warps=warps)


def _reverse(rhs, rhs_len, alpha, q, k, g, starts, n2, X, XP, dqt, dq, dalpha, E, dkp, dgp, dn2, lay, r, op, ridge,
             mix, acc, cum=True):
    BT, warps = _backward_config(lay.C, lay.BD, reverse=True)
    OM = torch.empty(lay.B * lay.H * lay.n, r, lay.C, device=k.device, dtype=torch.float32)
    dummy = X
    launch(_reverse_kernel, (lay.n, lay.B * lay.H), rhs, dummy if alpha is None else alpha,
           dummy if q is None else q, k, g, starts, n2, X, XP, dqt, dq, dummy if dalpha is None else dalpha, E,
           dkp, dgp, dn2, OM, float(ridge[0]), float(ridge[1]), _REVERSE_MIN_MOMENTUM, _SETTLE_EPS, lay.T, rhs_len, lay.H,
           lay.n, lay.D, starts.shape[3], *tok_strides(rhs), *_strides3(alpha), *_strides3(q), *tok_strides(k),
           *tok_strides(g), *_strides3(dq if mix == 2 else None), *_strides3(dalpha), RITER=r, C=lay.C, BT=BT,
           BD=lay.BD, OP=op, P=_pieces_for(op), PX=_pieces_for(op, exact=True), CUM=cum, MIX=mix,
           HAS_ALPHA=alpha is not None, ACC=acc, num_warps=warps)


class _GKATriton(torch.autograd.Function):
    """The GKA core ``(q, k, v, g, alpha, H_init, U_init) -> (o, final (H; U) state)`` in the launches of the
    module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, g, alpha, init, r, grad, ridge, scale, C):
        ctx.set_materialize_grads(False)
        lay = _Layout(k, C)
        op = stages.operand_code(q, k, v)
        P = STAGE_PIECES
        starts, fin = stages.state_pass(k, v, g, init, C, True, op, P)
        saved = [q, k, v, g, alpha, starts]
        if r == 0:
            query, qp = q, 1
        else:
            n2 = _norm(k, g, starts, lay, op)
            reverse = grad == "reverse_chebyshev"
            X, XP, QT = _solve(q, lay.T, alpha, None, k, g, starts, n2, lay, r, op, ridge, mix=1,
                               store_prev=reverse, exact=reverse)
            query, qp = lay.view(X if QT is None else QT), P
            saved += [n2, X, XP if reverse else X, query]
        o = stages.output(query, k, v, g, starts, scale, C, op, qp, P, q.dtype)
        ctx.save_for_backward(*saved)
        ctx.meta = (r, grad, ridge, scale, C, op, None if init is None else init.dtype)
        return o, fin

    @staticmethod
    def backward(ctx, do, dfin):
        q, k, v, g, alpha, starts, *rest = ctx.saved_tensors
        r, grad, ridge, scale, C, op, init_dtype = ctx.meta
        lay = _Layout(k, C)
        P = STAGE_PIECES
        DK, DV = k.shape[-1], v.shape[-1]
        R = DK + DV
        if do is None:
            do = torch.zeros(*v.shape, device=v.device, dtype=v.dtype)
        do = unit_last(do)
        dfin = None if dfin is None else dfin.contiguous()
        dq, dk, dv = empty_grad(q), empty_grad(k), empty_grad(v)     # in place where they were cut from a tensor
        dg = torch.empty(g.shape, device=g.device, dtype=g.dtype)
        if r == 0:   # gated linear attention with the key covariance carried along: one chunk backward
            ds, ds0 = stages.state_grads(q, do, g, None, dfin, init_dtype is not None, scale, C, R, DK, op, P)
            stages.chunk_grads(q, k, v, g, do, starts, ds, dq, (dk, dv, dg), (ds, ds, ds), scale, C, True, True,
                               op, 1, P)
            return dq, dk, dv, dg, None, _cast(ds0, init_dtype), None, None, None, None, None
        n2, X, XP, query = rest
        dalpha = None if alpha is None else torch.empty_like(alpha)
        # fp32 partial gradients: the readout's, then the solve's and the norm's added in place
        dqt, dkp, dvp, dgp, dn2 = lay.buf(k, DK), lay.buf(k, DK), lay.buf(k, DV), lay.buf(k), lay.buf(k)
        E = torch.empty(lay.B, lay.H, lay.n, DK, DK, device=k.device, dtype=torch.float32)   # dL/dH_0 per chunk
        stages.chunk_grads(query, k, v, g, do, starts, starts, lay.view(dqt), (dk, dv, dg), (dkp, dvp, dgp), scale,
                           C, True, False, op, P, P, dq_len=lay.Tp)
        if grad == "reverse_chebyshev":
            _reverse(q, lay.T, alpha, q, k, g, starts, n2, X, XP, dqt, dq, dalpha, E, dkp, dgp, dn2, lay, r, op,
                     ridge, mix=2, acc=True)
        else:
            Z, _, _ = _solve(lay.view(dqt), lay.Tp, alpha, q, k, g, starts, n2, lay, r, op, ridge, mix=2, xf=X,
                             dq=dq, dalpha=dalpha, vjp=(dn2, dgp, True))
            _vjp(X, Z, k, g, E, dkp, dgp, lay, op, acc=True)
        _norm_grads(k, g, starts, dn2, E, dkp, dgp, lay, op, acc=True)
        ds, ds0 = stages.state_grads(query, do, g, E, dfin, init_dtype is not None, scale, C, R, DK, op, P)
        stages.chunk_grads(query, k, v, g, do, starts, ds, dq, (dk, dv, dg), (dkp, dvp, dgp), scale, C, False, True,
                           op, P, P)
        return dq, dk, dv, dg, dalpha, _cast(ds0, init_dtype), None, None, None, None, None


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def gka_triton(q, k, v, g, alpha=None, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6, num_iter: int = 30,
               solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None, chunk_size: int = 64,
               initial_state=None):
    """GKA in the Triton launches of the module docstring (same contract as :func:`gka_chunked`).

    The products take the width of the inputs (16-bit operands when ``q``, ``k`` and ``v`` share a 16-bit
    dtype: they are then exact in it; else exact fp32)."""
    if solver != "chebyshev" and num_iter > 0:
        raise ValueError(f"gka triton backend implements solver='chebyshev' only, not {solver!r}")
    _check(grad if num_iter > 0 else "implicit", chunk_size)
    if q.dtype == torch.float64:
        raise TypeError("gka triton backend: fp64 is not supported by the Triton kernels; use backend='torch'")
    if q.shape[1] == 0:     # nothing to launch
        from .chunked import gka_chunked
        return gka_chunked(q, k, v, g, alpha, ridge_a=ridge_a, ridge_eps=ridge_eps, num_iter=num_iter, solver=solver,
                           grad=grad, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    init = None if initial_state is None else torch.cat([s.float() for s in initial_state], dim=-2)
    o, fin = _GKATriton.apply(q, k, v, g, alpha, init, num_iter, grad, (ridge_a, ridge_eps), scale, chunk_size)
    H, U = fin.split([dk, v.shape[-1]], dim=-2)
    return o, as_state((H, U), q)     # the fp32 state the kernels accumulated


def _check(grad, C):
    if grad not in ("implicit", "reverse_chebyshev"):
        raise ValueError(f"gka triton backend: grad={grad!r} is not available in Triton (no stored iterates); "
                         "use grad='implicit' or 'reverse_chebyshev', or backend='torch' for grad='autograd'")
    stages.check_chunk(C, "gka")


# --------------------------------------------------------------------------------------------------
# the solve stage alone (heads-first tensors, as kernels.gka.chunked lays them out)
# --------------------------------------------------------------------------------------------------
class _ChunkSolve(torch.autograd.Function):
    """``x = ChebyshevSolve(A(H0, K, G, ridge(n2))) q`` on heads-first ``(b, h, n, C, ...)`` tensors."""

    @staticmethod
    def forward(ctx, grad, r, op, ridge, Q, H0, K, G, n2):
        b, h, n, C, D = Q.shape
        tf = lambda t: t.movedim(1, 3).reshape(b, n * C, h, *t.shape[4:])  # noqa: E731  (b, n*C, h, ...)
        Qf, Kf, Gf = tf(Q.float()), tf(K.to(stages_dtype(op))), tf(G.float())
        starts = H0.float().contiguous()
        n2f = n2.float().reshape(b * h, n * C).contiguous()
        lay = _Layout(Kf, C)
        reverse = grad == "reverse_chebyshev"
        X, XP, _ = _solve(Qf, lay.T, None, None, Kf, Gf, starts, n2f, lay, r, op, ridge, mix=0, store_prev=reverse,
                          exact=reverse, cum=False)
        ctx.save_for_backward(Qf, Kf, Gf, starts, n2f, X, *([XP] if reverse else []))
        ctx.meta = (grad, r, op, ridge, Q.shape, Q.dtype)
        return X.view(Q.shape).to(Q.dtype)

    @staticmethod
    def backward(ctx, dX):
        Qf, Kf, Gf, starts, n2f, X, *rest = ctx.saved_tensors
        grad, r, op, ridge, shape, dtype = ctx.meta
        b, h, n, C, D = shape
        lay = _Layout(Kf, C)
        dXf = dX.float().reshape(b * h, n * C, D).contiguous()
        E = torch.empty_like(starts)
        dk, dg, dn2 = lay.buf(Kf, D), lay.buf(Kf), lay.buf(Kf)
        if grad == "reverse_chebyshev":
            dq = lay.buf(Kf, D)
            _reverse(Qf, lay.T, None, None, Kf, Gf, starts, n2f, X, rest[0], dXf, dq, None, E, dk, dg, dn2, lay, r, op,
                     ridge, mix=0, acc=False, cum=False)
        else:
            dq, _, _ = _solve(lay.view(dXf), lay.Tp, None, None, Kf, Gf, starts, n2f, lay, r, op, ridge, mix=0,
                              xf=X, vjp=(dn2, dg, False), cum=False)
            _vjp(X, dq, Kf, Gf, E, dk, dg, lay, op, acc=False, cum=False)
        hf = lambda t, *tail: t.view(b, h, n, C, *tail).to(dtype)  # noqa: E731
        return (None, None, None, None, hf(dq, D), E.to(dtype), hf(dk, D), hf(dg), hf(dn2))


def stages_dtype(op: int) -> torch.dtype:
    return {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}[op]


def chunk_solve_heads_first(H0, K, G, n2, Q, *, num_iter: int, grad: str = "implicit", ridge_a: float = 0.02,
                            ridge_eps: float = 1e-6, operand: torch.dtype | None = None):
    """The solve stage alone: ``x ~= (e^{G_t} H0 + sum_{s<=t} M_ts k_s k_s^T + lam_t I)^{-1} q_t`` with
    ``(lam, mu, L) = ridge(n2, ridge_a, ridge_eps)`` (:func:`kernels.gka.reference.ridge`), ``r`` Chebyshev
    iterations, differentiable in ``Q, H0, K, G, n2``. Heads-first tensors ``(b, h, n, C, ...)`` (``G``
    cumulative within the chunk), ``H0 (b, h, n, d, d)``. ``operand``: the dtype whose width the products take
    (default ``Q``'s: bf16/fp16 -> 16-bit operands, else fp32); the keys must be exact in it."""
    _check(grad, Q.shape[3])
    op = operand_code(Q.dtype if operand is None else operand)
    return _ChunkSolve.apply(grad, num_iter, op, (ridge_a, ridge_eps), Q, H0, K, G, n2)


class _ChunkNorm(torch.autograd.Function):
    """``n2 = ||H_t||_F^2`` of every token (:func:`kernels.gka.chunked.frob_norm_sq`) on heads-first tensors."""

    @staticmethod
    def forward(ctx, op, H0, K, G):
        b, h, n, C, D = K.shape
        tf = lambda t: t.movedim(1, 3).reshape(b, n * C, h, *t.shape[4:])  # noqa: E731  (b, n*C, h, ...)
        Kf, Gf, starts = tf(K.to(stages_dtype(op))), tf(G.float()), H0.float().contiguous()
        lay = _Layout(Kf, C)
        n2 = _norm(Kf, Gf, starts, lay, op, cum=False)
        ctx.save_for_backward(Kf, Gf, starts)
        ctx.meta = (op, K.shape, K.dtype)
        return n2.view(b, h, n, C).to(K.dtype)

    @staticmethod
    def backward(ctx, dn2):
        Kf, Gf, starts = ctx.saved_tensors
        op, shape, dtype = ctx.meta
        b, h, n, C, D = shape
        lay = _Layout(Kf, C)
        E, dk, dg = torch.empty_like(starts), lay.buf(Kf, D), lay.buf(Kf)
        _norm_grads(Kf, Gf, starts, dn2.float().reshape(b * h, n * C).contiguous(), E, dk, dg, lay, op, acc=False,
                    cum=False)
        return None, E.to(dtype), dk.view(shape).to(dtype), dg.view(b, h, n, C).to(dtype)


def frob_norm_sq_heads_first(H0, K, G, *, operand: torch.dtype | None = None):
    """The norm stage alone: :func:`kernels.gka.chunked.frob_norm_sq` (``H0 (b, h, n, d, d)``, heads-first ``K``
    and cumulative ``G``) in ``_norm_fwd``, differentiable through ``_norm_bwd``. ``operand`` as in
    :func:`chunk_solve_heads_first`."""
    stages.check_chunk(K.shape[3], "gka")
    return _ChunkNorm.apply(operand_code(K.dtype if operand is None else operand), H0, K, G)
