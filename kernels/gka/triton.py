"""Triton kernels for GKA's within-chunk Chebyshev solve, forward and backward.

Every token ``t`` of a chunk solves its own system ``A_t x_t = q_t``. In row-vector form, for a tile of
tokens ``Xi (BT x d)`` of one chunk (keys ``K (C x d)``, cumulative log decays ``G``, chunk-start state
``H0 (d x d)``, ``M_ts = e^{G_t - G_s}`` for ``s <= t``)::

    A Xi = e^{G} * (Xi H0^T) + ((Xi K^T) * M) K + lam * Xi

— three ``tl.dot`` products per iteration, shaped ``(BT x d) (d x d)``, ``(BT x d) (d x C)`` and
``(BT x C) (C x d)``, every dimension >= 16 (tensor-core tiles). The systems of different tokens are
independent, so a program holds a tile of ``BT`` tokens x the whole head dimension and runs all ``r``
iterations in registers, in one launch; the grid is (systems = batch x heads x chunks, token tiles).
The head dimension cannot be split across programs: every product of an iteration mixes all of ``d``,
and the iteration is sequential (iteration ``i + 1`` needs all of ``A xi_i``). The element-wise work of
an iteration (the Chebyshev step, the ``e^G`` and ``lam`` terms, the decay mask) is not a product.

Kernels:

- ``_solve_kernel``: ``r`` Chebyshev iterations (the forward, and the implicit backward's ``A z = dx``,
  ``A`` being symmetric).
- ``_vjp_kernel``: the implicit backward's parameter gradients of ``<-z, A x>``: ``dH0 = -sum_t e^{G_t}
  z_t x_t^T``, ``dK``, ``dG``, ``dlam``. Its grid splits each system into key tiles (a program sums
  ``dK_s`` and the ``s`` part of ``dG`` over the tokens ``t >= s``, and does its own tokens' ``dlam`` and
  ``t`` part of ``dG``) and row tiles of ``dH0`` (a program sums its rows over all tokens): every sum
  over tokens stays inside one program, without atomics.
- ``_reverse_kernel``: the paper's Algorithm 2 ("Gated KalmaNet", arXiv:2511.21016): walks the iteration
  backwards from ``xi_r, xi_{r-1}``, reconstructing earlier iterates and accumulating ``dq, dH0, dK, dG,
  dlam``; one program per system (its token tiles run one after another into the same ``dH0, dK``
  accumulators). The weight schedule ``omega_i`` is computed forwards in the kernel into a scratch buffer
  and read back in reverse (reversing its recursion in floating point is unstable; see
  :mod:`kernels.gka.chebyshev`).

Precision. fp32 inputs: every product is exact fp32 (``input_precision="ieee"``). bf16/fp16 inputs:
every product takes 16-bit operands (the input dtype) with fp32 accumulation; iterates, residuals,
weights, states and accumulators stay fp32, and an fp32 operand enters a product as ``PREC`` 16-bit
pieces ``a ~= a_1 + a_2 + ...`` (``a_1`` its rounding, ``a_2`` the rounding of the remainder, ...), the
products of pieces whose orders sum below ``PREC`` accumulated (pieces of order ``p`` carry ``u^p``):

- ``PREC = 1``: one product, operands rounded (relative error ``u``: 2^-9 bf16, 2^-12 fp16);
- ``PREC = 2``: three products for ``xi H0^T``, two for the key products (the keys are inputs, exact
  in 16 bits), ~``u^2``;
- ``PREC = 3``: six and three: the pieces hold all 24 bits of an fp32 significand, so the product is
  fp32's up to the accumulation.

The solve's default is ``PREC = 2`` (:data:`SOLVE_PIECES`), 2.5x the tensor-core work of ``PREC = 1``,
because GKA's readout cancels: ``x`` is large (``~q / lam``) along the directions the keys do not span
and ``U`` nearly annihilates them, so an error of ``x`` relative to ``|x|`` reaches ``o = U x`` amplified
up to ``~1 / a`` (``a`` = ridge_a = 0.02). Measured against fp64 on GKA's solves (d 64-128, C 64, r 30,
output error of the layer core): one bf16 piece 1.2e-2..3.0e-2 (fp16: 1.2e-3..4.1e-3), two pieces of
every operand 1.8e-5..4.7e-5 (fp16: 1.1e-6..1.3e-6); two pieces in the key products only, 3.4e-3..5.1e-3.

``grad="reverse_chebyshev"`` reconstructs ``xi_{i-2}`` from ``xi_{i-1}, xi_i`` by running the recurrence
backwards, which amplifies any difference between the forward's products and the reconstruction's by
~1e4-1e6 at r = 30: measured dK error against fp64 with one bf16 piece 0.16-0.52 (fp16: 2e-2..4e-2;
fp32 products: 2.5e-4..5.3e-4; d 32 and 64, C 64). That mode's forward solve and the reconstruction's
products therefore take ``PREC = 3`` (fp32's products on tensor cores); its adjoint recursion (the
transposed, stable iteration) and its gradient products take the solve's ``PREC``.

fp16 range: a 16-bit operand must stay below 65504. The solve iterates on ``y_t = xi_t / (s_t max|q_t|)``
(``s_t = 2 / (L_t + mu_t)``; the iteration is linear per row, so rows may be scaled), which keeps ``|y|``
near 1 to ``sqrt(d) kappa``, and divides ``H0`` by a power of two near its largest entry; the gradient
kernels scale the rows (products over ``d``) or columns (products over tokens) of an operand by a
power of two near its largest magnitude. bf16 has fp32's range and takes the same code.

Everything outside the solve (chunk-state pass, closed-form ``||H_t||_F``, readout) is the PyTorch code
of :mod:`kernels.gka.chunked`, differentiated by autograd. ``chunk_size`` must be a power of two >= 16
(``tl.dot`` block sizes).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..launch import launch
from .chebyshev import _REVERSE_MIN_MOMENTUM
from .chunked import gka_chunked

#: 16-bit pieces per fp32 operand in the solve's products for bf16/fp16 inputs (see the module docstring)
SOLVE_PIECES = 2
#: pieces of the reverse-Chebyshev reconstruction's products (and of that mode's forward): fp32's products
EXACT_PIECES = 3

#: constexpr codes of the product operand dtype
_OPERAND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPE = {code: dtype for dtype, code in _OPERAND.items()}


# --------------------------------------------------------------------------------------------------
# products
# --------------------------------------------------------------------------------------------------
@triton.jit
def _op(a, OP: tl.constexpr):
    """``a`` as a product operand: unchanged (fp32), bf16 (OP 1) or fp16 (OP 2)."""
    if OP == 1:
        out = a.to(tl.bfloat16)
    elif OP == 2:
        out = a.to(tl.float16)
    else:
        out = a
    return out


@triton.jit
def _pieces(b, OP: tl.constexpr, P: tl.constexpr):
    """``b ~= b1 + b2 + b3`` in the operand dtype (the first ``P`` pieces; unused ones repeat ``b1``)."""
    b1 = _op(b, OP)
    b2 = b1
    b3 = b1
    if OP != 0:
        if P > 1:
            r = b - b1.to(tl.float32)
            b2 = _op(r, OP)
            if P > 2:
                b3 = _op(r - b2.to(tl.float32), OP)
    return b1, b2, b3


@triton.jit
def _mm(a, b1, b2, b3, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """``a @ b`` accumulated in fp32, ``b`` given as pieces ``(b1, b2, b3)`` (:func:`_pieces`, ``PB`` of them).
    OP 0: exact fp32 products of ``a`` and ``b1``. 16-bit: ``a`` in ``PA`` pieces, the products of pieces
    ``a_i b_j`` with ``i + j < max(PA, PB)`` (orders from 0), the smallest first."""
    if OP == 0:
        out = tl.dot(a, b1, input_precision="ieee")
    else:
        a1, a2, a3 = _pieces(a, OP, PA)
        out = tl.zeros([a.shape[0], b1.shape[1]], dtype=tl.float32)
        if PA > 2:
            out = tl.dot(a3, b1, out)
            if PB > 1:
                out = tl.dot(a2, b2, out)
        if PB > 2:
            out = tl.dot(a1, b3, out)
        if PA > 1:
            out = tl.dot(a2, b1, out)
        if PB > 1:
            out = tl.dot(a1, b2, out)
        out = tl.dot(a1, b1, out)
    return out


@triton.jit
def _pow2_scale(m):
    """A power of two at or above ``m`` (1 where ``m`` is 0): dividing by it is exact."""
    return tl.where(m > 0, tl.exp2(tl.ceil(tl.log2(tl.where(m > 0, m, 1.0)))), 1.0)


@triton.jit
def _mm_rows(a, b1, b2, b3, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """:func:`_mm` with the rows of ``a`` scaled into fp16's range first (they factor out of the product)."""
    if OP == 2:
        sa = _pow2_scale(tl.max(tl.abs(a), axis=1))
        out = _mm(a / sa[:, None], b1, b2, b3, OP, PA, PB) * sa[:, None]
    else:
        out = _mm(a, b1, b2, b3, OP, PA, PB)
    return out


