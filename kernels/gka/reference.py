"""Reference Gated KalmaNet (GKA) layer core, token by token, fp64-capable (the spec).

Per head ("Gated KalmaNet: A Fading Memory Layer Through Test-Time Ridge Regression", arXiv:2511.21016), with
``g_t <= 0`` a log decay:

    H_t = e^{g_t} H_{t-1} + k_t k_t^T                  (d_k x d_k)
    U_t = e^{g_t} U_{t-1} + v_t k_t^T                  (d_v x d_k)
    lambda_t = a ||H_t||_F + eps                        (adaptive ridge, a = 0.02; eps keeps H = 0 solvable)
    x_t ~= (H_t + lambda_t I)^{-1} q_t                  (r Chebyshev iterations, CG, or an exact solve)
    q~_t = q_t + alpha_t (x_t - q_t)                    (alpha-connection; alpha = None means q~ = x)
    o_t = U_t q~_t * scale                              (scale = d_k^{-1/2} by default)

Spectrum bounds for Chebyshev: ``mu_t = lambda_t``, ``L_t = lambda_t + ||H_t||_F`` (``||H||_2 <=
||H||_F``), so ``kappa_t <= (1 + a) / a`` (= 51 for a = 0.02).

**num_iter = 0 is gated linear attention, exactly**: with ``r = 0`` the solve is skipped and
``x_t := q_t``, hence ``q~_t = q_t`` and ``o_t = U_t q_t * scale`` whatever ``alpha`` is. (Running
zero Chebyshev iterations would instead give ``2 q / (L + mu)``; GKA's "r = 0" ablation means "no
solve", which is what this convention implements.)

Shapes: ``q, k (B, T, H, d_k)``, ``v (B, T, H, d_v)``, ``g (B, T, H)``, ``alpha (B, T, H)`` or None;
``initial_state = (H0 (B, H, d_k, d_k), U0 (B, H, d_v, d_k))`` or None. Returns ``(o (B, T, H, d_v),
(H_T, U_T))``, ``o`` in ``q``'s dtype and the state in :func:`kernels.common.state_dtype` of it (fp32 for
16-bit inputs). :func:`gka_step` is one token; the reference loop is built from it.
"""
from __future__ import annotations

import torch

from ..common import as_state
from ..common import compute_dtype as default_compute_dtype
from .chebyshev import DenseOp, iterative_solve

NORM_FLOOR = 1e-30  # ||H||_F^2 is clamped here before the sqrt (its gradient at H = 0 would be inf)


def ridge(n2: torch.Tensor, ridge_a: float, ridge_eps: float):
    """From ``||H||_F^2``: ``(lam, mu, L)`` = ridge (differentiable) and detached spectrum bounds."""
    nrm = n2.clamp_min(NORM_FLOOR).sqrt()
    lam = ridge_a * nrm + ridge_eps
    mu = lam.detach()
    L = (lam + nrm).detach()
    return lam, mu, L


def mix_query(q, x, alpha, num_iter: int):
    """The alpha-connection ``q + alpha (x - q)`` (``x`` alone when alpha is None; ``q`` when r = 0)."""
    if num_iter == 0:
        return q
    if alpha is None:
        return x
    return q + alpha.unsqueeze(-1) * (x - q)


def dense_solve(H, lam, mu, L, q, *, num_iter: int, solver: str, grad: str):
    """Solve ``(H + lam I) x = q`` for explicit ``H (..., d, d)``."""
    if solver == "exact":
        eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
        A = H + lam[..., None, None] * eye
        return torch.linalg.solve(A, q.unsqueeze(-1)).squeeze(-1)
    return iterative_solve(DenseOp, (H, lam), q, mu, L, num_iter=num_iter, solver=solver, grad=grad)


def gka_step(q_t, k_t, v_t, g_t, alpha_t, state, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6,
             num_iter: int = 30, solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None,
             compute_dtype: torch.dtype | None = None):
    """One token. ``q_t, k_t (B, H, d_k)``, ``v_t (B, H, d_v)``, ``g_t, alpha_t (B, H)`` (alpha may be None),
    ``state = (H (B, H, d_k, d_k), U (B, H, d_v, d_k))``. Returns ``(o_t (B, H, d_v), (H, U))`` with the
    state kept in the compute dtype (fp32, fp64 for fp64 inputs, or ``compute_dtype`` if given)."""
    dtype = q_t.dtype
    cd = default_compute_dtype(dtype) if compute_dtype is None else compute_dtype
    q_t, k_t, v_t, g_t = (t.to(cd) for t in (q_t, k_t, v_t, g_t))
    alpha_t = None if alpha_t is None else alpha_t.to(cd)
    Hs, Us = (s.to(cd) for s in state)
    scale = q_t.shape[-1] ** -0.5 if scale is None else scale
    decay = g_t.exp()[..., None, None]
    Hs = decay * Hs + k_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    Us = decay * Us + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    if num_iter == 0:
        x = q_t
    else:
        lam, mu, L = ridge((Hs * Hs).sum((-1, -2)), ridge_a, ridge_eps)
        x = dense_solve(Hs, lam, mu, L, q_t, num_iter=num_iter, solver=solver, grad=grad)
    qt = mix_query(q_t, x, alpha_t, num_iter)
    o = torch.einsum("bhij,bhj->bhi", Us, qt) * scale
    return o.to(dtype), (Hs, Us)


def gka_reference(q, k, v, g, alpha=None, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6, num_iter: int = 30,
                  solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None,
                  initial_state=None, compute_dtype: torch.dtype | None = None):
    """See the module docstring: the token loop of :func:`gka_step`. ``compute_dtype``: arithmetic dtype
    (default fp32, fp64 for fp64 inputs); pass ``torch.float16`` to run the recurrence and the solver in
    half precision."""
    dtype = q.dtype
    cd = default_compute_dtype(dtype) if compute_dtype is None else compute_dtype
    B, T, Hh, dk = q.shape
    dv = v.shape[-1]
    if initial_state is None:
        state = (q.new_zeros(B, Hh, dk, dk, dtype=cd), q.new_zeros(B, Hh, dv, dk, dtype=cd))
    else:
        state = tuple(s.to(cd) for s in initial_state)
    outs = []
    for t in range(T):
        o_t, state = gka_step(q[:, t], k[:, t], v[:, t], g[:, t], None if alpha is None else alpha[:, t], state,
                              ridge_a=ridge_a, ridge_eps=ridge_eps, num_iter=num_iter, solver=solver, grad=grad,
                              scale=scale, compute_dtype=cd)
        outs.append(o_t)
    o = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, Hh, dv)
    return o, as_state(state, dtype)
