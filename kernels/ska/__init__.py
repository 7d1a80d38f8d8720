"""Spectral Koopman Attention (SKA; Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral
Koopman Operators", arXiv:2605.06997): closed-form ridge regression over streaming
second-order statistics plus a whitened lag-one (Koopman) operator used as a power filter.

Per (batch, head), with keys/queries divided by the key scale s:

    G = sum w_t k_t k_t^T + lambda I,  M = sum w_t w_{t+1} k_{t+1} k_t^T,  C = sum w_t v_t k_t^T
    L = chol(G),  A = clamp(gamma, 1, gamma_max) * A_w / max(sigma(A_w), 1),  A_w = L^{-1} M L^{-T}
    y = C L^{-T} A^p L^{-1} q

Modes (which tokens a position's statistics contain; see :mod:`kernels.ska.reference`):
``prefix`` (all tokens, non-causal), ``chunk_causal`` (chunks strictly before the query's chunk),
``recurrent`` (tokens strictly before the query; = chunk_causal with chunk_size 1).
Normalisation: ``seq_max`` (one scale from the whole sequence, non-causal) or ``running_max``
(the largest key inside the statistics being read; causal).

Public functions:

- :func:`ska` -- the whole op, ``backend`` = ``reference`` (explicit per-position solve, fp64-capable),
  ``torch`` (chunked, CPU default), ``triton`` (the GPU path: statistics, the per-chunk operator and the
  readout in Triton kernels, forward and backward; :mod:`kernels.ska.triton`);
- :func:`ska_chain` -- the post-Cholesky chain ``y = C L^{-T} A^p L^{-1} q`` alone (torch or Triton);
- :func:`ska_step`, :func:`ska_init_state`, :func:`ska_final_state` -- the recurrent decode (the step
  and the recurrent-mode loop built from it live in :mod:`kernels.ska.reference`).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend, triton_fp64_unsupported
from ..common import check_chunk_size, check_layout, full_precision
from .chunked import ska_chunked, ska_final_state
from .operator import ska_chain_torch, solve_operator, whitened_operator
from .reference import ska_init_state, ska_readout, ska_recurrent, ska_reference, ska_step, ska_update

__all__ = ["BACKENDS", "ska", "ska_chain", "ska_chunked", "ska_reference", "ska_recurrent", "ska_step", "ska_readout",
           "ska_update", "ska_init_state", "ska_final_state", "ska_chain_torch", "solve_operator",
           "whitened_operator"]

MODES = ("prefix", "chunk_causal", "recurrent")
NORMALISATIONS = ("seq_max", "running_max")


#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton")
RECURRENT_BACKENDS = ("reference", "torch")  # the recurrent mode is a token loop: no Triton form
@full_precision
def ska(q, k, v, w=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
        mode: str = "chunk_causal", chunk_size: int = 64, normalisation: str = "seq_max", power_iters: int = 6,
        backend: str = "auto"):
    """q, k (B, T, H, r), v (B, T, H, P), w (B, T) 0/1 weights or None -> y (B, T, H, P) in q's dtype.

    ``gamma`` is a float or a tensor (H,) (clamped to [1, gamma_max] inside).
    """
    if mode not in MODES:
        raise ValueError(f"ska: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"ska: unknown normalisation {normalisation!r}; choose seq_max or running_max")
    _check_layout(q, k, v, w, gamma)
    check_chunk_size("ska", chunk_size)
    kw = dict(ridge=ridge, power=power, gamma=gamma, gamma_max=gamma_max, normalisation=normalisation,
              power_iters=power_iters)
    chosen = resolve_backend(backend, q, op="ska", available=RECURRENT_BACKENDS if mode == "recurrent" else BACKENDS,
                             unsupported=triton_fp64_unsupported(q))
    if q.shape[1] == 0:  # an empty sequence: an empty output (every backend's reductions over T refused it)
        return v[:, :0].to(q.dtype).clone()
    if chosen == "reference":  # it computes in q's dtype; the other backends promote k and v to their compute dtype
        return ska_reference(q, k.to(q.dtype), v.to(q.dtype), w, mode=mode, chunk_size=chunk_size, **kw)
    if mode == "recurrent":
        return ska_recurrent(q, k, v, w, **kw)
    if chosen == "triton":
        from .triton import ska_triton
        return ska_triton(q, k, v, w, mode=mode, chunk_size=chunk_size, **kw)
    return ska_chunked(q, k, v, w, mode=mode, chunk_size=chunk_size, **kw)


def _check_layout(q, k, v, w, gamma) -> None:
    """Refuse, in one line naming the tensor, inputs whose shapes disagree: the reference backend broadcast a
    one-head ``v`` and the Triton kernels, which index every tensor by the sizes of ``q``, read a ``k`` of other
    heads out of its bounds, where the chunked backend failed mid-computation."""
    sizes = check_layout("ska", q=(q, "B T H R"), k=(k, "B T H R"), v=(v, "B T H P"), w=(w, "B T"))
    if torch.is_tensor(gamma) and gamma.dim() > 0 and tuple(gamma.shape) not in ((1,), (sizes["H"],)):
        raise ValueError(f"ska: gamma of shape {tuple(gamma.shape)} must be a float, a 0-d tensor or one gain per "
                         f"head, (H,) with H = {sizes['H']}")


def ska_chain(Linv, A, C, q, power: int, chunk_size: int, backend: str = "auto"):
    """``y_t = C_c Linv_c^T A_c^p Linv_c q_t`` with c = t // chunk_size; shapes as in
    :func:`kernels.ska.operator.ska_chain_torch`."""
    chosen = resolve_backend(backend, q, op="ska_chain", available=("torch", "triton"),
                             unsupported=triton_fp64_unsupported(q))
    if chosen == "triton":
        from .triton import ska_chain_triton
        return ska_chain_triton(Linv, A, C, q, power, chunk_size)
    return ska_chain_torch(Linv, A, C, q, power, chunk_size)
