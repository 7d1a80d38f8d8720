"""Triton kernels for GKA's within-chunk Chebyshev solve, forward and backward.

One program per (batch, chunk, head) holds the chunk's keys ``K (C x d)``, cumulative log decays
``G (C)``, chunk-start state ``H0 (d x d)``, ridges and spectrum bounds, and runs all ``r`` Chebyshev
iterations for the chunk's ``C`` systems at once with the matvec (row-vector form)

    A xi = e^{G} * (xi H0^T) + ((xi K^T) * M) K + lam * xi,     M_ts = e^{G_t - G_s} (s <= t)

— three ``tl.dot``s per iteration, no per-token ``d x d`` matrix. Backward:

- ``implicit``: the same kernel solves ``A z = dx`` (A is symmetric), then ``_vjp_kernel`` forms the
  parameter gradients of ``<-z, A x>``: ``dH0 = -sum_t e^{G_t} z_t x_t^T``, ``dK``, ``dG``, ``dlam``.
- ``reverse_chebyshev``: ``_reverse_kernel`` runs the paper's Algorithm 2 in registers: it walks the
  iteration backwards from ``xi_r, xi_{r-1}``, recomputing earlier iterates and accumulating
  ``dq, dH0, dK, dG, dlam`` (the weight schedule ``omega_i`` is precomputed per token in PyTorch,
  because reversing it in floating point is unstable; see :mod:`kernels.gka.chebyshev`).

Everything outside the solve (chunk-state pass, closed-form ``||H_t||_F``, readout) is the PyTorch
code of :mod:`kernels.gka.chunked`, differentiated by autograd. Kernels compute in fp32 (fp16/bf16
inputs are upcast). ``chunk_size`` must be a power of two >= 16 (``tl.dot`` block sizes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from .chebyshev import omega_schedule
from .chunked import gka_chunked


@triton.jit
def _load_chunk(K_ptr, G_ptr, H0_ptr, pid, C: tl.constexpr, D, BD: tl.constexpr):
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    k = tl.load(K_ptr + pid * C * D + offs_c[:, None] * D + offs_d[None, :], mask=md[None, :], other=0.0)
    G = tl.load(G_ptr + pid * C + offs_c)
    h0 = tl.load(H0_ptr + pid * D * D + offs_d[:, None] * D + offs_d[None, :], mask=md[:, None] & md[None, :],
                 other=0.0)
    causal = offs_c[:, None] >= offs_c[None, :]
    M = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    return k, G, h0, M


@triton.jit
def _matvec(xi, k, h0, eG, M, lam):
    y = eG[:, None] * tl.dot(xi, tl.trans(h0), input_precision="ieee")
    s = tl.dot(xi, tl.trans(k), input_precision="ieee") * M
    y += tl.dot(s, k, input_precision="ieee")
    return y + lam[:, None] * xi


@triton.jit
def _solve_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, X_ptr, XP_ptr, D,
                  R: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, STORE_PREV: tl.constexpr):
    pid = tl.program_id(0)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vec = pid * C * D + offs_c[:, None] * D + offs_d[None, :]
    k, G, h0, M = _load_chunk(K_ptr, G_ptr, H0_ptr, pid, C, D, BD)
    eG = tl.exp(G)
    q = tl.load(Q_ptr + vec, mask=md[None, :], other=0.0)
    lam = tl.load(LAM_ptr + pid * C + offs_c)
    mu = tl.load(MU_ptr + pid * C + offs_c)
    L = tl.load(L_ptr + pid * C + offs_c)
    s = 2.0 / (L + mu)
    rho = (L - mu) / (L + mu)
    rho2 = rho * rho
    om = tl.full([C], 2.0, tl.float32)
    xi_prev = tl.zeros([C, BD], dtype=tl.float32)
    xi = s[:, None] * q
    for _ in range(R):
        om = 4.0 / (4.0 - rho2 * om)
        ax = _matvec(xi, k, h0, eG, M, lam)
        xi_new = xi - (s * om)[:, None] * (ax - q) + (om - 1.0)[:, None] * (xi - xi_prev)
        xi_prev = xi
        xi = xi_new
    tl.store(X_ptr + vec, xi, mask=md[None, :])
    if STORE_PREV:
        tl.store(XP_ptr + vec, xi_prev, mask=md[None, :])


@triton.jit
def _vjp_kernel(X_ptr, U_ptr, K_ptr, G_ptr, H0_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, D,
                C: tl.constexpr, BD: tl.constexpr):
    """Gradients of <u, A x> w.r.t. (H0, K, G, lam) for one chunk."""
    pid = tl.program_id(0)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vec = pid * C * D + offs_c[:, None] * D + offs_d[None, :]
    k, G, h0, M = _load_chunk(K_ptr, G_ptr, H0_ptr, pid, C, D, BD)
    eG = tl.exp(G)
    x = tl.load(X_ptr + vec, mask=md[None, :], other=0.0)
    u = tl.load(U_ptr + vec, mask=md[None, :], other=0.0)
    dh0 = tl.dot(tl.trans(u * eG[:, None]), x, input_precision="ieee")
    dG = eG * tl.sum(u * tl.dot(x, tl.trans(h0), input_precision="ieee"), axis=1)
    xk = tl.dot(x, tl.trans(k), input_precision="ieee")
    uk = tl.dot(u, tl.trans(k), input_precision="ieee")
    a = xk * M
    b = uk * M
    w = a * uk
    dG += tl.sum(w, axis=1) - tl.sum(w, axis=0)
    dk = tl.dot(tl.trans(b), x, input_precision="ieee") + tl.dot(tl.trans(a), u, input_precision="ieee")
    tl.store(DH0_ptr + pid * D * D + offs_d[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    tl.store(DK_ptr + vec, dk, mask=md[None, :])
    tl.store(DG_ptr + pid * C + offs_c, dG)
    tl.store(DLAM_ptr + pid * C + offs_c, tl.sum(u * x, axis=1))


@triton.jit
def _reverse_kernel(Q_ptr, K_ptr, G_ptr, H0_ptr, LAM_ptr, MU_ptr, L_ptr, OM_ptr, X_ptr, XP_ptr, DX_ptr,
                    DQ_ptr, DH0_ptr, DK_ptr, DG_ptr, DLAM_ptr, D, min_momentum,
                    R: tl.constexpr, C: tl.constexpr, BD: tl.constexpr):
    """The paper's Algorithm 2 for one chunk: exact gradients of r Chebyshev iterations."""
    pid = tl.program_id(0)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    vec = pid * C * D + offs_c[:, None] * D + offs_d[None, :]
    k, G, h0, M = _load_chunk(K_ptr, G_ptr, H0_ptr, pid, C, D, BD)
    eG = tl.exp(G)
    q = tl.load(Q_ptr + vec, mask=md[None, :], other=0.0)
    lam = tl.load(LAM_ptr + pid * C + offs_c)
    mu = tl.load(MU_ptr + pid * C + offs_c)
    L = tl.load(L_ptr + pid * C + offs_c)
    s = 2.0 / (L + mu)
    xi_cur = tl.load(X_ptr + vec, mask=md[None, :], other=0.0)
    xi_prev = tl.load(XP_ptr + vec, mask=md[None, :], other=0.0)
    g_cur = tl.load(DX_ptr + vec, mask=md[None, :], other=0.0)
    g_next = tl.zeros([C, BD], dtype=tl.float32)
    om_next = tl.full([C], 1.0, tl.float32)
    dq = tl.zeros([C, BD], dtype=tl.float32)
    dh0 = tl.zeros([BD, BD], dtype=tl.float32)
    dk = tl.zeros([C, BD], dtype=tl.float32)
    dG = tl.zeros([C], dtype=tl.float32)
    dlam = tl.zeros([C], dtype=tl.float32)
    for it in range(R):
        i = R - it  # R, ..., 1
        om = tl.load(OM_ptr + pid * R * C + (i - 1) * C + offs_c)
        c = s * om
        dq += c[:, None] * g_cur
        # parameter gradients of <u, A xi_{i-1}> with u = -c_i dxi_i
        u = -c[:, None] * g_cur
        dh0 += tl.dot(tl.trans(u * eG[:, None]), xi_prev, input_precision="ieee")
        dG += eG * tl.sum(u * tl.dot(xi_prev, tl.trans(h0), input_precision="ieee"), axis=1)
        xk = tl.dot(xi_prev, tl.trans(k), input_precision="ieee")
        uk = tl.dot(u, tl.trans(k), input_precision="ieee")
        a = xk * M
        w = a * uk
        dG += tl.sum(w, axis=1) - tl.sum(w, axis=0)
        dk += tl.dot(tl.trans(uk * M), xi_prev, input_precision="ieee") + tl.dot(tl.trans(a), u,
                                                                                  input_precision="ieee")
        dlam += tl.sum(u * xi_prev, axis=1)
        # dxi_{i-1} = A_i dxi_i + b_{i+1} dxi_{i+1}
        g_prev = om[:, None] * g_cur - c[:, None] * _matvec(g_cur, k, h0, eG, M, lam) \
            - (om_next - 1.0)[:, None] * g_next
        # xi_{i-2} = (omega_i xi_{i-1} - c_i A xi_{i-1} + c_i q - xi_i) / (omega_i - 1)
        m = om - 1.0
        ok = m > min_momentum
        recon = (om[:, None] * xi_prev - c[:, None] * _matvec(xi_prev, k, h0, eG, M, lam) + c[:, None] * q
                 - xi_cur) / tl.where(ok, m, 1.0)[:, None]
        xi_pp = tl.where(ok[:, None], recon, xi_prev)
        xi_pp = tl.where(i >= 2, xi_pp, 0.0)
        g_next = g_cur
        g_cur = g_prev
        xi_cur = xi_prev
        xi_prev = xi_pp
        om_next = om
    dq += s[:, None] * g_cur
    tl.store(DQ_ptr + vec, dq, mask=md[None, :])
    tl.store(DH0_ptr + pid * D * D + offs_d[:, None] * D + offs_d[None, :], dh0, mask=md[:, None] & md[None, :])
    tl.store(DK_ptr + vec, dk, mask=md[None, :])
    tl.store(DG_ptr + pid * C + offs_c, dG)
    tl.store(DLAM_ptr + pid * C + offs_c, dlam)


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _flat_vec(t):  # (b, n, C, h, d) -> (b*n*h, C, d)
    b, n, C, h, d = t.shape
    return t.permute(0, 1, 3, 2, 4).reshape(b * n * h, C, d).float().contiguous()


