"""Spectral Koopman Attention's solved operator, shared by every SKA path (the reference, the chunked
PyTorch backend and, through it, the Triton backend, and the decode step): Cholesky with jitter, whitening of the
lag-one statistics, power iteration and spectral normalisation, the operator solved from raw statistics, and
the post-Cholesky chain ``y = C L^{-T} A^p L^{-1} q`` in PyTorch. The equations are in
:mod:`kernels.ska.reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import plan_for

JITTERS = tuple(1e-4 * 10.0 ** j for j in range(4))
SCALE_FLOOR = 1e-6


def cholesky_jitter(G: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of the symmetrised ``G`` (..., r, r); on failure retry with
    ``G + 1e-4 * 10^j I`` (j = 0..3) for the failed matrices only (if all fail: the square root of
    the clamped diagonal, finite).

    The jitter is chosen without gradient and the factor recomputed once on the jittered matrix, so
    a failed factorisation never enters the backward pass (its garbage would turn 0 * inf into NaN).
    On the GPU plan the jitter is chosen without reading anything back to the host
    (:func:`_jitter_on_device`); the factor is the same.
    """
    G = 0.5 * (G + G.transpose(-1, -2))
    if plan_for(G).one_pass:
        return _jitter_on_device(G)
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


def _jitter_on_device(G: torch.Tensor) -> torch.Tensor:
    """:func:`cholesky_jitter`'s choice without a host synchronisation: ``G`` and every jittered ``G`` are
    factorised in one batched call and each matrix takes the first that succeeds, by ``torch.where``
    (the jitters enter as Python numbers, as in the branching version, so no host-to-device copy either).
    Where no jitter is needed the factor is that of ``G + 0 I = G``, bit for bit the branching version's."""
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    with torch.no_grad():
        Gd = G.detach()
        ok = torch.linalg.cholesky_ex(torch.stack([Gd] + [Gd + j * eye for j in JITTERS])).info == 0
        jitter = torch.zeros(ok.shape[1:], dtype=G.dtype, device=G.device)
        for i in range(len(JITTERS), 0, -1):          # ends at the smallest jitter that succeeds
            jitter = torch.where(ok[i], JITTERS[i - 1], jitter)
        jitter = torch.where(ok[0], 0.0, jitter)
        bad = ~ok.any(dim=0)
    G_safe = G + jitter[..., None, None] * eye
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


def per_head_gamma(gamma, H: int, ref: torch.Tensor) -> torch.Tensor:
    """``gamma`` (a float or a tensor (H,)) as a tensor (H,) in ``ref``'s dtype and device."""
    g = gamma.to(device=ref.device, dtype=ref.dtype) if torch.is_tensor(gamma) else \
        torch.tensor(float(gamma), device=ref.device, dtype=ref.dtype)
    return g.expand(H) if g.dim() == 0 else g


def solve_operator(G_raw, M_raw, C_raw, s, *, ridge: float, gamma, gamma_max: float, power_iters: int = 6):
    """Raw statistics (..., H, r, r), (..., H, r, r), (..., H, P, r) and scale (..., H) ->
    ``(Linv, A, C)``: ``L^{-1}``, the spectrally normalised whitened operator and ``C / s``."""
    r = G_raw.shape[-1]
    H = G_raw.shape[-3]
    s = s.clamp_min(SCALE_FLOOR)
    s2 = (s * s)[..., None, None]
    eye = torch.eye(r, dtype=G_raw.dtype, device=G_raw.device)
    G = G_raw / s2 + ridge * eye
    L = cholesky_jitter(G)
    X = torch.linalg.solve_triangular(L, M_raw / s2, upper=False)                 # L^{-1} M
    A_w = torch.linalg.solve_triangular(L, X.transpose(-1, -2), upper=False).transpose(-1, -2)
    sigma = top_singular_value(A_w.detach(), power_iters)
    g = per_head_gamma(gamma, H, G_raw).clamp(1.0, gamma_max)
    A = (g / sigma.clamp_min(1.0))[..., None, None] * A_w
    Linv = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)
    return Linv, A, C_raw / s[..., None, None]


def chain_operator(Linv, A, C, power: int):
    """The per-chunk readout operator ``W = C Linv^T A^p Linv`` (..., P, r), in the dtype of the factors."""
    U = C @ Linv.transpose(-1, -2)
    for _ in range(power):
        U = U @ A
    return U @ Linv


def ska_chain_torch(Linv, A, C, q, power: int, chunk_size: int):
    """The post-Cholesky chain ``y_t = C_c L_c^{-T} A_c^p L_c^{-1} q_t``, c = t // chunk_size.

    Linv, A (B, N, H, r, r); C (B, N, H, P, r); q (B, T, H, r) with T <= N * chunk_size (any float dtype:
    it is cast to the factors'). Computed as the per-chunk operator ``W`` (:func:`chain_operator`) applied to
    every query.
    """
    B, T, H, r = q.shape
    N = Linv.shape[1]
    W = chain_operator(Linv, A, C, power)                                           # (B, N, H, P, r)
    qp = F.pad(q.to(W.dtype), (0, 0, 0, 0, 0, N * chunk_size - T)).reshape(B, N, chunk_size, H, r)
    y = torch.einsum("bnhpr,bnchr->bnchp", W, qp)
    return y.reshape(B, N * chunk_size, H, -1)[:, :T]
