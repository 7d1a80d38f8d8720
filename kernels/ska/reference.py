"""Spectral Koopman Attention, the readable spec: for every position, build the statistics it may
see explicitly and solve explicitly. Works in the input dtype (use fp64 as the truth); slow (one
Cholesky per distinct visible set, i.e. per position in recurrent mode).

Per (batch, head), keys/queries ``k_t, q_t`` in R^r, values ``v_t`` in R^P, weights ``w_t``
(a 0/1 prefix or "action" mask; 1 when absent). A position's *visible set* is a prefix
``{0, ..., m-1}`` of the sequence:

- ``prefix``:       m = T for every position (one operator from the whole masked sequence);
- ``chunk_causal``: m = c * chunk_size for a position in chunk c = t // chunk_size (chunks < c);
- ``recurrent``:    m = t (keys ``<= t-1``; position 0 sees nothing).

``chunk_causal`` with chunk_size 1 is therefore ``recurrent``. Over the visible set (raw keys):

    G_raw = sum_{i<m} w_i k_i k_i^T
    M_raw = sum_{i+1<m} w_i w_{i+1} k_{i+1} k_i^T      (lag-one pairs with BOTH tokens visible)
    C_raw = sum_{i<m} w_i v_i k_i^T                    (P x r)

Key scale ``s = max ||k_i||`` over the keys with ``w_i > 0`` in a set, clamped ``>= 1e-6``:
``seq_max`` takes the set over the whole sequence (non-causal, the paper's choice; with ``w = 1``
it is the paper's ``max_t ||k_t||``), ``running_max`` over the visible set (causal: the scale of a
readout is the largest key inside its own statistics). Keys and queries are divided by ``s``; since
the statistics are homogeneous in the keys this equals

    G = G_raw / s^2 + lambda I,   M = M_raw / s^2,   C = C_raw / s,   q <- q / s.

Operator: ``L = chol(sym(G))`` (jitter ``1e-4 * 10^j``, j = 0..3, on failure),
``A_w = L^{-1} M L^{-T}``; ``sigma`` = top singular value of ``A_w`` by ``power_iters`` steps of
power iteration on ``A_w^T A_w`` from the all-ones vector, without gradient;
``A = clamp(gamma, 1, gamma_max) * A_w / max(sigma, 1)``. Readout
``y = C L^{-T} A^p L^{-1} q`` (two triangular solves, p mat-vecs). With p = 0 this is the ridge
regression ``C G^{-1} q``.
"""
from __future__ import annotations

import torch

JITTERS = tuple(1e-4 * 10.0 ** j for j in range(4))
SCALE_FLOOR = 1e-6


