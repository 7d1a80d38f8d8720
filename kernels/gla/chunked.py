"""Chunked gated linear attention in pure PyTorch, the ``torch`` backend: ``auto`` runs it on a CPU (on CUDA the
Triton stages of :mod:`kernels.gla.triton` or flash-linear-attention run, except for chunk sizes they do not
take and fp64); contract of :func:`kernels.gla.reference.gla_reference`. :func:`gla_chunk_states` and
:func:`gla_chunk_readout` are the references of the Triton state pass and output stage.

Within chunk c (``G_t`` inclusive cumulative log decay from the chunk start, ``U_0`` the state
before the chunk):
    o_t = scale * (e^{G_t} U_0 q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) v_s)
    U_next = e^{G_C} U_0 + sum_s e^{G_C - G_s} v_s k_s^T
The segment sums ``G_t - G_s = sum_{s<r<=t} g_r`` (and ``G_C - G_s``, the decay to the chunk's end) add the
steps inside each segment (:func:`segment_log_decays`), never ``e^{G_t} / e^{G_s}`` nor the difference of the two
cumulative sums, which loses a weak decay that follows a strong one in the chunk and, differentiated, cancels
O(1) terms to leave the gradient of a saturated gate (``g = -50``: ``e^{-50}``-sized) as rounding noise.

Layout inside: ``(batch, head, chunk, time-in-chunk, dim)``, so every product is a batched matmul;
the pass of states across chunks is :func:`kernels.scan.chunk_scan` (linear in the chunk count,
also in the backward). :func:`gla_chunk_readout` is shared with the GKA family.
"""
from __future__ import annotations

import torch

from ..common import (
    as_state,
    compute_dtype,
    cumulative_log_mask,
    heads_first,
    in_segments,
    pad_time,
    segment_length,
    segment_log_decays,
    time_first,
)
from ..scan import chunk_scan


def gla_chunk_states(K, V, G, initial_state=None, seg=None):
    """``K (b, h, n, C, dk)``, ``V (b, h, n, C, dv)``, ``G (b, h, n, C)`` -> chunk-start states
    ``U0 (b, h, n, dv, dk)`` and the final state ``(b, h, dv, dk)``. ``seg`` (:func:`segment_log_decays`, ``(b, h,
    n, C, C)``) gives the decays to the chunk's end where the caller has it (else ``G_C - G_s``)."""
    to_end = (G[..., -1:] - G if seg is None else seg[..., -1, :]).exp()   # e^{G_C - G_s}
    Uc = (V * to_end.unsqueeze(-1)).transpose(-1, -2) @ K             # (b, h, n, dv, dk)
    return chunk_scan(G[..., -1].exp(), Uc, initial_state)


