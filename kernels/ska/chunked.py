"""Spectral Koopman Attention, the fast pure-PyTorch path (CPU default) and the recurrent decode.

Same function as :mod:`kernels.ska.reference` (read its docstring for the equations and the exact
visible sets), computed batched in fp32 (fp64 stays fp64):

- statistics per chunk by einsum; the lag-one term of token ``t`` is ``w_t k_t (w_{t-1} k_{t-1})^T``
  and belongs to the chunk of ``t`` (the *later* token), so the pair that crosses from chunk j-1
  into chunk j (the paper's boundary term) is part of chunk j's sum. An exclusive prefix sum over
  chunks then gives chunk c exactly the pairs whose both tokens lie in chunks < c;
- the key scale per chunk: ``seq_max`` one value per (batch, head), ``running_max`` an exclusive
  running max of the per-chunk maxima (the largest key inside the chunk's statistics);
- one batched Cholesky per (batch, chunk, head) with jitter fallback (``cholesky_ex``), triangular
  solves for ``A_w = L^{-1} M L^{-T}`` and ``L^{-1}``, detached power iteration, ``gamma`` clamp;
- the post-Cholesky chain ``y = C L^{-T} A^p L^{-1} q`` (:func:`ska_chain_torch`; the Triton
  backend swaps in :func:`kernels.ska.triton.ska_chain_triton`).

Recurrent form (decode): the state holds the *raw* statistics ``G, M, C`` (unnormalised keys), the
previous weighted key ``w_{t-1} k_{t-1}`` and the scale ``s``; every step reads out from the
statistics of the tokens before it (normalised by ``s`` at readout time) and then adds its own token.
``s`` is the running max of weighted-in key norms for ``running_max``; for ``seq_max`` it is frozen
once set (by the prefill; a decode from an empty state takes the first weighted-in nonzero key norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import SCALE_FLOOR, cholesky_jitter, top_singular_value

State = dict


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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


def ska_chain_torch(Linv, A, C, q, power: int, chunk_size: int):
    """The post-Cholesky chain ``y_t = C_c L_c^{-T} A_c^p L_c^{-1} q_t``, c = t // chunk_size.

    Linv, A (B, N, H, r, r); C (B, N, H, P, r); q (B, T, H, r) with T <= N * chunk_size.
    Computed as the per-chunk operator ``W = C Linv^T A^p Linv`` applied to every query.
    """
    B, T, H, r = q.shape
    N = Linv.shape[1]
    U = C @ Linv.transpose(-1, -2)
    for _ in range(power):
        U = U @ A
    W = U @ Linv                                                                    # (B, N, H, P, r)
    qp = F.pad(q, (0, 0, 0, 0, 0, N * chunk_size - T)).reshape(B, N, chunk_size, H, r)
    y = torch.einsum("bnhpr,bnchr->bnchp", W, qp)
    return y.reshape(B, N * chunk_size, H, -1)[:, :T]


def _prev(x: torch.Tensor) -> torch.Tensor:
    """x shifted one step later in time (dim 1), zero at t = 0."""
    return F.pad(x, (0, 0, 0, 0, 1, 0))[:, :-1]


def _exclusive_cumsum(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    # (torch's CPU cumsum accumulates fp32 in double, so it may differ from the decode's running fp32
    # sums in the last bit; the readout amplifies that by up to ~1/ridge where G is barely above ridge*I)
    z = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([z, x.narrow(dim, 0, x.shape[dim] - 1)], dim=dim).cumsum(dim)


def ska_chunked(q, k, v, w=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
                mode: str = "chunk_causal", chunk_size: int = 64, normalisation: str = "seq_max",
                power_iters: int = 6, chain=None) -> torch.Tensor:
    """q, k (B, T, H, r), v (B, T, H, P), w (B, T) or None -> y (B, T, H, P) in q's dtype.

    ``mode`` is ``prefix`` or ``chunk_causal`` (``recurrent`` is :func:`ska_recurrent`, or
    ``chunk_causal`` with chunk_size 1). ``chain`` replaces :func:`ska_chain_torch`.
    """
    if normalisation not in ("seq_max", "running_max"):
        raise ValueError(f"ska: unknown normalisation {normalisation!r}; choose seq_max or running_max")
    if mode not in ("prefix", "chunk_causal"):
        raise ValueError(f"ska_chunked: mode must be prefix or chunk_causal, got {mode!r} "
                         f"(recurrent = ska_recurrent, or chunk_causal with chunk_size=1)")
    if chunk_size < 1:
        raise ValueError(f"ska: chunk_size must be >= 1, got {chunk_size}")
    chain = ska_chain_torch if chain is None else chain
    out_dtype = q.dtype
    cd = _compute_dtype(q)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    B, T, H, r = q.shape
    w = torch.ones(B, T, dtype=cd, device=q.device) if w is None else w.to(cd)
    wk = w[:, :, None, None] * k                                        # w_t k_t
    kprev = _prev(wk)                                                   # w_{t-1} k_{t-1}
    knorm = k.norm(dim=-1) * (w[:, :, None] > 0).to(cd)                 # (B, T, H)

    if mode == "prefix":
        cs, N = T, 1
    else:
        cs, N = chunk_size, -(-T // chunk_size)
    pad = N * cs - T
    def chunks(x):
        return F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(B, N, cs, H, x.shape[-1])
    kc, wkc, kpc = chunks(k), chunks(wk), chunks(kprev)
    G = torch.einsum("bnchi,bnchj->bnhij", wkc, kc)
    M = torch.einsum("bnchi,bnchj->bnhij", wkc, kpc)
    C = torch.einsum("bnchp,bnchj->bnhpj", chunks(v * w[:, :, None, None]), kc)
    if mode == "prefix":
        s = knorm.amax(dim=1)[:, None]                                  # (B, 1, H)
    else:
        G, M, C = _exclusive_cumsum(G), _exclusive_cumsum(M), _exclusive_cumsum(C)
        if normalisation == "seq_max":
            s = knorm.amax(dim=1)[:, None].expand(B, N, H)
        else:
            cmax = F.pad(knorm, (0, 0, 0, pad)).reshape(B, N, cs, H).amax(dim=2)   # (B, N, H)
            s = torch.cummax(F.pad(cmax, (0, 0, 1, 0))[:, :-1], dim=1).values        # exclusive
    s = s.clamp_min(SCALE_FLOOR)
    Linv, A, Cn = solve_operator(G, M, C, s, ridge=ridge, gamma=gamma, gamma_max=gamma_max,
                                 power_iters=power_iters)
    s_tok = s.repeat_interleave(cs, dim=1)[:, :T]                       # (B, T, H)
    y = chain(Linv, A, Cn, q / s_tok[..., None], power, cs)
    return y.to(out_dtype)


# --- recurrent form --------------------------------------------------------------------------------

def ska_init_state(batch: int, heads: int, rank: int, value_dim: int, device=None, dtype=torch.float32) -> State:
    """Empty decode state: raw G, M (B, H, r, r), C (B, H, P, r), kprev (B, H, r), s (B, H)."""
    z = dict(device=device, dtype=dtype)
    return {"G": torch.zeros(batch, heads, rank, rank, **z), "M": torch.zeros(batch, heads, rank, rank, **z),
            "C": torch.zeros(batch, heads, value_dim, rank, **z), "kprev": torch.zeros(batch, heads, rank, **z),
            "s": torch.zeros(batch, heads, **z)}


def ska_final_state(k, v, w=None) -> State:
    """The decode state after consuming k (B, T, H, r), v (B, T, H, P) with weights w (B, T), fast.

    ``s`` is the max weighted-in key norm (the prefill's ``seq_max`` scale, and also the running max).
    """
    cd = _compute_dtype(k)
    k, v = k.to(cd), v.to(cd)
    B, T, H, r = k.shape
    w = torch.ones(B, T, dtype=cd, device=k.device) if w is None else w.to(cd)
    wk = w[:, :, None, None] * k
    return {"G": torch.einsum("bthi,bthj->bhij", wk, k),
            "M": torch.einsum("bthi,bthj->bhij", wk, _prev(wk)),
            "C": torch.einsum("bthp,bthj->bhpj", v * w[:, :, None, None], k),
            "kprev": wk[:, -1],
            "s": (k.norm(dim=-1) * (w[:, :, None] > 0).to(cd)).amax(dim=1)}


def ska_readout(q_t, state: State, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
                power_iters: int = 6) -> torch.Tensor:
    """``y_t`` (B, H, P) for query q_t (B, H, r) from the statistics in ``state`` (scale ``state['s']``)."""
    s = state["s"].clamp_min(SCALE_FLOOR)
    Linv, A, Cn = solve_operator(state["G"], state["M"], state["C"], s, ridge=ridge, gamma=gamma,
                                 gamma_max=gamma_max, power_iters=power_iters)
    # the same chain code as the parallel form (one "chunk" of one token), so that both agree to the bit
    # wherever the statistics do: at positions where G is barely above lambda I the chain amplifies fp32
    # rounding by ~1/lambda
    qn = (q_t.to(Linv.dtype) / s[..., None])[:, None]
    return ska_chain_torch(Linv[:, None], A[:, None], Cn[:, None], qn, power, 1)[:, 0]


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
    cd = _compute_dtype(q)
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
