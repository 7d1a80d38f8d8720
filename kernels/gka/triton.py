"""Triton kernels for GKA's within-chunk Chebyshev solve, forward and backward.

Every token ``t`` of a chunk solves its own system ``A_t x_t = q_t``. In row-vector form, for a block of
tokens ``Xi (BT x d)`` of one chunk (keys ``K (C x d)``, cumulative log decays ``G``, chunk-start state
``H0 (d x d)``, ``M_ts = e^{G_t - G_s}`` for ``s <= t``)::

    A Xi = e^{G} * (Xi H0^T) + ((Xi K^T) * M) K + lam * Xi

— three ``tl.dot`` products per iteration, shaped ``(BT x d) (d x d)``, ``(BT x d) (d x C)`` and
``(BT x C) (C x d)``, every dimension >= 16 (tensor-core tiles). The systems of different tokens are
independent, so a program holds a tile of ``BT`` tokens x the whole head dimension (the products mix
all of ``d``, so ``d`` cannot be split across programs) and runs all ``r`` iterations in registers in
one launch; the grid is (systems = batch x heads x chunks, token tiles of the chunk).

Kernels:

- ``_solve_kernel``: ``r`` Chebyshev iterations (the forward, and the implicit backward's ``A z = dx``,
  ``A`` being symmetric); ``_solve_fp32_kernel`` is the same body with fp32 products, for the forward
  of ``grad="reverse_chebyshev"`` (below).
- ``_vjp_kernel``: the implicit backward's parameter gradients of ``<-z, A x>``: ``dH0 = -sum_t e^{G_t}
  z_t x_t^T``, ``dK``, ``dG``, ``dlam``; one program per system, looping over its token tiles, so the
  sums over tokens need no atomics.
- ``_reverse_kernel``: the paper's Algorithm 2 ("Gated KalmaNet", arXiv:2511.21016): walks the iteration
  backwards from ``xi_r, xi_{r-1}``, reconstructing earlier iterates and accumulating ``dq, dH0, dK, dG,
  dlam``; one program per system. The weight schedule ``omega_i`` is recomputed forwards in the kernel
  (reversing it in floating point is unstable; see :mod:`kernels.gka.chebyshev`).

Precision. fp32 inputs: every product is exact fp32 (``input_precision="ieee"``). bf16/fp16 inputs:
products take 16-bit operands (the input dtype) with fp32 accumulation; every iterate, residual,
weight and state stays fp32, and only the operands of a product are rounded. The keys are inputs
(exact in 16 bits); the iterate and ``H0`` are rounded, a relative perturbation of ``A`` of about the
16-bit unit roundoff ``u``, so ``x`` carries an error of about ``u`` to ``kappa u`` (``kappa <= (1+a)/a``).
Measured against fp64 (d 32-128, C 32-64, r 30): relative error of ``x`` 1.6e-3..3.9e-3 with bf16
operands, 1.7e-4..4.0e-4 with fp16 (fp32 products: 6e-8), about the rounding of a 16-bit output.
Splitting both operands into two 16-bit halves would reach 3e-6 at 2.5x the tensor-core work; the
solve does not do that.

Where products must stay fp32: ``grad="reverse_chebyshev"`` reconstructs ``xi_{i-2}`` from
``xi_{i-1}, xi_i`` by running the recurrence backwards, which amplifies any difference between the
forward's products and the reconstruction's by ~1e4-1e6 at r = 30. With 16-bit operands the rounding of
a reconstructed iterate differs from the forward's (it differs in fp32 rounding, which flips 16-bit
roundings), and dK's error against fp64 was 0.16-0.52 with bf16 operands and 2e-2..4e-2 with fp16
(fp32 products: 2.5e-4..5.3e-4; d 32 and 64, C 64, r 30). So that mode's forward solve
(``_solve_fp32_kernel``) and the reconstruction's matvec stay fp32; its adjoint recursion (the
transposed, stable iteration) and the gradient products take 16-bit operands.

fp16 range: a 16-bit operand must stay below 65504. The solve iterates on ``y_t = xi_t / (s_t max|q_t|)``
(``s_t = 2 / (L_t + mu_t)``; the iteration is linear per row, so the rows may be scaled), which keeps
``|y|`` near 1 to ``sqrt(d) kappa``, and divides ``H0`` by a power of two near its largest entry; the
gradient kernels scale rows (products over ``d``) or columns (products over tokens) of an operand by
its largest magnitude. bf16 has fp32's range and takes the same code.

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

#: kernels whose products stay fp32 for 16-bit inputs, and why (read by the compile check)
FP32_DOT_KERNELS = {
    "_solve_fp32_kernel": "the forward of grad='reverse_chebyshev': the backward reconstructs the iterates by "
                          "running the recurrence backwards, which amplifies any difference from the forward's "
                          "products ~1e4-1e6 at r = 30 (16-bit products: dK error 0.16-0.52 against fp64, "
                          "fp32: 5e-4)",
}

#: 16-bit products split the iterate and H0 into two 16-bit halves each (see the module docstring):
#: about 2.5x the tensor-core work of single 16-bit operands, for ~1e-5 instead of ~1e-2 output error (bf16)
SPLIT_OPERANDS = True

#: constexpr codes of the product operand dtype
_OPERAND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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
def _halves(b, OP: tl.constexpr, SPLIT: tl.constexpr):
    """``b`` as the operand pair ``(hi, lo)``, ``b ~= hi + lo`` (``lo`` is ``hi`` again when unused)."""
    hi = _op(b, OP)
    if OP != 0 and SPLIT:
        lo = _op(b - hi.to(tl.float32), OP)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _mm(a, b_hi, b_lo, OP: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr):
    """``a @ (b_hi + b_lo)`` accumulated in fp32. OP 0: exact fp32 products (``b_lo`` unused). 16-bit:
    ``a`` rounded to the operand dtype, plus its remainder's product when ``SA``; ``b_lo``'s when ``SB``
    (the ``lo @ lo`` product, ~u^2, is left out)."""
    if OP == 0:
        out = tl.dot(a, b_hi, input_precision="ieee")
    else:
        a_hi = _op(a, OP)
        out = tl.dot(a_hi, b_hi)
        if SA:
            out = tl.dot(_op(a - a_hi.to(tl.float32), OP), b_hi, out)
        if SB:
            out = tl.dot(a_hi, b_lo, out)
    return out


@triton.jit
def _pow2_scale(m):
    """A power of two at or above ``m`` (1 where ``m`` is 0): dividing by it is exact."""
    return tl.where(m > 0, tl.exp2(tl.ceil(tl.log2(tl.where(m > 0, m, 1.0)))), 1.0)


@triton.jit
def _mm_rows(a, b_hi, b_lo, OP: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr):
    """:func:`_mm` with the rows of ``a`` scaled into fp16's range first (they factor out of the product)."""
    if OP == 2:
        sa = _pow2_scale(tl.max(tl.abs(a), axis=1))
        out = _mm(a / sa[:, None], b_hi, b_lo, OP, SA, SB) * sa[:, None]
    else:
        out = _mm(a, b_hi, b_lo, OP, SA, SB)
    return out


