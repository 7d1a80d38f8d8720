"""Chunked gated linear attention in pure PyTorch (CPU default); contract of
:func:`kernels.gla.reference.gla_reference`.

Within chunk c (``G_t`` inclusive cumulative log decay from the chunk start, ``U_0`` the state
before the chunk):
    o_t = scale * (e^{G_t} U_0 q_t + sum_{s<=t} e^{G_t - G_s} (k_s . q_t) v_s)
    U_next = e^{G_C} U_0 + sum_s e^{G_C - G_s} v_s k_s^T
Segment sums ``G_t - G_s`` are formed directly (never ``e^{G_t} / e^{G_s}``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gla_chunked(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None):
    dtype = q.dtype
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, g = (t.to(cd) for t in (q, k, v, g))
    b, T, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
    n = (T + pad) // C
    Qc, Kc, Vc = (t.reshape(b, n, C, h, -1) for t in (q, k, v))
    G = torch.cumsum(g.reshape(b, n, C, h), dim=2)
    seg = G.unsqueeze(3) - G.unsqueeze(2)  # (b, n, t, s, h)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[None, None, :, :, None]
    M = torch.where(causal, seg, torch.full_like(seg, float("-inf"))).exp()
    to_end = (G[:, :, -1:, :] - G).exp()
    Uc = torch.einsum("bnch,bnchi,bnchj->bnhij", to_end, Vc, Kc)
    chunk_decay = G[:, :, -1, :].exp()
    U = q.new_zeros(b, h, dv, dk) if initial_state is None else initial_state.to(cd)
    starts = []
    for c in range(n):
        starts.append(U)
        U = chunk_decay[:, c, :, None, None] * U + Uc[:, c]
    U0 = torch.stack(starts, 1)
    inter = G.exp().unsqueeze(-1) * torch.einsum("bnhij,bnchj->bnchi", U0, Qc)
    S = torch.einsum("bnthd,bnshd->bntsh", Qc, Kc) * M
    o = (inter + torch.einsum("bntsh,bnshe->bnthe", S, Vc)) * scale
    return o.reshape(b, n * C, h, dv)[:, :T].to(dtype), U.to(dtype)
