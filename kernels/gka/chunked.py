"""Chunked GKA in pure PyTorch, the ``torch`` backend: ``auto`` runs it on a CPU, and on CUDA for the settings
:mod:`kernels.gka.triton` does not implement (a solver other than Chebyshev, ``grad="autograd"``, a chunk size
that is not a power of two >= 16, fp64). Same contract as :func:`kernels.gka.reference.gka_reference`; its
pieces (:func:`chunk_states`, :func:`frob_norm_sq`, the readout) are the references of the Triton stages.

Per chunk ``c`` of length ``C`` (``G_t`` = inclusive cumulative log decay from the chunk start,
``M_ts = e^{G_t - G_s}`` for ``s <= t``, ``H_0, U_0`` = states before the chunk):

    H_t = e^{G_t} H_0 + sum_{s<=t} M_ts k_s k_s^T        (never formed)
    A_t xi = e^{G_t} H_0 xi + sum_s M_ts (k_s . xi) k_s + lambda_t xi        (ChunkOp.matvec, all t at once)
    ||H_t||_F^2 = e^{2G_t} ||H_0||^2 + 2 e^{G_t} sum_s M_ts k_s^T H_0 k_s + sum_{s,s'} M_ts M_ts' (k_s . k_s')^2
    o_t = scale * (e^{G_t} U_0 q~_t + sum_s M_ts (k_s . q~_t) v_s)
    H_next = e^{G_C} H_0 + sum_s e^{G_C - G_s} k_s k_s^T   (gated chunk-state pass; U likewise)

The mask ``M`` and the decays to the chunk's end are formed from sums over each segment of the per-step decays
(:func:`kernels.common.segment_log_decays`), and every stage hands the mask's gradient back through them (the
solve's as ``dM * M``, :class:`kernels.gka.chebyshev.ChunkOp`): a weak decay after a strong one keeps fp32
accuracy, and a saturated gate's gradient is its own.

Every token of a chunk solves its own system in parallel with the matvec above; the closed-form
Frobenius norm gives ``lambda_t = a ||H_t||_F + eps`` and the Chebyshev bounds without any per-token
``d x d`` matrix. The solve (:mod:`kernels.gka.chebyshev`) and the readout
(:func:`kernels.gla.chunked.gla_chunk_readout`) have hand-written backwards; the chunk-state pass and the norm
are differentiated by autograd. ``solver="exact"`` is the
exception: it materialises every ``H_t`` (``O(T d^2)`` memory) and calls ``torch.linalg.solve``.

Layout inside: heads first, ``(b, h, n, C, d)``, so every product is a batched matmul. The ~2 r
matvecs of a solve reuse one decay mask, one ``e^G`` and contiguous operands (:class:`ChunkOp`).

A sequence longer than :data:`kernels.common.SEGMENT` runs in segments of whole chunks with ``(H, U)``
carried (:func:`kernels.common.in_segments`), so no intermediate grows with the length.

Padding (T not a multiple of C) appends tokens with ``q = k = v = 0`` and ``g = 0``: they leave the
states unchanged and are cut from the output.
"""
from __future__ import annotations

import torch

from ..common import (
    as_state,
    compute_dtype,
    heads_first,
    in_segments,
    pad_time,
    segment_length,
    segment_log_decays,
    time_first,
)
from ..gla.chunked import gla_chunk_readout
from ..scan import chunk_scan
from .chebyshev import ChunkOp, decay_mask, iterative_solve
from .reference import mix_query, ridge


def chunk_states(K, V, G, H_init, U_init, seg=None):
    """Chunk-start states ``(H0 (b, h, n, dk, dk), U0 (b, h, n, dv, dk))`` and the final ``(H, U)``.

    ``K (b, h, n, C, dk)``, ``V (b, h, n, C, dv)``, ``G (b, h, n, C)``; ``seg`` the segment log decays
    (:func:`kernels.common.segment_log_decays`) where the caller has them, for the decays to the chunk's
    end. ``H`` and ``U`` share the decay, so they are passed across chunks together as one ``(dk + dv, dk)``
    state per head by :func:`kernels.scan.chunk_scan`.
    """
    dk = K.shape[-1]
    to_end = (G[..., -1:] - G if seg is None else seg[..., -1, :]).exp().unsqueeze(-1)   # e^{G_C - G_s}
    HUc = (torch.cat([K, V], dim=-1) * to_end).transpose(-1, -2) @ K      # (b, h, n, dk + dv, dk)
    starts, fin = chunk_scan(G[..., -1].exp(), HUc, torch.cat([H_init, U_init], dim=-2))
    dv = HUc.shape[-2] - dk
    # split, not slices: the backward of two slices zero-fills two full-size gradients; a split concatenates
    return (*starts.split([dk, dv], dim=-2), *fin.split([dk, dv], dim=-2))


