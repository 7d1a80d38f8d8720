"""Dense chunked slot memory in pure PyTorch (small ``M``); contract of
:func:`kernels.slots.reference.slot_memory_reference`.

With the write and read weights scattered to dense length-``M`` vectors ``w_t``, ``r_t`` (zero off the
selected slots), the power-decay update is a gated linear recurrence over ``M`` key channels with a
per-channel log decay ``a_t = gamma * log(1 - w_t)`` (zero on unwritten slots), i.e. gated linear
attention with a diagonal (vector) decay, key ``w_t`` and value ``v_t``:

    S_t = diag(e^{a_t}) S_{t-1} + w_t v_t^T,        z_t = e^{a_t} * z_{t-1} + w_t
    o_t = q_t^T S_t  with the query  q_t = r_t / (z_t + eps)

The normaliser divides each slot before the sum over slots, so it cannot ride along as an extra value
column (that would give ``sum_m r_m z_m``); ``z`` is first computed for every position by its own
diagonal scan, then it fixes the query. Within chunk ``c`` (``A_t`` the inclusive cumulative log decay
from the chunk start, ``S_0``, ``z_0`` the state entering the chunk, ``D[t, s, m] = e^{A_t[m] - A_s[m]}``
for ``s <= t``):

    z_t = e^{A_t} z_0 + sum_{s<=t} D[t, s] w_s
    o_t = sum_m q_t[m] e^{A_t[m]} S_0[m] + sum_{s<=t} (sum_m q_t[m] D[t, s, m] w_s[m]) v_s
    S_next = e^{A_C} S_0 + sum_s e^{A_C - A_s} w_s v_s^T

Cost ``O(T C M (1 + d_v / C))`` time and ``O(T C M)`` memory per head (the decay tensor ``D``): linear in
``T`` but proportional to ``M``, so this path is for small memories; the sparse path touches ``K`` rows.
"""
from __future__ import annotations

import torch

from ..common import causal_decay_mask, compute_dtype, pad_time
from .reference import log_keep


def densify(idx: torch.Tensor, weights: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``(B, T, H, K)`` indices and weights -> ``(B, T, H, M)`` dense weights (zero elsewhere)."""
    out = weights.new_zeros(*weights.shape[:-1], num_slots)
    return out.scatter(-1, idx, weights)


def slot_memory_chunked(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                        chunk_size: int = 16, initial_state=None):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))``."""
    dtype = v.dtype
    cd = compute_dtype(dtype)
    B, T, H, dv = v.shape
    M, C = num_slots, chunk_size
    v, gamma = v.to(cd), gamma.to(cd)
    w = densify(write_idx, write_w.to(cd), M)
    r = densify(read_idx, read_w.to(cd), M)
    a = log_keep(w, gamma[:, None])  # exactly 0 where nothing is written
    w, r, a, v = (pad_time(x, C) for x in (w, r, a, v))
    n = w.shape[1] // C
    w, r, a = (x.reshape(B, n, C, H, M) for x in (w, r, a))
    v = v.reshape(B, n, C, H, dv)
    A = torch.cumsum(a, dim=2)
    D = causal_decay_mask(A, dim=2)  # (B, n, t, s, H, M)
    z_intra = torch.einsum("bntshm,bnshm->bnthm", D, w)
    to_end = (A[:, :, -1:] - A).exp()  # (B, n, C, H, M)
    S_chunk = torch.einsum("bnshm,bnshd->bnhmd", to_end * w, v)
    chunk_decay = A[:, :, -1].exp()  # (B, n, H, M)
    if initial_state is None:
        S0, z0 = v.new_zeros(B, H, M, dv), v.new_zeros(B, H, M)
    else:
        S0, z0 = initial_state[0].to(cd), initial_state[1].to(cd)
    S_starts, z_starts = [], []
    for c in range(n):
        S_starts.append(S0)
        z_starts.append(z0)
        S0 = chunk_decay[:, c, :, :, None] * S0 + S_chunk[:, c]
        z0 = chunk_decay[:, c] * z0 + z_intra[:, c, -1]
    S_in, z_in = torch.stack(S_starts, 1), torch.stack(z_starts, 1)  # (B, n, H, M, dv), (B, n, H, M)
    z = A.exp() * z_in.unsqueeze(2) + z_intra
    q = r / (z + eps)
    inter = torch.einsum("bnthm,bnhmd->bnthd", q * A.exp(), S_in)
    scores = torch.einsum("bnthm,bntshm,bnshm->bntsh", q, D, w)
    o = inter + torch.einsum("bntsh,bnshd->bnthd", scores, v)
    return o.reshape(B, n * C, H, dv)[:, :T].to(dtype), (S0, z0)
