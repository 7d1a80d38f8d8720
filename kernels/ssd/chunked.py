"""Chunked SSD in pure PyTorch: exact quadratic form within a chunk, state passing across chunks.

Within chunk c with cumulative log decay ``a_t = sum_{s<=t} dt_s A`` (from the chunk start):
    y_t = sum_{s<=t in chunk} exp(a_t - a_s) (C_t . B_s) dt_s x_s  +  exp(a_t) C_t^T h_{c-1}
    h_c = exp(a_last) h_{c-1} + sum_s exp(a_last - a_s) B_s (dt_s x_s)^T
The segment sums ``a_t - a_s`` are formed directly (never as exp(a_t)/exp(a_s)), so long chunks with
strong decay do not overflow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_chunked(x, dt, A, B, C, chunk_size: int = 64, initial_state=None):
    """Same contract as :func:`kernels.ssd.reference.ssd_reference`: ``(y, final_state)``."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x, dt, B, C = (t.to(compute) for t in (x, dt, B, C))
    A = A.to(compute)
    L = chunk_size
    pad = (-T) % L
    if pad:
        # zero dt on padding: no decay, no input, so the final state is unaffected
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    n = (T + pad) // L
    xc = x.reshape(b, n, L, H, P)
    Bc = B.reshape(b, n, L, H, N)
    Cc = C.reshape(b, n, L, H, N)
    a = (dt * A).reshape(b, n, L, H)
    u = xc * dt.reshape(b, n, L, H, 1)
    acum = torch.cumsum(a, dim=2)  # (b, n, L, H)
    # within-chunk: decay(t, s) = exp(acum_t - acum_s) for s <= t
    seg = acum.unsqueeze(3) - acum.unsqueeze(2)  # (b, n, t, s, H)
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    decay = torch.where(causal[None, None, :, :, None], seg, torch.full_like(seg, float("-inf"))).exp()
    scores = torch.einsum("bctHn,bcsHn->bctsH", Cc, Bc) * decay
    y = torch.einsum("bctsH,bcsHp->bctHp", scores, u)
    # chunk states: contribution of each chunk alone, then pass states across chunks
    to_end = (acum[:, :, -1:, :] - acum).exp()  # (b, n, L, H)
    chunk_states = torch.einsum("bclH,bclHn,bclHp->bcHnp", to_end, Bc, u)
    chunk_decay = acum[:, :, -1, :].exp()  # (b, n, H)
    h = x.new_zeros(b, H, N, P) if initial_state is None else initial_state.to(compute)
    starts = []
    for c in range(n):
        starts.append(h)
        h = chunk_decay[:, c, :, None, None] * h + chunk_states[:, c]
    h_start = torch.stack(starts, dim=1)  # (b, n, H, N, P)
    y = y + torch.einsum("bclHn,bcHnp,bclH->bclHp", Cc, h_start, acum.exp())
    y = y.reshape(b, n * L, H, P)[:, :T]
    return y.to(dtype), h.to(dtype)


def ssd_step(x_t, dt_t, A, B_t, C_t, state):
    """One decode step: ``x_t (B, H, P)``, ``dt_t (B, H)``, ``B_t, C_t (B, H, N)``, state ``(B, H, N, P)``."""
    decay = torch.exp(dt_t * A)
    state = decay[..., None, None] * state + torch.einsum("bhn,bhp->bhnp", B_t, dt_t[..., None] * x_t)
    return torch.einsum("bhn,bhnp->bhp", C_t, state), state