def cholesky_jitter(G: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of the symmetrised ``G`` (..., r, r); on failure retry with
    ``G + 1e-4 * 10^j I`` (j = 0..3) for the failed matrices only (if all fail: the square root of
    the clamped diagonal, finite).

    The jitter is chosen without gradient and the factor recomputed once on the jittered matrix, so
    a failed factorisation never enters the backward pass (its garbage would turn 0 * inf into NaN).
    """
    G = 0.5 * (G + G.transpose(-1, -2))
    L, info = torch.linalg.cholesky_ex(G)
    if not bool((info != 0).any()):
        return L
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    with torch.no_grad():
        Gd = G.detach()
        jitter = torch.zeros(info.shape, dtype=G.dtype, device=G.device)
        bad = info != 0
        for j in JITTERS:
            _, info_j = torch.linalg.cholesky_ex(Gd + j * eye)
            fixed = bad & (info_j == 0)
            jitter = torch.where(fixed, torch.full_like(jitter, j), jitter)
            bad = bad & ~fixed
            if not bool(bad.any()):
                break
    G_safe = G + jitter[..., None, None] * eye
    if bool(bad.any()):   # last resort: diagonal of G
        diag = torch.diag_embed(G.diagonal(dim1=-2, dim2=-1).clamp_min(JITTERS[-1]))
        G_safe = torch.where(bad[..., None, None], diag, G_safe)
    return torch.linalg.cholesky_ex(G_safe)[0]


def whitened_operator(G: torch.Tensor, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, A_w)`` with ``L L^T = G`` and ``A_w = L^{-1} M L^{-T}`` (two triangular solves)."""
    L = cholesky_jitter(G)
    X = torch.linalg.solve_triangular(L, M, upper=False)                      # L^{-1} M
    A_w = torch.linalg.solve_triangular(L, X.transpose(-1, -2), upper=False)  # L^{-1} (L^{-1} M)^T
    return L, A_w.transpose(-1, -2)                                           # = L^{-1} M L^{-T}


@torch.no_grad()
def top_singular_value(A: torch.Tensor, iters: int = 6) -> torch.Tensor:
    """Power iteration on ``A^T A`` from the all-ones vector; returns ``||A v||`` (..., ) detached."""
    v = torch.ones(A.shape[:-1], dtype=A.dtype, device=A.device)
    v = v / v.norm(dim=-1, keepdim=True)
    for _ in range(iters):
        u = A @ v.unsqueeze(-1)
        v = (A.transpose(-1, -2) @ u).squeeze(-1)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (A @ v.unsqueeze(-1)).squeeze(-1).norm(dim=-1)


def spectral_normalise(A_w: torch.Tensor, gamma: torch.Tensor, gamma_max: float, iters: int = 6) -> torch.Tensor:
    """``clamp(gamma, 1, gamma_max) * A_w / max(sigma, 1)``; ``gamma`` broadcasts against A_w[..., 0, 0]."""
    sigma = top_singular_value(A_w.detach(), iters)
    g = gamma.clamp(1.0, gamma_max)
    return (g / sigma.clamp_min(1.0))[..., None, None] * A_w


def _gamma(gamma, H, ref) -> torch.Tensor:
    g = torch.as_tensor(gamma, dtype=ref.dtype, device=ref.device)
    return g.to(ref.dtype).expand(H) if g.dim() == 0 else g.to(ref.dtype)


def visible_count(t: int, T: int, mode: str, chunk_size: int) -> int:
    if mode == "prefix":
        return T
    if mode == "chunk_causal":
        return (t // chunk_size) * chunk_size
    if mode == "recurrent":
        return t
    raise ValueError(f"ska: unknown mode {mode!r}; choose prefix, chunk_causal or recurrent")


def _operator(k, v, wk, knorm, m, s_count, ridge, g, gamma_max, power_iters):
    """The explicit statistics of the first ``m`` tokens (scale from the first ``s_count``) and
    their solved operator: (L, A, C, s)."""
    B, T, H, r = k.shape
    dt = k.dtype
    kv, vv, wv = k[:, :m], v[:, :m], wk[:, :m].expand(-1, -1, H)
    G_raw = torch.einsum("bth,bthi,bthj->bhij", wv, kv, kv)
    C_raw = torch.einsum("bth,bthp,bthj->bhpj", wv, vv, kv)
    pair_w = wv[:, 1:] * wv[:, :-1]                                # w_i w_{i+1}, i + 1 < m
    M_raw = torch.einsum("bth,bthi,bthj->bhij", pair_w, kv[:, 1:], kv[:, :-1])
    if s_count > 0:
        s = knorm[:, :s_count].amax(dim=1)
    else:
        s = torch.zeros(B, H, dtype=dt, device=k.device)
    s = s.clamp_min(SCALE_FLOOR)                                   # (B, H)
    G = G_raw / s[..., None, None] ** 2 + ridge * torch.eye(r, dtype=dt, device=k.device)
    M = M_raw / s[..., None, None] ** 2
    C = C_raw / s[..., None, None]
    L, A_w = whitened_operator(G, M)
    A = spectral_normalise(A_w, g, gamma_max, power_iters)
    return L, A, C, s


def ska_reference(q, k, v, w=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
                  mode: str = "chunk_causal", chunk_size: int = 64, normalisation: str = "seq_max",
                  power_iters: int = 6) -> torch.Tensor:
    """q, k (B, T, H, r), v (B, T, H, P), w (B, T) or None -> y (B, T, H, P), computed in the input dtype.

    Positions with the same visible set share one explicitly computed operator (a cache, nothing more).
    """
    if normalisation not in ("seq_max", "running_max"):
        raise ValueError(f"ska: unknown normalisation {normalisation!r}; choose seq_max or running_max")
    B, T, H, r = q.shape
    dt = q.dtype
    w = torch.ones(B, T, dtype=dt, device=q.device) if w is None else w.to(dt)
    wk = w[:, :, None]                                             # (B, T, 1) broadcast over heads
    knorm = k.norm(dim=-1) * (wk > 0).to(dt)                       # (B, T, H): weighted-in keys only
    g = _gamma(gamma, H, q)[None, :]                               # (1, H)
    cache = {}
    ys = []
    for t in range(T):
        m = visible_count(t, T, mode, chunk_size)
        if m not in cache:
            s_count = T if normalisation == "seq_max" else m
            cache = {m: _operator(k, v, wk, knorm, m, s_count, ridge, g, gamma_max, power_iters)}
        L, A, C, s = cache[m]
        z = torch.linalg.solve_triangular(L, (q[:, t] / s[..., None]).unsqueeze(-1), upper=False)  # L^{-1} q
        for _ in range(power):
            z = A @ z
        z = torch.linalg.solve_triangular(L.transpose(-1, -2), z, upper=True)                      # L^{-T} .
        ys.append((C @ z).squeeze(-1))
    return torch.stack(ys, dim=1)
