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
import torch.nn.functional as F

from ..common import compute_dtype

State = dict
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


# --- recurrent form (the decode step; the recurrent mode is the token loop built from it) ---------

def _gamma(gamma, H: int, ref: torch.Tensor) -> torch.Tensor:
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
    g = _gamma(gamma, H, G_raw).clamp(1.0, gamma_max)
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


def _prev(x: torch.Tensor) -> torch.Tensor:
    """x shifted one step later in time (dim 1), zero at t = 0."""
    return F.pad(x, (0, 0, 0, 0, 1, 0))[:, :-1]


def ska_init_state(batch: int, heads: int, rank: int, value_dim: int, device=None, dtype=torch.float32) -> State:
    """Empty decode state: raw G, M (B, H, r, r), C (B, H, P, r), kprev (B, H, r), s (B, H)."""
    z = dict(device=device, dtype=dtype)
    return {"G": torch.zeros(batch, heads, rank, rank, **z), "M": torch.zeros(batch, heads, rank, rank, **z),
            "C": torch.zeros(batch, heads, value_dim, rank, **z), "kprev": torch.zeros(batch, heads, rank, **z),
            "s": torch.zeros(batch, heads, **z)}


def ska_readout(q_t, state: State, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
                power_iters: int = 6) -> torch.Tensor:
    """``y_t`` (B, H, P) for query q_t (B, H, r) from the statistics in ``state`` (scale ``state['s']``)."""
    s = state["s"].clamp_min(SCALE_FLOOR)
    Linv, A, Cn = solve_operator(state["G"], state["M"], state["C"], s, ridge=ridge, gamma=gamma,
                                 gamma_max=gamma_max, power_iters=power_iters)
    # the same chain code as the parallel form (one "chunk" of one token, the key scale folded into C), so
    # that both agree to the bit wherever the statistics do: at positions where G is barely above lambda I
    # the chain amplifies fp32 rounding by ~1/lambda
    Cs = (Cn / s[..., None, None])[:, None]
    return ska_chain_torch(Linv[:, None], A[:, None], Cs, q_t.to(Linv.dtype)[:, None], power, 1)[:, 0]


def ska_update(k_t, v_t, state: State, w_t=None, *, normalisation: str = "seq_max") -> State:
    """Add token (k_t (B, H, r), v_t (B, H, P), weight w_t (B,) or None) to the raw statistics."""
    cd = state["G"].dtype
    k_t, v_t = k_t.to(cd), v_t.to(cd)
    w = torch.ones(k_t.shape[0], dtype=cd, device=k_t.device) if w_t is None else w_t.to(cd)
    wk = w[:, None, None] * k_t
    n = k_t.norm(dim=-1) * (w[:, None] > 0).to(cd)
    if normalisation == "running_max":
        s = torch.maximum(state["s"], n)
    elif normalisation == "seq_max":
        s = torch.where(state["s"] > 0, state["s"], n)          # frozen once set
    else:
        raise ValueError(f"ska: unknown normalisation {normalisation!r}; choose seq_max or running_max")
    return {"G": state["G"] + wk.unsqueeze(-1) * k_t.unsqueeze(-2),
            "M": state["M"] + wk.unsqueeze(-1) * state["kprev"].unsqueeze(-2),
            "C": state["C"] + (w[:, None, None] * v_t).unsqueeze(-1) * k_t.unsqueeze(-2),
            "kprev": wk, "s": s}


def ska_step(q_t, k_t, v_t, state: State, w_t=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0,
             gamma_max: float = 1.5, normalisation: str = "seq_max", power_iters: int = 6,
             update: bool = True) -> tuple[torch.Tensor, State]:
    """One token: read out from the tokens before it, then (``update=True``) add it. -> (y_t (B, H, P), state)."""
    y = ska_readout(q_t, state, ridge=ridge, power=power, gamma=gamma, gamma_max=gamma_max,
                    power_iters=power_iters)
    if update:
        state = ska_update(k_t, v_t, state, w_t, normalisation=normalisation)
    return y.to(q_t.dtype), state


def ska_recurrent(q, k, v, w=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
                  normalisation: str = "seq_max", power_iters: int = 6) -> torch.Tensor:
    """The recurrent mode token by token with :func:`ska_step` (position t sees keys <= t-1).

    ``seq_max`` freezes the scale at the whole sequence's value (as the parallel forms do).
    """
    cd = compute_dtype(q.dtype)
    B, T, H, r = q.shape
    state = ska_init_state(B, H, r, v.shape[-1], device=q.device, dtype=cd)
    if normalisation == "seq_max":
        ww = torch.ones(B, T, dtype=cd, device=q.device) if w is None else w.to(cd)
        state["s"] = (k.to(cd).norm(dim=-1) * (ww[:, :, None] > 0).to(cd)).amax(dim=1).clamp_min(SCALE_FLOOR)
    ys = []
    for t in range(T):
        y, state = ska_step(q[:, t], k[:, t], v[:, t], state, None if w is None else w[:, t], ridge=ridge,
                            power=power, gamma=gamma, gamma_max=gamma_max, normalisation=normalisation,
                            power_iters=power_iters)
        ys.append(y)
    return torch.stack(ys, dim=1)