def _sum_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum ``grad`` over the dims that ``like`` broadcasts (size 1 there)."""
    dims = tuple(d for d in range(grad.ndim) if like.shape[d] == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


class _ChunkReadout(torch.autograd.Function):
    """:func:`gla_chunk_readout` with a hand-written backward (see its docstring for the forward).

    The mask enters as its log, ``M = e^seg`` (``seg`` from :func:`segment_log_decays`). With ``P = (Q K^T) * M``
    and ``R = Q U0^T``, ``O = P V + diag(e^G) R``; given ``dO``: ``dP = dO V^T``, ``dQ = (dP * M) K + diag(e^G)
    dO U0``, ``dK = (dP * M)^T Q``, ``dV = P^T dO``, ``dU0 = (diag(e^G) dO)^T Q``, ``dG_t = e^{G_t} (dO_t . R_t)``
    and ``dseg = W = dP * P`` (``dM / dseg = M``), which autograd through ``seg`` takes to the per-step decays
    (each from the segments that hold it).
    When ``Q`` and ``K`` are shared by all heads (head axis of size 1, Mamba-2's single group of ``B``
    and ``C``), ``Q K^T`` is computed once for all heads and ``dP * M`` is summed over the heads before
    the products that give ``dQ`` and ``dK``.
    """

    @staticmethod
    def forward(ctx, Q, K, V, G, seg, U0):
        Q, K, V = Q.contiguous(), K.contiguous(), V.contiguous()
        M = seg.exp()
        S = Q @ K.transpose(-1, -2)
        P = S.mul_(M) if S.shape == M.shape else S * M
        R = Q @ U0.transpose(-1, -2)
        eG = G.exp().unsqueeze(-1)
        O = torch.addcmul(P @ V, eG, R)
        ctx.save_for_backward(Q, K, V, eG, U0, M, P, R)
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, eG, U0, M, P, R = ctx.saved_tensors
        dO = dO.contiguous()
        dP = dO @ V.transpose(-1, -2)
        W = dP * P
        dS = dP.mul_(M)
        eGdO = eG * dO
        if Q.shape[1] == 1 and K.shape[1] == 1 and dS.shape[1] > 1:    # shared by the heads
            dS = dS.sum(1, keepdim=True)
            dQ = dS @ K + (eGdO @ U0).sum(1, keepdim=True)
            dK = dS.transpose(-1, -2) @ Q
        else:
            dQ = _sum_to(torch.addcmul(dS @ K, eG, dO @ U0), Q)
            dK = _sum_to(dS.transpose(-1, -2) @ Q, K)
        dV = P.transpose(-1, -2) @ dO
        dU0 = eGdO.transpose(-1, -2) @ Q
        dG = (eGdO * R).sum(-1)
        return dQ, dK, dV, dG, W, dU0


def gla_chunk_readout(Q, K, V, G, U0, M=None, seg=None):
    """``o_t = e^{G_t} U_0 q_t + sum_s M_ts (k_s . q_t) v_s`` for every chunk; ``Q, K (b, h, n, C, dk)``
    (or one head shared by all, ``(b, 1, n, C, dk)``), ``V (b, h, n, C, dv)``, ``G (b, h, n, C)``,
    ``U0 (b, h, n, dv, dk)``; ``seg`` the log of the mask (:func:`segment_log_decays` of the per-step decays,
    ``(b, h, n, C, C)``), else formed from ``G``; ``M`` the mask if already computed (it is recomputed inside
    when gradients are needed)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (Q, K, V, G, U0, seg)):
        return _ChunkReadout.apply(Q, K, V, G, cumulative_log_mask(G) if seg is None else seg, U0)
    if M is None:
        M = (cumulative_log_mask(G) if seg is None else seg).exp()
    return torch.addcmul(((Q @ K.transpose(-1, -2)) * M) @ V, G.exp().unsqueeze(-1), Q @ U0.transpose(-1, -2))


class _SharedChunkReadout(torch.autograd.Function):
    """The chunk readout when one query/key head is shared by all ``H`` value heads, in the time-major
    layout: ``Q, K (b, n, C, dk)``, ``V (b, n, C, H, dv)``, ``G (b, n, C, H)``, ``U0 (b, n, H*dv, dk)``
    (the heads' chunk-start states side by side); returns ``O (b, n, C, H, dv)``.

    Same equations as :class:`_ChunkReadout`, with ``seg (b, n, H, C, C)``. The inter-chunk term ``Q U0^T`` is
    one matmul for all heads at once, ``(C, dk) @ (dk, H*dv)`` per chunk, and comes out in the output's layout
    (per head it would repeat ``Q`` for every head and run ``H`` times smaller products); ``Q K^T`` is formed
    once per chunk, and in the backward ``dS = dP * M`` is summed over the heads before the products that
    give ``dQ`` and ``dK``.
    """

    @staticmethod
    def forward(ctx, Q, K, V, G, seg, U0):
        b, n, C, H, dv = V.shape
        S = Q @ K.transpose(-1, -2)                                     # (b, n, C, C)
        M = seg.exp()                                                   # (b, n, H, C, C)
        P = M * S.unsqueeze(2)
        Vh = V.transpose(2, 3).contiguous()                              # (b, n, H, C, dv), copied once
        R = (Q @ U0.transpose(-1, -2)).unflatten(-1, (H, dv))           # (b, n, C, H, dv)
        eG = G.exp().unsqueeze(-1)
        O = R * eG
        O += (P @ Vh).transpose(2, 3)
        ctx.save_for_backward(Q, K, Vh, eG, U0, M, P, R)
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, Vh, eG, U0, M, P, R = ctx.saved_tensors
        dO = dO.contiguous()
        eGdO = eG * dO
        eGdO_flat = eGdO.flatten(-2)                                     # (b, n, C, H*dv)
        dU0 = eGdO_flat.transpose(-1, -2) @ Q
        dQ = eGdO_flat @ U0
        dG = (eGdO * R).sum(-1)                                          # (b, n, C, H)
        dOh = dO.transpose(2, 3).contiguous()                            # (b, n, H, C, dv)
        dP = dOh @ Vh.transpose(-1, -2)                                  # (b, n, H, C, C)
        W = dP * P
        dS = dP.mul_(M).sum(2)
        dQ += dS @ K
        dK = dS.transpose(-1, -2) @ Q
        dV = (P.transpose(-1, -2) @ dOh).transpose(2, 3)
        return dQ, dK, dV, dG, W, dU0