def _unflat_vec(t, shape, dtype):
    b, n, C, h, d = shape
    return t.reshape(b, n, h, C, d).permute(0, 1, 3, 2, 4).to(dtype)


def _flat_tok(t):  # (b, n, C, h) -> (b*n*h, C)
    b, n, C, h = t.shape
    return t.permute(0, 1, 3, 2).reshape(b * n * h, C).float().contiguous()


def _unflat_tok(t, shape, dtype):
    b, n, C, h = shape
    return t.reshape(b, n, h, C).permute(0, 1, 3, 2).to(dtype)


def _block_d(d):
    return max(16, triton.next_power_of_2(d))


def _solve(Q, K, G, H0, lam, mu, L, r, store_prev):
    N, C, D = Q.shape
    X = torch.empty_like(Q)
    XP = torch.empty_like(Q) if store_prev else X
    launch(_solve_kernel, (N,), Q, K, G, H0, lam, mu, L, X, XP, D, R=r, C=C, BD=_block_d(D), STORE_PREV=store_prev)
    return X, (XP if store_prev else None)


class _TritonChunkSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad, r, Qc, H0, Kc, G, lam, mu, L):
        b, n, C, h, d = Qc.shape
        Q, K = _flat_vec(Qc), _flat_vec(Kc)
        H0f = H0.reshape(b * n * h, d, d).float().contiguous()
        Gf, lamf, muf, Lf = (_flat_tok(t) for t in (G, lam, mu, L))
        X, XP = _solve(Q, K, Gf, H0f, lamf, muf, Lf, r, store_prev=(grad == "reverse_chebyshev"))
        ctx.grad, ctx.r, ctx.shape, ctx.dtype = grad, r, Qc.shape, Qc.dtype
        ctx.save_for_backward(Q, K, Gf, H0f, lamf, muf, Lf, X, *( [XP] if XP is not None else []))
        return _unflat_vec(X, Qc.shape, Qc.dtype)

    @staticmethod
    def backward(ctx, dXc):
        Q, K, Gf, H0f, lamf, muf, Lf, X, *rest = ctx.saved_tensors
        N, C, D = Q.shape
        BD = _block_d(D)
        dX = _flat_vec(dXc.contiguous())
        dH0, dK = torch.empty_like(H0f), torch.empty_like(K)
        dG, dlam = torch.empty_like(Gf), torch.empty_like(lamf)
        if ctx.grad == "reverse_chebyshev":
            (XP,) = rest
            rho = (Lf - muf) / (Lf + muf)
            OM = torch.stack(omega_schedule(rho, ctx.r), dim=1).contiguous()  # (N, R, C)
            dQ = torch.empty_like(Q)
            from .chebyshev import _REVERSE_MIN_MOMENTUM
            launch(_reverse_kernel, (N,), Q, K, Gf, H0f, lamf, muf, Lf, OM, X, XP, dX, dQ, dH0, dK, dG, dlam, D,
                                  _REVERSE_MIN_MOMENTUM, R=ctx.r, C=C, BD=BD)
        else:
            Z, _ = _solve(dX, K, Gf, H0f, lamf, muf, Lf, ctx.r, store_prev=False)
            launch(_vjp_kernel, (N,), X, -Z, K, Gf, H0f, dH0, dK, dG, dlam, D, C=C, BD=BD)
            dQ = Z
        b, n, C_, h, d = ctx.shape
        tok_shape = (b, n, C_, h)
        dt = ctx.dtype
        return (None, None, _unflat_vec(dQ, ctx.shape, dt), dH0.reshape(b, n, h, d, d).to(dt),
                _unflat_vec(dK, ctx.shape, dt), _unflat_tok(dG, tok_shape, dt), _unflat_tok(dlam, tok_shape, dt),
                None, None)


