"""Chunked gated linear attention in pure PyTorch (CPU default); contract of
:func:`kernels.gla.reference.gla_reference`.

Within chunk c (``G_t`` inclusive cumulative log decay from the chunk start, ``U_0`` the state
before the chunk):
    o_t = scale * (e^{G_t} U_0 q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) v_s)
    U_next = e^{G_C} U_0 + sum_s e^{G_C - G_s} v_s k_s^T
Segment sums ``G_t - G_s`` are formed directly (never ``e^{G_t} / e^{G_s}``).

Layout inside: ``(batch, head, chunk, time-in-chunk, dim)``, so every product is a batched matmul;
the pass of states across chunks is :func:`kernels.common.chunk_scan` (linear in the chunk count,
also in the backward). :func:`gla_chunk_readout` is shared with the GKA family.
"""
from __future__ import annotations

import torch

from ..common import causal_decay_mask, chunk_scan, compute_dtype, heads_first, pad_time, time_first


def gla_chunk_states(K, V, G, initial_state=None):
    """``K (b, h, n, C, dk)``, ``V (b, h, n, C, dv)``, ``G (b, h, n, C)`` -> chunk-start states
    ``U0 (b, h, n, dv, dk)`` and the final state ``(b, h, dv, dk)``."""
    to_end = (G[..., -1:] - G).exp()                                   # e^{G_C - G_s}
    Uc = (V * to_end.unsqueeze(-1)).transpose(-1, -2) @ K             # (b, h, n, dv, dk)
    return chunk_scan(G[..., -1].exp(), Uc, initial_state)


def gla_chunk_readout(Q, K, V, G, M, U0):
    """``o_t = e^{G_t} U_0 q_t + sum_s M_ts (k_s . q_t) v_s`` for every chunk; ``M`` the causal decay
    mask ``(b, h, n, C, C)``; ``Q, K (b, h, n, C, dk)``, ``V (b, h, n, C, dv)``, ``U0 (b, h, n, dv, dk)``."""
    intra = ((Q @ K.transpose(-1, -2)) * M) @ V
    return torch.baddbmm(intra.flatten(0, 2), (G.exp().unsqueeze(-1) * Q).flatten(0, 2),
                         U0.transpose(-1, -2).flatten(0, 2)).view(intra.shape)


def gla_chunked(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None):
    dtype = q.dtype
    cd = compute_dtype(dtype)
    b, T, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    C = chunk_size
    q, k, v, g = (pad_time(t.to(cd), C) for t in (q, k, v, g))
    Q, K, V = (heads_first(t, C) for t in (q * scale, k, v))
    G = heads_first(g, C).cumsum(-1)                                    # (b, h, n, C)
    U0, U = gla_chunk_states(K, V, G, None if initial_state is None else initial_state.to(cd))
    o = gla_chunk_readout(Q, K, V, G, causal_decay_mask(G, dim=-1), U0)
    return time_first(o)[:, :T].to(dtype), U.to(dtype)