@triton.jit
def _mm_tn(a, b, OP: tl.constexpr, SPLIT: tl.constexpr):
    """``a^T @ b`` (a sum over rows: tokens), both operands split when ``SPLIT``; for fp16 the columns of
    ``a`` and ``b`` are scaled into its range first (they index the result's rows and columns)."""
    if OP == 2:
        sa = _pow2_scale(tl.max(tl.abs(a), axis=0))
        sb = _pow2_scale(tl.max(tl.abs(b), axis=0))
        b_hi, b_lo = _halves(b / sb[None, :], OP, SPLIT)
        out = _mm(tl.trans(a / sa[None, :]), b_hi, b_lo, OP, SPLIT, SPLIT) * sa[:, None] * sb[None, :]
    else:
        b_hi, b_lo = _halves(b, OP, SPLIT)
        out = _mm(tl.trans(a), b_hi, b_lo, OP, SPLIT, SPLIT)
    return out


# --------------------------------------------------------------------------------------------------
# loads
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_keys(K_ptr, H0_ptr, sys, D, C: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr):
    """The chunk's keys ``(C, BD)`` and ``H0`` divided by a power of two ``hs`` (16-bit only; else 1)."""
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k = tl.load(K_ptr + sys * C * D + offs_s[:, None] * D + offs_d[None, :], mask=md[None, :], other=0.0)
    h0 = tl.load(H0_ptr + sys * D * D + offs_d[:, None] * D + offs_d[None, :], mask=md[:, None] & md[None, :],
                 other=0.0)
    if OP == 0:
        hs = 1.0
    else:
        hs = _pow2_scale(tl.max(tl.max(tl.abs(h0), axis=1), axis=0))
        h0 = h0 / hs
    return k, h0, hs