def _gla_chunked_shared(q, k, v, g, C, initial_state):
    """:func:`gla_chunked` for ``q, k (B, T', 1, d_k)`` shared by the ``H`` heads of ``v (B, T', H, d_v)``,
    ``T'`` a multiple of ``C``, already scaled and in the compute dtype; every tensor stays time-major."""
    b, Tp, H, dv = v.shape
    n, dk = Tp // C, q.shape[-1]
    Q, K = q.reshape(b, n, C, dk), k.reshape(b, n, C, dk)
    V = v.reshape(b, n, C, H, dv)
    g = g.reshape(b, n, C, H)
    G = g.cumsum(2)
    seg = segment_log_decays(g.transpose(-1, -2))                        # (b, n, H, C, C)
    to_end = seg[..., -1, :].transpose(-1, -2).exp()                     # e^{G_C - G_s}, (b, n, C, H)
    Uc = (V * to_end.unsqueeze(-1)).flatten(-2).transpose(-1, -2) @ K    # (b, n, H*dv, dk)
    # chunk_scan's chunk-start states come back as a (b, H, n, ...) view of (n, b, H, ...) storage, so
    # for b = 1 the (b, n, H*dv, dk) layout of the readout is a view as well
    U0, U = chunk_scan(G[:, :, -1].exp().transpose(1, 2), Uc.unflatten(2, (H, dv)).transpose(1, 2), initial_state)
    o = _SharedChunkReadout.apply(Q, K, V, G, seg, U0.transpose(1, 2).flatten(2, 3))
    return o.reshape(b, Tp, H, dv), U


def gla_chunked(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None):
    """``q, k (B, T, H, d_k)`` (or ``(B, T, 1, d_k)``: one query/key head shared by all ``H`` value heads),
    ``v (B, T, H, d_v)``, ``g (B, T, H)``; returns ``(o (B, T, H, d_v), U_T (B, H, d_v, d_k))``.

    A sequence longer than :data:`kernels.common.SEGMENT` runs segment by segment (whole chunks) with the
    state carried over (:func:`kernels.common.in_segments`), so every full-length intermediate (decay masks,
    chunk states, their gradients) is at most one segment long; the result is the same function."""
    dtype = q.dtype
    h0 = None if initial_state is None else initial_state.to(compute_dtype(dtype))

    def segment(q, k, v, g, U):
        return _gla_chunked(q, k, v, g, scale, chunk_size, U)

    o, U = in_segments(segment, (q, k, v, g), h0, segment_length(chunk_size))
    return o.to(dtype), as_state(U, dtype)


def _gla_chunked(q, k, v, g, scale, chunk_size, initial_state):
    """One segment from the compute-dtype state ``initial_state``; output and state in the compute dtype."""
    cd = compute_dtype(q.dtype)
    b, T, _, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    C = chunk_size
    q, k, v, g = (pad_time(t.to(cd), C) for t in (q, k, v, g))
    h0 = None if initial_state is None else initial_state.to(cd)
    if q.shape[2] == 1 and k.shape[2] == 1 and v.shape[2] > 1:
        o, U = _gla_chunked_shared(q if scale == 1.0 else q * scale, k, v, g, C, h0)
        return o[:, :T], U
    Q, K, V = (heads_first(t, C) for t in (q if scale == 1.0 else q * scale, k, v))
    g = heads_first(g, C)                                               # (b, h, n, C)
    G, seg = g.cumsum(-1), segment_log_decays(g)
    U0, U = gla_chunk_states(K, V, G, h0, seg)
    o = gla_chunk_readout(Q, K, V, G, U0, seg=seg)
    return time_first(o)[:, :T], U
