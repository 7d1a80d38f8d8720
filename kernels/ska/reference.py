"""Spectral Koopman Attention, the readable spec and reference oracle (``backend="reference"``): for every
position, build the statistics it may see explicitly and solve explicitly. Works in the input dtype (use fp64
as the truth); slow (one Cholesky per distinct visible set, i.e. per position in recurrent mode).

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

The decode step (:func:`ska_step`, which a mixer's ``step`` runs) and the recurrent mode's token loop built
from it (:func:`ska_recurrent`, which ``mode="recurrent"`` runs) live here too, beside the spec, as every
family's one-token step does. The operator math that the spec shares with the fast paths (Cholesky with
jitter, whitening, power iteration, the post-Cholesky chain) is :mod:`kernels.ska.operator`.
"""
from __future__ import annotations

import torch

from ..common import compute_dtype
from .operator import SCALE_FLOOR, per_head_gamma, ska_chain_torch, solve_operator, spectral_normalise, whitened_operator

State = dict


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
    g = per_head_gamma(gamma, H, q)[None, :]                               # (1, H)
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
    # the same chain code as the parallel form (one "chunk" of one token, the key scale applied as it does:
    # to fp32 / fp64 queries, or folded into C for 16-bit ones), so that both agree to the bit wherever the
    # statistics do: at positions where G is barely above lambda I the chain amplifies rounding by ~1/lambda
    if q_t.dtype == Linv.dtype:
        Cs, qn = Cn, q_t / s[..., None]
    else:
        Cs, qn = Cn / s[..., None, None], q_t.to(Linv.dtype)
    return ska_chain_torch(Linv[:, None], A[:, None], Cs[:, None], qn[:, None], power, 1)[:, 0]


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