@triton.jit
def _decay_rows(G_ptr, sys, offs_t, C: tl.constexpr):
    """``(e^{G_t}, M_ts)`` for the tokens ``offs_t`` of the chunk against all its keys ``s``."""
    offs_s = tl.arange(0, C)
    Gt = tl.load(G_ptr + sys * C + offs_t)
    Gs = tl.load(G_ptr + sys * C + offs_s)
    causal = offs_t[:, None] >= offs_s[None, :]
    M = tl.exp(tl.where(causal, Gt[:, None] - Gs[None, :], float("-inf")))
    return tl.exp(Gt), M


@triton.jit
def _operands(k, h0, OP: tl.constexpr, SPLIT: tl.constexpr):
    """The loop-invariant operands: ``H0^T`` as (hi, lo), ``K^T`` and ``K`` (keys are inputs: exact)."""
    h0t_hi, h0t_lo = _halves(tl.trans(h0), OP, SPLIT)
    return h0t_hi, h0t_lo, _op(tl.trans(k), OP), _op(k, OP)


@triton.jit
def _apply(y, h0t_hi, h0t_lo, kt, k, eGh, M, lam, OP: tl.constexpr, SPLIT: tl.constexpr):
    """``A y`` for a token tile; returns ``(A y, y K^T)``. 16-bit: the iterate and ``H0`` split when ``SPLIT``."""
    yh = _mm(y, h0t_hi, h0t_lo, OP, SPLIT, SPLIT)
    yk = _mm(y, kt, kt, OP, SPLIT, False)
    ay = eGh[:, None] * yh + _mm(yk * M, k, k, OP, SPLIT, False) + lam[:, None] * y
    return ay, yk


# --------------------------------------------------------------------------------------------------
# forward solve
# --------------------------------------------------------------------------------------------------
@triton.jit
def _solve_body(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D,
                R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                SPLIT: tl.constexpr, STORE_PREV: tl.constexpr):
    sys = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vec = sys * C * D + offs_t[:, None] * D + offs_d[None, :]
    k, h0, hs = _load_keys(K_ptr, H0_ptr, sys, D, C, BD, OP)
    h0t_hi, h0t_lo, kt, k = _operands(k, h0, OP, SPLIT)
    eG, M = _decay_rows(G_ptr, sys, offs_t, C)
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
        ay, _yk = _apply(y, h0t_hi, h0t_lo, kt, k, eGh, M, lam, OP, SPLIT)
        dy = (om - 1.0)[:, None] * dy + (s * om)[:, None] * (q - ay)
        y += dy
    tl.store(X_ptr + vec, y * rs[:, None], mask=md[None, :])
    if STORE_PREV:
        tl.store(XP_ptr + vec, (y - dy) * rs[:, None], mask=md[None, :])


@triton.jit
def _solve_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D,
                  R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                  SPLIT: tl.constexpr, STORE_PREV: tl.constexpr):
    """``r`` Chebyshev iterations for one tile of tokens: products in the operand dtype ``OP``."""
    _solve_body(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D, R, C, BT, BD, OP, SPLIT,
                STORE_PREV)