def frob_norm_sq(H0, K, G, M=None):
    """Closed-form ``||H_t||_F^2`` for every token of every chunk, shape ``(b, h, n, C)``.

    From ``H_t = e^{g_t} H_{t-1} + k_t k_t^T``: ``||H_t||^2 = e^{2 g_t} ||H_{t-1}||^2 + c_t`` with
    ``c_t = 2 k_t^T (H_t - k_t k_t^T) k_t + ||k_t||^4 = 2 e^{G_t} k_t^T H0 k_t + 2 sum_{s<t} M_ts
    (k_s . k_t)^2 + ||k_t||^4``, hence ``||H_t||^2 = e^{2 G_t} ||H0||^2 + sum_{s<=t} M_ts^2 c_s``:
    ``O(C^2)`` per chunk (the expanded double sum ``sum_{s,u} M_ts M_tu (k_s . k_u)^2`` is ``O(C^3)``).
    """
    M = decay_mask(G) if M is None else M
    eG = G.exp()
    h0 = (H0 * H0).sum((-1, -2)).unsqueeze(-1)                            # (b, h, n, 1)
    kHk = ((K @ H0) * K).sum(-1)                                          # k_s^T H0 k_s
    Q = (K @ K.transpose(-1, -2)).pow(2)                                  # (k_s . k_u)^2
    MQ = M * Q
    c = 2 * (eG * kHk + MQ.sum(-1)) - Q.diagonal(dim1=-2, dim2=-1)       # M_ss = 1: 2 x diag - diag
    return eG.pow(2) * h0 + ((M * M) @ c.unsqueeze(-1)).squeeze(-1)


def per_token_H(H0, K, G, M=None):
    """Materialised ``H_t`` (b, h, n, C, dk, dk) — only for ``solver="exact"`` and tests."""
    M = decay_mask(G) if M is None else M
    within = torch.einsum("...ts,...si,...sj->...tij", M, K, K)
    return G.exp()[..., None, None] * H0.unsqueeze(-3) + within


def gka_chunked(q, k, v, g, alpha=None, *, ridge_a: float = 0.02, ridge_eps: float = 1e-6, num_iter: int = 30,
                solver: str = "chebyshev", grad: str = "implicit", scale: float | None = None, chunk_size: int = 64,
                initial_state=None):
    """Chunked GKA (see the module docstring)."""
    dtype = q.dtype
    cd = compute_dtype(dtype)
    b, T, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if initial_state is None:
        state = q.new_zeros(b, h, dk, dk, dtype=cd), q.new_zeros(b, h, dv, dk, dtype=cd)
    else:
        state = tuple(s.to(cd) for s in initial_state)

    def segment(q, k, v, g, alpha, state):
        return _gka_segment(q, k, v, g, alpha, state, ridge_a=ridge_a, ridge_eps=ridge_eps, num_iter=num_iter,
                            solver=solver, grad=grad, scale=scale, chunk_size=chunk_size)

    o, (H_fin, U_fin) = in_segments(segment, (q, k, v, g, alpha), state, segment_length(chunk_size))
    return o.to(dtype), as_state((H_fin, U_fin), dtype)


def _gka_segment(q, k, v, g, alpha, state, *, ridge_a, ridge_eps, num_iter, solver, grad, scale, chunk_size):
    """:func:`gka_chunked` on one segment from the compute-dtype state ``(H, U)``; output in the compute dtype."""
    cd = compute_dtype(q.dtype)
    T, dk = q.shape[1], q.shape[-1]
    H_init, U_init = state
    C = chunk_size
    q, k, v, g = (pad_time(t.to(cd), C) for t in (q, k, v, g))
    # contiguous once: the ~2 r matvecs of the solve would otherwise each copy the strided views
    Q, K, V = (heads_first(t, C).contiguous() for t in (q, k, v))
    g = heads_first(g, C)                                                 # (b, h, n, C)
    G, seg = g.cumsum(-1), segment_log_decays(g)                          # seg: G_t - G_s, summed per segment
    H0, U0, H_fin, U_fin = chunk_states(K, V, G, H_init, U_init, seg)
    H0 = H0.contiguous()
    M = seg.exp()
    if num_iter == 0:
        X = Q
    else:
        lam, mu, L = ridge(frob_norm_sq(H0, K, G, M), ridge_a, ridge_eps)
        if solver == "exact":
            Ht = per_token_H(H0, K, G, M)
            eye = torch.eye(dk, dtype=cd, device=q.device)
            X = torch.linalg.solve(Ht + lam[..., None, None] * eye, Q.unsqueeze(-1)).squeeze(-1)
        else:
            op = ChunkOp(M, G.exp().unsqueeze(-1), fuse=True)   # seg: the mask's gradient reaches each step
            X = iterative_solve(op, (H0, K, G, lam, seg), Q, mu, L, num_iter=num_iter, solver=solver, grad=grad)
    A = None if alpha is None else heads_first(pad_time(alpha.to(cd), C), C)
    Qt = mix_query(Q, X, A, num_iter)
    o = gla_chunk_readout(Qt * scale, K, V, G, U0, M, seg=seg)
    return time_first(o)[:, :T], (H_fin, U_fin)
