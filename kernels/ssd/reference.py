"""Reference Mamba-2 SSD (state-space duality) recurrence, token by token, fp64-capable.

Per head (Dao & Gu 2024, "Transformers are SSMs"):
    h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_t^T        (h_t in R^{N x P})
    y_t = C_t^T h_t
Shapes: x (B, T, H, P), dt (B, T, H) > 0, A (H,) < 0, B and C (B, T, H, N). The skip term ``D x``
and the gating live in the mixer. Equivalent to simple gated linear attention with q = C, k = B,
v = dt * x and log-decay g = dt * A.
"""
from __future__ import annotations

import torch


def ssd_reference(x, dt, A, B, C, initial_state=None):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    h = x.new_zeros(b, H, N, P) if initial_state is None else initial_state.to(x.dtype)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)  # (b, H)
        h = decay[..., None, None] * h + torch.einsum("bhn,bhp->bhnp", B[:, t], dt[:, t, :, None] * x[:, t])
        ys.append(torch.einsum("bhn,bhnp->bhp", C[:, t], h))
    return torch.stack(ys, dim=1), h