@triton.jit
def _mm_tn(a, b, OP: tl.constexpr, P: tl.constexpr):
    """``a^T @ b`` (a sum over rows: tokens), both operands in ``P`` pieces; for fp16 the columns of ``a``
    and ``b`` are scaled into its range first (they index the result's rows and columns)."""
    if OP == 2:
        sa = _pow2_scale(tl.max(tl.abs(a), axis=0))
        sb = _pow2_scale(tl.max(tl.abs(b), axis=0))
        b1, b2, b3 = _pieces(b / sb[None, :], OP, P)
        out = _mm(tl.trans(a / sa[None, :]), b1, b2, b3, OP, P, P) * sa[:, None] * sb[None, :]
    else:
        b1, b2, b3 = _pieces(b, OP, P)
        out = _mm(tl.trans(a), b1, b2, b3, OP, P, P)
    return out


# --------------------------------------------------------------------------------------------------
# loads and the operator
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_h0(H0_ptr, sys, D, BD: tl.constexpr, OP: tl.constexpr):
    """``H0`` divided by a power of two ``hs`` near its largest entry (16-bit operands; else ``hs = 1``)."""
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    h0 = tl.load(H0_ptr + sys * D * D + offs_d[:, None] * D + offs_d[None, :], mask=md[:, None] & md[None, :],
                 other=0.0)
    if OP == 0:
        hs = 1.0
    else:
        hs = _pow2_scale(tl.max(tl.max(tl.abs(h0), axis=1), axis=0))
        h0 = h0 / hs
    return h0, hs


