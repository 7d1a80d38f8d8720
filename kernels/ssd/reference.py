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

from ..common import as_state, compute_dtype


def skip(y, x, D):
    """``y + D_h x`` with ``D (H,)`` over the heads of ``x (..., H, P)`` (``y`` itself where ``D`` is None)."""
    return y if D is None else y + D.to(y.dtype)[:, None] * x


def ssd_step(x_t, dt_t, A, B_t, C_t, state, D=None):
    """One token: ``x_t (B, H, P)``, ``dt_t (B, H)``, ``B_t, C_t (B, H, N)``, state ``(B, H, N, P)``; ``D (H,)``
    adds the skip. Computed in the compute dtype of ``x_t`` and ``state`` (fp32 for 16-bit inputs): returns
    ``(y_t in x_t's dtype, new state in the compute dtype)``, so a decode never rounds its running state (nor a
    decay near 1, which bf16 rounds to 1) to 16 bits."""
    dtype = x_t.dtype
    cd = compute_dtype(dtype, state.dtype)
    x_t, dt_t, A, B_t, C_t, state = (t.to(cd) for t in (x_t, dt_t, A, B_t, C_t, state))
    decay = torch.exp(dt_t * A)
    state = decay[..., None, None] * state + torch.einsum("bhn,bhp->bhnp", B_t, dt_t[..., None] * x_t)
    return skip(torch.einsum("bhn,bhnp->bhp", C_t, state), x_t, D).to(dtype), state


def ssd_reference(x, dt, A, B, C, initial_state=None):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``, ``y`` in ``x``'s dtype and the state in
    :func:`kernels.common.state_dtype` of it (fp32 for 16-bit inputs)."""
    b, T, H, P = x.shape
    cd = compute_dtype(x.dtype)
    h = x.new_zeros(b, H, B.shape[-1], P, dtype=cd) if initial_state is None else initial_state.to(cd)
    ys = []
    for t in range(T):
        y_t, h = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h)
        ys.append(y_t)
    # the state accumulates in the compute dtype (ssd_step) and is returned in state_dtype(x), as by the others
    return (torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)), as_state(h, x)
