"""Spectral Koopman Attention, the fast pure-PyTorch path: the ``torch`` backend, which ``auto`` runs on a CPU; on
CUDA ``auto`` runs the ``triton`` backend (:mod:`kernels.ska.triton`: the same function in Triton kernels; above
their largest rank, this function with the post-Cholesky chain in Triton).

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
- the post-Cholesky chain ``y = C L^{-T} A^p L^{-1} (q / s)`` (:func:`ska_chain_torch`; the Triton
  backend above its kernels' rank swaps in :func:`kernels.ska.triton.ska_chain_triton`); bf16 / fp16
  queries enter the chain as given, for 16-bit products, with the key scale ``s`` folded into ``C`` instead.

The recurrent form (decode step, :func:`kernels.ska.reference.ska_step`) lives beside the spec: the state
holds the *raw* statistics ``G, M, C`` (unnormalised keys), the previous weighted key ``w_{t-1} k_{t-1}``
and the scale ``s``; every step reads out from the statistics of the tokens before it (normalised by ``s``
at readout time) and then adds its own token. ``s`` is the running max of weighted-in key norms for
``running_max``; for ``seq_max`` it is frozen once set (by the prefill; a decode from an empty state takes
the first weighted-in nonzero key norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import compute_dtype, full_precision, pad_time
from .operator import SCALE_FLOOR, ska_chain_torch, solve_operator
from .reference import State


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
    cd = compute_dtype(q.dtype)
    q_in = q                          # the chain takes the queries as given (bf16 queries: 16-bit products)
    k, v = k.to(cd), v.to(cd)
    B, T, H, r = q.shape
    w = torch.ones(B, T, dtype=cd, device=k.device) if w is None else w.to(cd)
    wk = w[:, :, None, None] * k                                        # w_t k_t
    kprev = _prev(wk)                                                   # w_{t-1} k_{t-1}
    knorm = k.norm(dim=-1) * (w[:, :, None] > 0).to(cd)                 # (B, T, H)

    if mode == "prefix":
        cs, N = T, 1
    else:
        cs, N = chunk_size, -(-T // chunk_size)
    def chunks(x):
        return (pad_time(x, cs) if cs else x).reshape(B, N, cs, H, x.shape[-1])
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
            cmax = pad_time(knorm, cs).reshape(B, N, cs, H).amax(dim=2)             # (B, N, H)
            s = torch.cummax(F.pad(cmax, (0, 0, 1, 0))[:, :-1], dim=1).values        # exclusive
    s = s.clamp_min(SCALE_FLOOR)
    Linv, A, Cn = solve_operator(G, M, C, s, ridge=ridge, gamma=gamma, gamma_max=gamma_max,
                                 power_iters=power_iters)
    if q_in.dtype == cd:  # fp32 / fp64 queries: divided by the key scale in the compute dtype, as the spec does
        s_tok = s.repeat_interleave(cs, dim=1)[:, :T]                   # (B, T, H)
        y = chain(Linv, A, Cn, q_in / s_tok[..., None], power, cs)
    else:  # 16-bit queries enter the chain as given (16-bit products): the key scale is folded into C instead
        y = chain(Linv, A, Cn / s[..., None, None], q_in, power, cs)
    return y.to(out_dtype)


@full_precision
def ska_final_state(k, v, w=None) -> State:
    """The decode state after consuming k (B, T, H, r), v (B, T, H, P) with weights w (B, T), fast.

    ``s`` is the max weighted-in key norm (the prefill's ``seq_max`` scale, and also the running max). The sums
    are computed and returned in fp32 under autocast too: decoding keeps adding to them.
    """
    cd = compute_dtype(k.dtype)
    k, v = k.to(cd), v.to(cd)
    B, T, H, r = k.shape
    w = torch.ones(B, T, dtype=cd, device=k.device) if w is None else w.to(cd)
    wk = w[:, :, None, None] * k
    return {"G": torch.einsum("bthi,bthj->bhij", wk, k),
            "M": torch.einsum("bthi,bthj->bhij", wk, _prev(wk)),
            "C": torch.einsum("bthp,bthj->bhpj", v * w[:, :, None, None], k),
            "kprev": wk[:, -1],
            "s": (k.norm(dim=-1) * (w[:, :, None] > 0).to(cd)).amax(dim=1)}