@triton.jit
def _solve_fp32_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D,
                       R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                       STORE_PREV: tl.constexpr):
    """The same iterations with fp32 products whatever the inputs (``FP32_DOT_KERNELS`` says why)."""
    _solve_body(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D, R, C, BT, BD, 0, False,
                STORE_PREV)


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _onehot_add(acc, rows, offs_t, C: tl.constexpr):
    """``acc[offs_t] += rows`` for a ``(C,)`` accumulator (a register tensor has no indexed store)."""
    hit = offs_t[:, None] == tl.arange(0, C)[None, :]
    return acc + tl.sum(tl.where(hit, rows[:, None], 0.0), axis=0)


@triton.jit
def _vjp_kernel(X_ptr, Z_ptr, K_ptr, G_ptr, H0_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, D,
                C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr, SPLIT: tl.constexpr):
    """Gradients of ``<u, A x>`` (``u = -z``) w.r.t. ``(H0, K, G, lam)`` for one system (chunk x head)."""
    sys = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k, h0, hs = _load_keys(K_ptr, H0_ptr, sys, D, C, BD, OP)
    h0t_hi, h0t_lo, kt, k = _operands(k, h0, OP, SPLIT)
    dh0 = tl.zeros([BD, BD], dtype=tl.float32)
    dk = tl.zeros([C, BD], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    for tb in range(C // BT):
        offs_t = tb * BT + tl.arange(0, BT)
        vec = sys * C * D + offs_t[:, None] * D + offs_d[None, :]
        eG, M = _decay_rows(G_ptr, sys, offs_t, C)
        x = tl.load(X_ptr + vec, mask=md[None, :], other=0.0)
        u = -tl.load(Z_ptr + vec, mask=md[None, :], other=0.0)
        ue = u * eG[:, None]
        dh0 += _mm_tn(ue, x, OP, SPLIT)
        xk = _mm_rows(x, kt, kt, OP, SPLIT, False)                  # (x_t . k_s)
        uk = _mm_rows(u, kt, kt, OP, SPLIT, False)                  # (u_t . k_s)
        a = xk * M
        b = uk * M
        w = a * uk                                                  # M_ts (x_t.k_s)(u_t.k_s)
        xh = _mm_rows(x, h0t_hi, h0t_lo, OP, SPLIT, SPLIT) * hs     # x_t H0^T
        dG = _onehot_add(dG, tl.sum(ue * xh, axis=1) + tl.sum(w, axis=1), offs_t, C) - tl.sum(w, axis=0)
        dk += _mm_tn(b, x, OP, SPLIT) + _mm_tn(a, u, OP, SPLIT)
        tl.store(DLAM_ptr + sys * C + offs_t, tl.sum(u * x, axis=1))
    tl.store(DH0_ptr + sys * D * D + offs_d[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    tl.store(DK_ptr + sys * C * D + offs_s[:, None] * D + offs_d[None, :], dk, mask=md[None, :])
    tl.store(DG_ptr + sys * C + offs_s, dG)


@triton.jit
def _reverse_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, DX_ptr,
                    DQ_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, D, min_momentum,
                    R: tl.constexpr, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, OP: tl.constexpr,
                    SPLIT: tl.constexpr):
    """The paper's Algorithm 2 for one system: exact gradients of r Chebyshev iterations.

    The reconstruction of the iterates takes fp32 products (``xi H0^T``, ``xi K^T`` and its matvec); the
    adjoint recursion ``dxi_{i-1} = omega_i dxi_i - c_i A dxi_i - (omega_{i+1} - 1) dxi_{i+1}`` and the
    gradient products take the operand dtype ``OP``."""
    sys = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k32, h032, _one = _load_keys(K_ptr, H0_ptr, sys, D, C, BD, 0)   # fp32 copies for the reconstruction
    h0t32 = tl.trans(h032)
    kt32 = tl.trans(k32)
    k, h0, hs = _load_keys(K_ptr, H0_ptr, sys, D, C, BD, OP)
    h0t_hi, h0t_lo, kt, ko = _operands(k, h0, OP, SPLIT)
    dh0 = tl.zeros([BD, BD], dtype=tl.float32)
    dk = tl.zeros([C, BD], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    for tb in range(C // BT):
        offs_t = tb * BT + tl.arange(0, BT)
        vec = sys * C * D + offs_t[:, None] * D + offs_d[None, :]
        eG, M = _decay_rows(G_ptr, sys, offs_t, C)
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
            rg = tl.full([BT], 1.0, tl.float32)
        else:  # the adjoint recursion is linear per row: run it on dxi / max|dxi| (fp16's range)
            rg = tl.max(tl.abs(g_cur), axis=1)
            rg = tl.where(rg > 0, rg, 1.0)
            g_cur = g_cur / rg[:, None]
        g_next = tl.zeros([BT, BD], dtype=tl.float32)
        om_next = tl.full([BT], 1.0, tl.float32)
        dq = tl.zeros([BT, BD], dtype=tl.float32)
        dG_rows = tl.zeros([BT], dtype=tl.float32)
        dlam = tl.zeros([BT], dtype=tl.float32)
        for it in range(R):
            i = R - it  # R, ..., 1
            om = tl.full([BT], 2.0, tl.float32)
            for _ in range(i):  # omega_i, recomputed forwards (the reversed recursion is unstable)
                om = 4.0 / (4.0 - rho2 * om)
            c = s * om
            dq += c[:, None] * g_cur
            # fp32 products of xi_{i-1}: its matvec (for the reconstruction), and dG's x H0^T and x K^T
            xh = tl.dot(xi_prev, h0t32, input_precision="ieee")
            xk = tl.dot(xi_prev, kt32, input_precision="ieee")
            a = xk * M
            ax = eG[:, None] * xh + tl.dot(a, k32, input_precision="ieee") + lam[:, None] * xi_prev
            # the adjoint: A dxi_i in the operand dtype
            ag, gk = _apply(g_cur, h0t_hi, h0t_lo, kt, ko, eGh, M, lam, OP, SPLIT)
            # parameter gradients of <u, A xi_{i-1}> with u = -c_i dxi_i = -c rg g_cur
            u = -(c * rg)[:, None] * g_cur
            uk = -(c * rg)[:, None] * gk
            w = a * uk
            dG_rows += eG * tl.sum(u * xh, axis=1) + tl.sum(w, axis=1)
            dG -= tl.sum(w, axis=0)
            dh0 += _mm_tn(u * eG[:, None], xi_prev, OP, SPLIT)
            dk += _mm_tn(uk * M, xi_prev, OP, SPLIT) + _mm_tn(a, u, OP, SPLIT)
            dlam += tl.sum(u * xi_prev, axis=1)
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
        dG = _onehot_add(dG, dG_rows, offs_t, C)
        tl.store(DLAM_ptr + sys * C + offs_t, dlam)
    tl.store(DH0_ptr + sys * D * D + offs_d[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    tl.store(DK_ptr + sys * C * D + offs_s[:, None] * D + offs_d[None, :], dk, mask=md[None, :])
    tl.store(DG_ptr + sys * C + offs_s, dG)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _block_d(d):
    return max(16, triton.next_power_of_2(d))


def _solve_config(C, BD):
    """Tokens per program and warps of the solve: a tile of ``BT`` tokens keeps its iterate, step,
    right-hand side and product (4 x BT x BD fp32) and the loop-invariant operands in registers."""
    BT = min(C, 32 if BD <= 64 else 16)
    return BT, (4 if BD <= 64 else 8)


def _backward_config(C, BD):
    """Token tile and warps of the per-system backward kernels (they also hold dH0 and dK, fp32)."""
    return min(C, 16), (4 if BD <= 32 else 8)


def _solve(Q, K, G, H0, lam, mu, L, r, op, store_prev, fp32_products=False):
    N, C, D = Q.shape
    X = torch.empty_like(Q)
    XP = torch.empty_like(Q) if store_prev else X
    BD = _block_d(D)
    BT, warps = _solve_config(C, BD)
    grid = (N, C // BT)
    if fp32_products:
        launch(_solve_fp32_kernel, grid, Q, K, G, H0, lam, mu, L, X, XP, D, R=r, C=C, BT=BT, BD=BD,
               STORE_PREV=store_prev, num_warps=warps)
    else:
        launch(_solve_kernel, grid, Q, K, G, H0, lam, mu, L, X, XP, D, R=r, C=C, BT=BT, BD=BD, OP=op,
               SPLIT=SPLIT_OPERANDS, STORE_PREV=store_prev, num_warps=warps)
    return X, (XP if store_prev else None)


def _systems(t, inner):
    """``(b, h, n, C, ...)`` heads-first -> ``(b*h*n, C, ...)`` fp32 contiguous (a view when it already is)."""
    return t.float().reshape(-1, *t.shape[3:3 + inner]).contiguous()


class _TritonChunkSolve(torch.autograd.Function):
    """The within-chunk solve on heads-first tensors ``(b, h, n, C, ...)``; ``H0 (b, h, n, d, d)``."""

    @staticmethod
    def forward(ctx, grad, r, op, Qc, H0, Kc, G, lam, mu, L):
        Q, K = _systems(Qc, 2), _systems(Kc, 2)
        H0f = _systems(H0, 2)
        Gf, lamf, muf, Lf = (_systems(t, 1) for t in (G, lam, mu, L))
        reverse = grad == "reverse_chebyshev"
        X, XP = _solve(Q, K, Gf, H0f, lamf, muf, Lf, r, op, store_prev=reverse, fp32_products=reverse)
        ctx.grad, ctx.r, ctx.op, ctx.shape, ctx.dtype = grad, r, op, Qc.shape, Qc.dtype
        ctx.h0_shape, ctx.tok_shape = H0.shape, G.shape
        ctx.save_for_backward(Q, K, Gf, H0f, lamf, muf, Lf, X, *([XP] if reverse else []))
        return X.view(Qc.shape).to(Qc.dtype)

    @staticmethod
    def backward(ctx, dXc):
        Q, K, Gf, H0f, lamf, muf, Lf, X, *rest = ctx.saved_tensors
        N, C, D = Q.shape
        BD = _block_d(D)
        BT, warps = _backward_config(C, BD)
        dX = dXc.float().reshape(N, C, D).contiguous()
        dH0, dK = torch.empty_like(H0f), torch.empty_like(K)
        dG, dlam = torch.empty_like(Gf), torch.empty_like(lamf)
        if ctx.grad == "reverse_chebyshev":
            (XP,) = rest
            dQ = torch.empty_like(Q)
            launch(_reverse_kernel, (N,), Q, K, Gf, H0f, lamf, muf, Lf, X, XP, dX, dQ, dH0, dK, dG, dlam, D,
                   _REVERSE_MIN_MOMENTUM, R=ctx.r, C=C, BT=BT, BD=BD, OP=ctx.op, SPLIT=SPLIT_OPERANDS,
                   num_warps=warps)
        else:
            dQ, _ = _solve(dX, K, Gf, H0f, lamf, muf, Lf, ctx.r, ctx.op, store_prev=False)
            launch(_vjp_kernel, (N,), X, dQ, K, Gf, H0f, dH0, dK, dG, dlam, D, C=C, BT=BT, BD=BD, OP=ctx.op,
                   SPLIT=SPLIT_OPERANDS, num_warps=warps)
        dt = ctx.dtype
        return (None, None, None, dQ.view(ctx.shape).to(dt), dH0.view(ctx.h0_shape).to(dt),
                dK.view(ctx.shape).to(dt), dG.view(ctx.tok_shape).to(dt), dlam.view(ctx.tok_shape).to(dt),
                None, None)


def _check(num_iter, grad, C):
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
    (default ``Q``'s: bf16/fp16 -> 16-bit operands, else fp32)."""
    _check(num_iter, grad, Q.shape[3])
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

    The solve's products take the width of the inputs (16-bit operands for bf16/fp16 ``q``)."""
    if solver != "chebyshev" and kw.get("num_iter", 30) > 0:
        raise ValueError(f"gka triton backend implements solver='chebyshev' only, not {solver!r}")
    solve = functools.partial(chunk_solve_heads_first, operand=q.dtype)
    return gka_chunked(q, k, v, g, alpha, chunk_size=chunk_size, solver=solver, solve_fn=solve, **kw)