@triton.jit
def _load_rows(ptr, sys, offs_t, D, C: tl.constexpr, BD: tl.constexpr):
    """Rows ``offs_t`` of a ``(C, D)`` block of system ``sys``, fp32, zero-padded to ``BD`` columns."""
    offs_d = tl.arange(0, BD)
    x = tl.load(ptr + sys * C * D + offs_t[:, None] * D + offs_d[None, :], mask=(offs_d < D)[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _decay(G_ptr, sys, offs_t, offs_s, C: tl.constexpr):
    """``(e^{G_t}, M_ts)`` for tokens ``offs_t`` against keys ``offs_s`` of the chunk."""
    Gt = tl.load(G_ptr + sys * C + offs_t)
    Gs = tl.load(G_ptr + sys * C + offs_s)
    causal = offs_t[:, None] >= offs_s[None, :]
    return tl.exp(Gt), tl.exp(tl.where(causal, Gt[:, None] - Gs[None, :], float("-inf")))


@triton.jit
def _apply(y, h1, h2, h3, kt, k, eGh, M, lam, OP: tl.constexpr, P: tl.constexpr):
    """``A y`` for a token tile, ``H0^T`` as pieces ``h1..h3``; returns ``(A y, y K^T)``. The keys are inputs
    (one exact piece): the key products split only the iterate side."""
    yh = _mm(y, h1, h2, h3, OP, P, P)
    yk = _mm(y, kt, kt, kt, OP, P, 1)
    ay = eGh[:, None] * yh + _mm(yk * M, k, k, k, OP, P, 1) + lam[:, None] * y
    return ay, yk


# --------------------------------------------------------------------------------------------------
# forward solve
# --------------------------------------------------------------------------------------------------
@triton.jit
def _solve_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D,
                  R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                  P: tl.constexpr, STORE_PREV: tl.constexpr):
    """``r`` Chebyshev iterations for one tile of ``BT`` tokens of one system (chunk x head)."""
    sys = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vec = sys * C * D + offs_t[:, None] * D + offs_d[None, :]
    k = _load_rows(K_ptr, sys, offs_s, D, C, BD)
    kt = _op(tl.trans(k), OP)
    k = _op(k, OP)
    h0, hs = _load_h0(H0_ptr, sys, D, BD, OP)
    h1, h2, h3 = _pieces(tl.trans(h0), OP, P)
    eG, M = _decay(G_ptr, sys, offs_t, offs_s, C)
    eGh = eG * hs
    q = tl.load(Q_ptr + vec, mask=md[None, :], other=0.0)
    lam = tl.load(LAM_ptr + sys * C + offs_t)
    mu = tl.load(MU_ptr + sys * C + offs_t)
    L = tl.load(L_ptr + sys * C + offs_t)
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
    for _ in range(R):
        om = 4.0 / (4.0 - rho2 * om)
        ay, _yk = _apply(y, h1, h2, h3, kt, k, eGh, M, lam, OP, P)
        dy = (om - 1.0)[:, None] * dy + (s * om)[:, None] * (q - ay)
        y += dy
    tl.store(X_ptr + vec, y * rs[:, None], mask=md[None, :])
    if STORE_PREV:
        tl.store(XP_ptr + vec, (y - dy) * rs[:, None], mask=md[None, :])


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _vjp_kernel(X_ptr, Z_ptr, K_ptr, G_ptr, H0_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, D,
                C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr, OP: tl.constexpr,
                P: tl.constexpr):
    """Gradients of ``<u, A x>`` (``u = -z``) w.r.t. ``(H0, K, G, lam)``. Program ``j < C / BT`` of a system
    owns keys and tokens ``j BT ..``; program ``C / BT + i`` owns rows ``i RB ..`` of ``dH0``."""
    sys = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    NB: tl.constexpr = C // BT
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    if j < NB:
        offs_j = j * BT + tl.arange(0, BT)
        # own tokens t: dlam_t and the t part of dG (e^{G_t} u_t.H0 x_t + sum_s W_ts, all keys s)
        offs_s = tl.arange(0, C)
        k = _load_rows(K_ptr, sys, offs_s, D, C, BD)
        kt = _op(tl.trans(k), OP)
        h0, hs = _load_h0(H0_ptr, sys, D, BD, OP)
        h1, h2, h3 = _pieces(tl.trans(h0), OP, P)
        eG, M = _decay(G_ptr, sys, offs_j, offs_s, C)
        x = _load_rows(X_ptr, sys, offs_j, D, C, BD)
        u = -_load_rows(Z_ptr, sys, offs_j, D, C, BD)
        xh = _mm_rows(x, h1, h2, h3, OP, P, P) * hs
        w = _mm_rows(x, kt, kt, kt, OP, P, 1) * M * _mm_rows(u, kt, kt, kt, OP, P, 1)
        dG = eG * tl.sum(u * xh, axis=1) + tl.sum(w, axis=1)
        tl.store(DLAM_ptr + sys * C + offs_j, tl.sum(u * x, axis=1))
        # own keys s: dK_s and the s part of dG, summed over the tokens t >= s
        kj = _load_rows(K_ptr, sys, offs_j, D, C, BD)
        kjt = _op(tl.trans(kj), OP)
        dk = tl.zeros([BT, BD], dtype=tl.float32)
        for tb in range(j, NB):
            offs_t = tb * BT + tl.arange(0, BT)
            _eGt, Mt = _decay(G_ptr, sys, offs_t, offs_j, C)
            xt = _load_rows(X_ptr, sys, offs_t, D, C, BD)
            ut = -_load_rows(Z_ptr, sys, offs_t, D, C, BD)
            a = _mm_rows(xt, kjt, kjt, kjt, OP, P, 1) * Mt           # M_ts (x_t . k_s)
            uk = _mm_rows(ut, kjt, kjt, kjt, OP, P, 1)               # (u_t . k_s)
            dG -= tl.sum(a * uk, axis=0)
            dk += _mm_tn(uk * Mt, xt, OP, P) + _mm_tn(a, ut, OP, P)
        tl.store(DG_ptr + sys * C + offs_j, dG)
        tl.store(DK_ptr + sys * C * D + offs_j[:, None] * D + offs_d[None, :], dk, mask=md[None, :])
    else:
        # rows i of dH0 = sum_t e^{G_t} u_t[i] x_t^T
        offs_r = (j - NB) * RB + tl.arange(0, RB)
        mr = offs_r < D
        acc = tl.zeros([RB, BD], dtype=tl.float32)
        for tb in range(NB):
            offs_t = tb * BT + tl.arange(0, BT)
            eGt = tl.exp(tl.load(G_ptr + sys * C + offs_t))
            ur = -tl.load(Z_ptr + sys * C * D + offs_t[:, None] * D + offs_r[None, :], mask=mr[None, :], other=0.0)
            xt = _load_rows(X_ptr, sys, offs_t, D, C, BD)
            acc += _mm_tn(ur * eGt[:, None], xt, OP, P)
        tl.store(DH0_ptr + sys * D * D + offs_r[:, None] * D + offs_d[None, :], acc, mask=mr[:, None] & md[None, :])


@triton.jit
def _reverse_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, DX_ptr,
                    DQ_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, OM_ptr, D, min_momentum,
                    R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                    P: tl.constexpr, PX: tl.constexpr):
    """The paper's Algorithm 2 for one system: exact gradients of r Chebyshev iterations.

    The reconstruction of the iterates takes its products in ``PX`` pieces (fp32's products); the adjoint
    recursion ``dxi_{i-1} = omega_i dxi_i - c_i A dxi_i - (omega_{i+1} - 1) dxi_{i+1}`` and the gradient
    products in ``P`` pieces (the first ``P`` of the same pieces of ``H0``). ``OM_ptr``: scratch ``(R, C)`` per
    system for the weight schedule, written forwards and read backwards."""
    sys = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k = _load_rows(K_ptr, sys, offs_s, D, C, BD)
    kt = _op(tl.trans(k), OP)
    k = _op(k, OP)
    h0, hs = _load_h0(H0_ptr, sys, D, BD, OP)
    h1, h2, h3 = _pieces(tl.trans(h0), OP, PX)
    dh0 = tl.zeros([BD, BD], dtype=tl.float32)
    dk = tl.zeros([C, BD], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    for tb in range(C // BT):
        offs_t = tb * BT + tl.arange(0, BT)
        vec = sys * C * D + offs_t[:, None] * D + offs_d[None, :]
        eG, M = _decay(G_ptr, sys, offs_t, offs_s, C)
        eGh = eG * hs
        q = tl.load(Q_ptr + vec, mask=md[None, :], other=0.0)
        lam = tl.load(LAM_ptr + sys * C + offs_t)
        mu = tl.load(MU_ptr + sys * C + offs_t)
        L = tl.load(L_ptr + sys * C + offs_t)
        s = 2.0 / (L + mu)
        rho = (L - mu) / (L + mu)
        rho2 = rho * rho
        xi_cur = tl.load(X_ptr + vec, mask=md[None, :], other=0.0)
        xi_prev = tl.load(XP_ptr + vec, mask=md[None, :], other=0.0)
        g_cur = tl.load(DX_ptr + vec, mask=md[None, :], other=0.0)
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
        for i in range(R):
            om = 4.0 / (4.0 - rho2 * om)
            tl.store(OM_ptr + (sys * R + i) * C + offs_t, om)
        tl.debug_barrier()
        g_next = tl.zeros([BT, BD], dtype=tl.float32)
        om_next = tl.full([BT], 1.0, tl.float32)
        dq = tl.zeros([BT, BD], dtype=tl.float32)
        dG_rows = tl.zeros([BT], dtype=tl.float32)
        dlam = tl.zeros([BT], dtype=tl.float32)
        for it in range(R):
            i = R - it  # R, ..., 1
            om = tl.load(OM_ptr + (sys * R + i - 1) * C + offs_t)
            c = s * om
            dq += c[:, None] * g_cur
            # xi_{i-1}'s products in PX pieces: its matvec (the reconstruction) and dG's x H0^T, x K^T
            xh = _mm(xi_prev, h1, h2, h3, OP, PX, PX)
            xk = _mm(xi_prev, kt, kt, kt, OP, PX, 1)
            a = xk * M
            ax = eGh[:, None] * xh + _mm(a, k, k, k, OP, PX, 1) + lam[:, None] * xi_prev
            # the adjoint A dxi_i in P pieces
            ag, gk = _apply(g_cur, h1, h2, h3, kt, k, eGh, M, lam, OP, P)
            # parameter gradients of <u, A xi_{i-1}>, u = -c_i dxi_i: u = -c g_cur rg, xi_{i-1} = xi_prev rx
            cu = -c * rg
            w = a * gk
            dG_rows += (eGh * tl.sum(g_cur * xh, axis=1) + tl.sum(w, axis=1)) * cu * rx
            dG += tl.sum(w * (cu * rx)[:, None], axis=0) * -1.0
            dh0 += _mm_tn(g_cur * (cu * eG)[:, None], xi_prev * rx[:, None], OP, P)
            dk += _mm_tn(gk * (cu[:, None] * M), xi_prev * rx[:, None], OP, P) \
                + _mm_tn(a * rx[:, None], g_cur * cu[:, None], OP, P)
            dlam += tl.sum(g_cur * xi_prev, axis=1) * cu * rx
            g_prev = om[:, None] * g_cur - c[:, None] * ag - (om_next - 1.0)[:, None] * g_next
            # xi_{i-2} = (omega_i xi_{i-1} - c_i A xi_{i-1} + c_i q - xi_i) / (omega_i - 1)
            m = om - 1.0
            ok = m > min_momentum
            recon = (om[:, None] * xi_prev - c[:, None] * ax + c[:, None] * q - xi_cur) / tl.where(ok, m, 1.0)[:, None]
            xi_pp = tl.where(ok[:, None], recon, xi_prev)
            xi_pp = tl.where(i >= 2, xi_pp, 0.0)
            g_next = g_cur
            g_cur = g_prev
            xi_cur = xi_prev
            xi_prev = xi_pp
            om_next = om
        dq += s[:, None] * g_cur
        tl.store(DQ_ptr + vec, dq * rg[:, None], mask=md[None, :])
        dG += tl.sum(tl.where(offs_t[:, None] == offs_s[None, :], dG_rows[:, None], 0.0), axis=0)
        tl.store(DLAM_ptr + sys * C + offs_t, dlam)
    tl.store(DH0_ptr + sys * D * D + offs_d[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    tl.store(DK_ptr + sys * C * D + offs_s[:, None] * D + offs_d[None, :], dk, mask=md[None, :])
    tl.store(DG_ptr + sys * C + offs_s, dG)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _block_d(d):
    return max(16, triton.next_power_of_2(d))


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
    its token tile: 8 warps (at 4 it spilled 1.6 KB for d 32 on sm_90)."""
    return min(C, 16), (8 if reverse or BD > 32 else 4)


def _pieces_for(op, exact=False):
    return 1 if op == 0 else (EXACT_PIECES if exact else SOLVE_PIECES)


def _solve(Q, K, G, H0, lam, mu, L, r, op, store_prev, exact=False):
    N, C, D = Q.shape
    X = torch.empty_like(Q)
    XP = torch.empty_like(Q) if store_prev else X
    BD = _block_d(D)
    BT, warps = _solve_config(C, BD, op)
    launch(_solve_kernel, (N, C // BT), Q, K, G, H0, lam, mu, L, X, XP, D, R=r, C=C, BT=BT, BD=BD, OP=op,
           P=_pieces_for(op, exact), STORE_PREV=store_prev, num_warps=warps)
    return X, (XP if store_prev else None)


def _systems(t, inner):
    """``(b, h, n, C, ...)`` heads-first -> ``(b*h*n, C, ...)`` fp32 contiguous (a view when it already is)."""
    return t.float().reshape(-1, *t.shape[3:3 + inner]).contiguous()


class _TritonChunkSolve(torch.autograd.Function):
    """The within-chunk solve on heads-first tensors ``(b, h, n, C, ...)``; ``H0 (b, h, n, d, d)``."""

    @staticmethod
    def forward(ctx, grad, r, op, Qc, H0, Kc, G, lam, mu, L):
        Q = _systems(Qc, 2)
        # the keys in the operand dtype (they are 16-bit inputs then: exact; half the loads)
        K = _systems(Kc, 2).to(_DTYPE[op])
        H0f = _systems(H0, 2)
        Gf, lamf, muf, Lf = (_systems(t, 1) for t in (G, lam, mu, L))
        reverse = grad == "reverse_chebyshev"
        X, XP = _solve(Q, K, Gf, H0f, lamf, muf, Lf, r, op, store_prev=reverse, exact=reverse)
        ctx.grad, ctx.r, ctx.op, ctx.shape, ctx.dtype = grad, r, op, Qc.shape, Qc.dtype
        ctx.h0_shape, ctx.tok_shape = H0.shape, G.shape
        ctx.save_for_backward(Q, K, Gf, H0f, lamf, muf, Lf, X, *([XP] if reverse else []))
        return X.view(Qc.shape).to(Qc.dtype)

    @staticmethod
    def backward(ctx, dXc):
        Q, K, Gf, H0f, lamf, muf, Lf, X, *rest = ctx.saved_tensors
        N, C, D = Q.shape
        BD = _block_d(D)
        BT, warps = _backward_config(C, BD, reverse=ctx.grad == "reverse_chebyshev")
        dX = dXc.float().reshape(N, C, D).contiguous()
        dH0, dK = torch.empty_like(H0f), torch.empty_like(Q)
        dG, dlam = torch.empty_like(Gf), torch.empty_like(lamf)
        if ctx.grad == "reverse_chebyshev":
            (XP,) = rest
            dQ = torch.empty_like(Q)
            OM = torch.empty(N, ctx.r, C, device=Q.device, dtype=torch.float32)
            launch(_reverse_kernel, (N,), Q, K, Gf, H0f, lamf, muf, Lf, X, XP, dX, dQ, dH0, dK, dG, dlam, OM, D,
                   _REVERSE_MIN_MOMENTUM, R=ctx.r, C=C, BT=BT, BD=BD, OP=ctx.op, P=_pieces_for(ctx.op),
                   PX=_pieces_for(ctx.op, exact=True), num_warps=warps)
        else:
            dQ, _ = _solve(dX, K, Gf, H0f, lamf, muf, Lf, ctx.r, ctx.op, store_prev=False)
            RB = min(BD, 32)
            launch(_vjp_kernel, (N, C // BT + BD // RB), X, dQ, K, Gf, H0f, dH0, dK, dG, dlam, D, C=C, BT=BT,
                   BD=BD, RB=RB, OP=ctx.op, P=_pieces_for(ctx.op), num_warps=warps)
        dt = ctx.dtype
        return (None, None, None, dQ.view(ctx.shape).to(dt), dH0.view(ctx.h0_shape).to(dt),
                dK.view(ctx.shape).to(dt), dG.view(ctx.tok_shape).to(dt), dlam.view(ctx.tok_shape).to(dt),
                None, None)


def _check(grad, C):
    if grad not in ("implicit", "reverse_chebyshev"):
        raise ValueError(f"gka triton backend: grad={grad!r} is not available in Triton (no stored iterates); "
                         "use grad='implicit' or 'reverse_chebyshev', or backend='torch' for grad='autograd'")
    if C < 16 or C & (C - 1):
        raise ValueError(f"gka triton backend: chunk_size must be a power of two >= 16, got {C}")


def operand_code(dtype: torch.dtype) -> int:
    """The product operand dtype for inputs of ``dtype``: 16-bit inputs give 16-bit operands, else fp32."""
    return _OPERAND.get(dtype, 0)


def chunk_solve_heads_first(H0, K, G, lam, mu, L, Q, *, num_iter: int, grad: str = "implicit",
                            operand: torch.dtype | None = None):
    """Within-chunk Chebyshev solve on heads-first tensors (``(b, h, n, C, ...)``, ``H0 (b, h, n, d, d)``;
    the layout of :mod:`kernels.gka.chunked`). ``operand``: the dtype whose width the products take
    (default ``Q``'s: bf16/fp16 -> 16-bit operands, else fp32); the keys must be exact in it."""
    _check(grad, Q.shape[3])
    op = operand_code(Q.dtype if operand is None else operand)
    return _TritonChunkSolve.apply(grad, num_iter, op, Q, H0, K, G, lam, mu.detach(), L.detach())


def triton_chunk_solve(H0, Kc, G, lam, mu, L, Qc, *, num_iter: int, grad: str = "implicit", operand=None):
    """Within-chunk Chebyshev solve in the ``(b, n, C, h, ...)`` layout (``H0 (b, n, h, d, d)``); same contract
    as ``iterative_solve(ChunkOp, ...)``."""
    hf = lambda t: t.movedim(3, 1)  # noqa: E731  (b, n, C, h, ...) -> (b, h, n, C, ...)
    X = chunk_solve_heads_first(H0.transpose(1, 2), hf(Kc), hf(G), hf(lam), hf(mu), hf(L), hf(Qc),
                                num_iter=num_iter, grad=grad, operand=Qc.dtype if operand is None else operand)
    return X.movedim(1, 3)


def gka_triton(q, k, v, g, alpha=None, *, chunk_size: int = 64, solver: str = "chebyshev", **kw):
    """GKA with the within-chunk Chebyshev solve in Triton (same contract as :func:`gka_chunked`).

    The solve's products take the width of the inputs (16-bit operands when ``q`` and ``k`` are both bf16 or
    both fp16: the keys are then exact in 16 bits)."""
    if solver != "chebyshev" and kw.get("num_iter", 30) > 0:
        raise ValueError(f"gka triton backend implements solver='chebyshev' only, not {solver!r}")
    solve = functools.partial(chunk_solve_heads_first, operand=torch.promote_types(q.dtype, k.dtype))
    return gka_chunked(q, k, v, g, alpha, chunk_size=chunk_size, solver=solver, solve_fn=solve, **kw)
