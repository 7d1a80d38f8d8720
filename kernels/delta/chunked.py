"""Chunked (WY / UT-transform) gated delta product in pure PyTorch: the CPU path of the ``delta`` family.

DeltaProduct as a delta rule on a longer sequence: the ``n_h`` sub-steps of every token are laid
out one after another (a sequence of ``L = n_h * T`` steps, token-major, the layout of ``k``, ``v``,
``beta`` already), the log forget gate ``g_t`` sits on sub-step 0 (zero on the others), the query
sits on the last sub-step (zero on the others) and the output is read at every ``n_h``-th position.

Gated delta rule on positions ``s`` (log gate ``gamma_s <= 0``):
``S_s = exp(gamma_s) (I - beta_s k_s k_s^T) S_{s-1} + beta_s k_s v_s^T``, ``o_s = S_s^T q_s``.

Within a chunk of ``C`` positions with entry state ``S0`` and in-chunk cumulative log gate
``G_r = sum_{i <= r} gamma_i`` the state is ``S_r = e^{G_r} S0 + sum_{i <= r} e^{G_r - G_i} k_i d_i^T``
where the "residual" rows ``d_i = beta_i (v_i - e^{gamma_i} S_{i-1}^T k_i)`` solve a unit lower
triangular system (the UT transform):

    (I + A) D = diag(beta) V - diag(beta e^G) K S0,   A_ri = beta_r e^{G_r - G_i} k_r.k_i  (i < r)
    =>  D = U - W S0,   U = (I + A)^{-1} diag(beta) V,   W = (I + A)^{-1} diag(beta e^G) K

and then

    O      = diag(e^G) Q S0 + ((Q K^T) * M) D,        M_ri = e^{G_r - G_i} for i <= r, else 0
    S_next = e^{G_C} S0 + (diag(e^{G_C - G}) K)^T D.

Everything is computed in fp32 at least (fp64 stays fp64) and differentiated by autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import compute_dtype, flatten_substeps


def interleave_inputs(q, g, num_householder: int, L: int):
    """Queries on the last sub-step and the gate on sub-step 0 of each token, zero elsewhere.

    ``q``: ``(B, T, H, K)`` -> ``(B, T*n_h, H, K)``; ``g``: ``(B, T, H)`` -> ``(B, T*n_h, H)`` (or None).
    """
    B, T, H, K = q.shape
    n = num_householder
    if n == 1:
        return q, g
    q_new = F.pad(q.unsqueeze(2), (0, 0, 0, 0, n - 1, 0))       # (B, T, n, H, K), q at index n-1
    q_new = q_new.reshape(B, L, H, K)
    if g is not None:
        g = F.pad(g.unsqueeze(2), (0, 0, 0, n - 1)).reshape(B, L, H)  # g at index 0
    return q_new, g


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule above on ``(B, L, H, D)`` inputs (``q`` already scaled).

    Returns ``o`` ``(B, L, H, V)`` and the final state ``(B, H, K, V)``, both in the compute dtype.
    """
    B, L, H, K = k.shape
    V = v.shape[-1]
    C = int(chunk_size)
    if C <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dt = compute_dtype(q, k, v, beta, gamma, initial_state)
    pad = (-L) % C
    N = (L + pad) // C

    def prep(x, last):  # (B, L, H, *last) -> (B, H, N, C, *last) in the compute dtype
        x = x.to(dt)
        if pad:
            x = F.pad(x, (0, 0) * len(last) + (0, 0, 0, pad))
        perm = (0, 2, 1) + tuple(range(3, 3 + len(last)))
        return x.permute(*perm).reshape(B, H, N, C, *last)

    q_, k_, v_ = prep(q, (K,)), prep(k, (K,)), prep(v, (V,))
    b_ = prep(beta, ())
    gam = prep(gamma, ()) if gamma is not None else torch.zeros_like(b_)
    G = gam.cumsum(-1)                                                    # (B,H,N,C)
    idx = torch.arange(C, device=k.device)
    incl = idx[:, None] >= idx[None, :]                                   # i <= r
    strict = idx[:, None] > idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    M = torch.exp(diff.masked_fill(~incl, float("-inf")))                 # e^{G_r - G_i}, i <= r
    KK = k_ @ k_.transpose(-1, -2)
    A = (b_[..., :, None] * M * KK).masked_fill(~strict, 0.0)
    eG = G.exp()
    rhs = torch.cat([b_[..., None] * v_, (b_ * eG)[..., None] * k_], dim=-1)
    eye = torch.eye(C, dtype=dt, device=k.device)
    UW = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    QKm = (q_ @ k_.transpose(-1, -2)) * M                                 # masked by M (zero above)
    Qg = eG[..., None] * q_
    Kd = torch.exp(G[..., -1:] - G)[..., None] * k_                      # e^{G_C - G_i} k_i
    gC = eG[..., -1]                                                      # (B,H,N)

    S = q_.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for c in range(N):
        D = U[:, :, c] - W[:, :, c] @ S
        outs.append(Qg[:, :, c] @ S + QKm[:, :, c] @ D)
        S = gC[:, :, c, None, None] * S + Kd[:, :, c].transpose(-1, -2) @ D
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :L].transpose(1, 2)
    return o, S


def delta_product_chunked(
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
    """Gated delta product (layout of :mod:`kernels.delta.reference`) via the chunked delta rule."""
    return delta_product_via_rule(chunk_gated_delta_rule_torch, q, k, v, beta, g, num_householder, scale,
                                  initial_state, chunk_size)


def delta_product_via_rule(rule, q, k, v, beta, g, num_householder, scale, initial_state, chunk_size):
    """Interleave the ``n_h`` sub-steps into one sequence ``n_h * T`` long (gate on sub-step 0, query on the
    last), run the chunked gated delta ``rule`` over it, and read every ``n_h``-th output."""
    B, T, H, K = q.shape
    n = num_householder
    k = flatten_substeps(k, n, T, "k")
    v = flatten_substeps(v, n, T, "v")
    beta = flatten_substeps(beta, n, T, "beta")
    scale = K ** -0.5 if scale is None else scale
    q_up = q.to(torch.promote_types(q.dtype, torch.float32))
    qi, gi = interleave_inputs(q_up * scale, g, n, T * n)
    o, S = rule(qi, k, v, beta, gi, initial_state, chunk_size)
    o = o[:, n - 1::n] if n > 1 else o
    return o.to(q.dtype), S


def delta_product_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    beta_t: torch.Tensor,
    g_t: torch.Tensor | None,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: ``q_t`` ``(B, H, K)``, ``k_t`` ``(B, n_h, H, K)``, ``v_t``
    ``(B, n_h, H, V)``, ``beta_t`` ``(B, n_h, H)``, ``g_t`` ``(B, H)`` or None, ``state`` ``(B, H, K, V)``.

    Returns ``(o_t (B, H, V) in q_t's dtype, new state in the compute dtype)``.
    """
    K = q_t.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dt = compute_dtype(q_t, k_t, v_t, beta_t, g_t, state)
    S = state.to(dt)
    if g_t is not None:
        S = S * g_t.to(dt).exp()[..., None, None]
    for j in range(k_t.shape[1]):
        kj, vj, bj = k_t[:, j].to(dt), v_t[:, j].to(dt), beta_t[:, j].to(dt)
        resid = vj - torch.einsum("bhkv,bhk->bhv", S, kj)
        S = S + bj[..., None, None] * kj[..., :, None] * resid[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, q_t.to(dt)) * scale
    return o.to(q_t.dtype), S
