"""Reference Mamba-2 SSD (state-space duality) recurrence, token by token, fp64-capable.

Per head (Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality", arXiv:2405.21060):
    h_t = exp(dt_t * A) h_{t-1} + dt_t * B_t x_t^T        (h_t in R^{N x P})
    y_t = C_t^T h_t
Shapes: x (B, T, H, P), dt (B, T, H) > 0, A (H,) < 0, B and C (B, T, H, N). Mamba-2's skip
``y_t += D x_t`` (D (H,)) is :func:`skip`; the output gate lives in the mixer. Equivalent to simple gated
linear attention with q = C, k = B, v = dt * x and log-decay g = dt * A. :func:`ssd_step` is one token; the
loop is built from it.
"""
from __future__ import annotations

import torch


def skip(y, x, D):
    """``y + D_h x`` with ``D (H,)`` over the heads of ``x (..., H, P)`` (``y`` itself where ``D`` is None)."""
    return y if D is None else y + D.to(y.dtype)[:, None] * x


def ssd_step(x_t, dt_t, A, B_t, C_t, state, D=None):
    """One token: ``x_t (B, H, P)``, ``dt_t (B, H)``, ``B_t, C_t (B, H, N)``, state ``(B, H, N, P)``; ``D (H,)``
    adds the skip."""
    decay = torch.exp(dt_t * A)
    state = decay[..., None, None] * state + torch.einsum("bhn,bhp->bhnp", B_t, dt_t[..., None] * x_t)
    return skip(torch.einsum("bhn,bhnp->bhp", C_t, state), x_t, D), state


def ssd_reference(x, dt, A, B, C, initial_state=None):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``."""
    b, T, H, P = x.shape
    h = x.new_zeros(b, H, B.shape[-1], P) if initial_state is None else initial_state.to(x.dtype)
    ys = []
    for t in range(T):
        y_t, h = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h)
        ys.append(y_t)
    return (torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)), h