def triton_chunk_solve(H0, Kc, G, lam, mu, L, Qc, *, num_iter: int, grad: str = "implicit"):
    """Within-chunk Chebyshev solve (same contract as ``iterative_solve(ChunkOp, ...)``)."""
    if grad not in ("implicit", "reverse_chebyshev"):
        raise ValueError(f"gka triton backend: grad={grad!r} is not available in Triton (no stored iterates); "
                         "use grad='implicit' or 'reverse_chebyshev', or backend='torch' for grad='autograd'")
    C = Qc.shape[2]
    if C < 16 or C & (C - 1):
        raise ValueError(f"gka triton backend: chunk_size must be a power of two >= 16, got {C}")
    return _TritonChunkSolve.apply(grad, num_iter, Qc, H0, Kc, G, lam, mu.detach(), L.detach())


def gka_triton(q, k, v, g, alpha=None, *, chunk_size: int = 64, solver: str = "chebyshev", **kw):
    """GKA with the within-chunk Chebyshev solve in Triton (same contract as :func:`gka_chunked`)."""
    if solver != "chebyshev" and kw.get("num_iter", 30) > 0:
        raise ValueError(f"gka triton backend implements solver='chebyshev' only, not {solver!r}")
    return gka_chunked(q, k, v, g, alpha, chunk_size=chunk_size, solver=solver, solve_fn=triton_chunk_solve, **kw)
