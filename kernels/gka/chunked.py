"""Chunked GKA in pure PyTorch (the CPU default): same contract as
:func:`kernels.gka.reference.gka_reference`.

Per chunk ``c`` of length ``C`` (``G_t`` = inclusive cumulative log decay from the chunk start,
``M_ts = e^{G_t - G_s}`` for ``s <= t``, ``H_0, U_0`` = states before the chunk):

    H_t = e^{G_t} H_0 + sum_{s<=t} M_ts k_s k_s^T        (never formed)
    A_t xi = e^{G_t} H_0 xi + sum_s M_ts (k_s . xi) k_s + lambda_t xi        (ChunkOp.matvec, all t at once)
    ||H_t||_F^2 = e^{2G_t} ||H_0||^2 + 2 e^{G_t} sum_s M_ts k_s^T H_0 k_s + sum_{s,s'} M_ts M_ts' (k_s . k_s')^2
    o_t = scale * (e^{G_t} U_0 q~_t + sum_s M_ts (k_s . q~_t) v_s)
    H_next = e^{G_C} H_0 + sum_s e^{G_C - G_s} k_s k_s^T   (gated chunk-state pass; U likewise)

Every token of a chunk solves its own system in parallel with the matvec above; the closed-form
Frobenius norm gives ``lambda_t = a ||H_t||_F + eps`` and the Chebyshev bounds without any per-token
``d x d`` matrix. The solve is the only custom-autograd piece (:mod:`kernels.gka.chebyshev`); the
chunk-state pass, the norm and the readout are differentiated by autograd. ``solver="exact"`` is the
exception: it materialises every ``H_t`` (``O(T d^2)`` memory) and calls ``torch.linalg.solve``.

Padding (T not a multiple of C) appends tokens with ``q = k = v = 0`` and ``g = 0``: they leave the
states unchanged and are cut from the output.
"""
from __future__ import annotations

import torch

from ..common import chunk_scan, compute_dtype, pad_time
from .chebyshev import ChunkOp, decay_mask, iterative_solve
from .reference import mix_query, ridge


def _chunk(t, n, C):
    return t.reshape(t.shape[0], n, C, *t.shape[2:])


def chunk_states(Kc, Vc, G, H_init, U_init):
    """Chunk-start states ``(H0 (b, n, h, dk, dk), U0 (b, n, h, dv, dk))`` and the final ``(H, U)``.

    ``H`` and ``U`` share the decay, so they are passed across chunks together as one ``(dk + dv, dk)``
    state per head by :func:`kernels.common.chunk_scan`.
    """
    dk = Kc.shape[-1]
    to_end = (G[:, :, -1:, :] - G).exp()  # (b, n, C, h)
    KV = torch.cat([Kc, Vc], dim=-1)
    HUc = torch.einsum("bnch,bnchi,bnchj->bhnij", to_end, KV, Kc)      # (b, h, n, dk + dv, dk)
    starts, fin = chunk_scan(G[:, :, -1, :].exp().transpose(1, 2), HUc, torch.cat([H_init, U_init], dim=-2))
    starts = starts.transpose(1, 2)                                     # (b, n, h, dk + dv, dk)
    return starts[..., :dk, :], starts[..., dk:, :], fin[..., :dk, :], fin[..., dk:, :]


def frob_norm_sq(H0, Kc, G, M=None):
    """Closed-form ``||H_t||_F^2`` for every token of every chunk, shape ``(b, n, C, h)``."""
    M = decay_mask(G) if M is None else M
    eG = G.exp()
    h0 = (H0 * H0).sum((-1, -2))  # (b, n, h)
    kHk = torch.einsum("bnchi,bnhij,bnchj->bnch", Kc, H0, Kc)  # k_s^T H0 k_s
    cross = torch.einsum("bntsh,bnsh->bnth", M, kHk)
    Q = torch.einsum("bnshd,bnuhd->bnsuh", Kc, Kc).pow(2)  # (k_s . k_s')^2
    quad = (torch.einsum("bntsh,bnsuh->bntuh", M, Q) * M).sum(3)
    return eG.pow(2) * h0.unsqueeze(2) + 2 * eG * cross + quad


def per_token_H(H0, Kc, G, M=None):
    """Materialised ``H_t`` (b, n, C, h, dk, dk) — only for ``solver="exact"`` and tests."""
    M = decay_mask(G) if M is None else M
    within = torch.einsum("bntsh,bnshi,bnshj->bnthij", M, Kc, Kc)
    return G.exp()[..., None, None] * H0.unsqueeze(2) + within


def gka_chunked(q, k, v, g, alpha=None, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6, num_iter: int = 30,
                solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None, chunk_size: int = 64,
                initial_state=None, solve_fn=None):
    """Chunked GKA. ``solve_fn(H0, K, G, lam, mu, L, q, num_iter=, grad=)`` replaces the PyTorch
    Chebyshev solve (the Triton backend plugs in here)."""
    dtype = q.dtype
    cd = compute_dtype(dtype)
    b, T, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if initial_state is None:
        H_init, U_init = q.new_zeros(b, h, dk, dk), q.new_zeros(b, h, dv, dk)
    else:
        H_init, U_init = (s.to(cd) for s in initial_state)
    C = chunk_size
    q, k, v, g = (pad_time(t.to(cd), C) for t in (q, k, v, g))
    alpha = None if alpha is None else pad_time(alpha.to(cd), C)
    n = q.shape[1] // C
    Qc, Kc, Vc = _chunk(q, n, C), _chunk(k, n, C), _chunk(v, n, C)
    G = torch.cumsum(_chunk(g, n, C), dim=2)  # (b, n, C, h)
    H0, U0, H_fin, U_fin = chunk_states(Kc, Vc, G, H_init, U_init)
    M = decay_mask(G)
    if num_iter == 0:
        X = Qc
    else:
        lam, mu, L = ridge(frob_norm_sq(H0, Kc, G, M), ridge_a, ridge_eps)
        if solver == "exact":
            Ht = per_token_H(H0, Kc, G, M)
            eye = torch.eye(dk, dtype=cd, device=q.device)
            X = torch.linalg.solve(Ht + lam[..., None, None] * eye, Qc.unsqueeze(-1)).squeeze(-1)
        elif solve_fn is not None:
            X = solve_fn(H0, Kc, G, lam, mu, L, Qc, num_iter=num_iter, grad=grad)
        else:
            X = iterative_solve(ChunkOp(M), (H0, Kc, G, lam), Qc, mu, L, num_iter=num_iter, solver=solver,
                                grad=grad)
    Qt = mix_query(Qc, X, None if alpha is None else _chunk(alpha, n, C), num_iter)
    inter = G.exp().unsqueeze(-1) * torch.einsum("bnhij,bnchj->bnchi", U0, Qt)
    S = torch.einsum("bnthd,bnshd->bntsh", Qt, Kc) * M
    o = (inter + torch.einsum("bntsh,bnshe->bnthe", S, Vc)) * scale
    o = o.reshape(b, n * C, h, dv)[:, :T]
    return o.to(dtype), (H_fin.to(dtype), U_fin.to(dtype))
