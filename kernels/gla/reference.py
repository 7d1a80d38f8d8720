"""Reference gated linear attention with a scalar (per-head) log decay, token by token, fp64-capable.

    U_t = e^{g_t} U_{t-1} + v_t k_t^T        (d_v x d_k per head)
    o_t = U_t q_t * scale                   (scale = d_k^{-1/2} by default)

This is the ``r = 0`` baseline of Gated KalmaNet (no ridge solve) and fla's "simple GLA" (Qin et al.
2024; Yang et al. 2024 "Gated Linear Attention Transformers with Hardware-Efficient Training",
arXiv:2312.06635), with the state stored transposed (``v k^T``).
Shapes: ``q, k (B, T, H, d_k)``, ``v (B, T, H, d_v)``, ``g (B, T, H)``; ``initial_state (B, H, d_v,
d_k)``. Returns ``(o (B, T, H, d_v), U_T)``, ``o`` in ``q``'s dtype, ``U_T`` in :func:`kernels.common.state_dtype`
of it (fp32 for 16-bit inputs). :func:`gla_step` is one token; the loop is built from it.
"""
from __future__ import annotations

import torch

from ..common import as_state, compute_dtype


def gla_step(q_t, k_t, v_t, g_t, state, scale: float | None = None):
    """One token: ``q_t, k_t (B, H, d_k)``, ``v_t (B, H, d_v)``, ``g_t (B, H)``, ``state (B, H, d_v, d_k)``.

    Returns ``(o_t (B, H, d_v) in q_t's dtype, new state in the compute dtype)``.
    """
    dtype = q_t.dtype
    cd = compute_dtype(dtype)
    q_t, k_t, v_t, g_t = (t.to(cd) for t in (q_t, k_t, v_t, g_t))
    scale = q_t.shape[-1] ** -0.5 if scale is None else scale
    U = g_t.exp()[..., None, None] * state.to(cd) + v_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    return (torch.einsum("bhij,bhj->bhi", U, q_t) * scale).to(dtype), U


def gla_reference(q, k, v, g, scale: float | None = None, initial_state=None):
    dtype = q.dtype
    B, T, H, dk = q.shape
    U = q.new_zeros(B, H, v.shape[-1], dk, dtype=compute_dtype(dtype)) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        o_t, U = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], U, scale=scale)
        outs.append(o_t)
    o = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, H, v.shape[-1])
    return o, as_state(U, dtype)
