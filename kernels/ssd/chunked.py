"""Chunked SSD in pure PyTorch, computed as simple gated linear attention (one chunked algorithm
for both families): the ``torch`` backend, which ``auto`` runs on a CPU (on CUDA ``auto`` runs mamba-ssm where
installed, else :mod:`kernels.ssd.triton`).

SSD per head, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t``, is GLA's
``U_t = e^{g_t} U_{t-1} + v_t k_t^T``, ``o_t = U_t q_t`` with ``q = C``, ``k = B``, ``v = dt x``,
``g = dt A`` and scale 1; the states are transposes of each other (SSD ``(N, P)`` = GLA's
``(d_v, d_k)^T``). See :mod:`kernels.gla.chunked` for the chunked equations.
"""
from __future__ import annotations

from ..common import as_state, compute_dtype
from ..gla.chunked import gla_chunked


def ssd_chunked(x, dt, A, B, C, chunk_size: int = 64, initial_state=None):
    """Same contract as :func:`kernels.ssd.reference.ssd_reference`: ``(y, final_state)``."""
    dtype = x.dtype
    cd = compute_dtype(dtype)
    if B.shape[2] > 1 and B.stride(2) == 0 and C.stride(2) == 0:
        # B and C expanded from one group shared by all heads (Mamba-2's default): pass the group once,
        # so the chunked path forms C B^T once per chunk instead of once per head
        B, C = B[:, :, :1], C[:, :, :1]
    x, dt, A, B, C = (t.to(cd) for t in (x, dt, A, B, C))
    h0 = None if initial_state is None else initial_state.to(cd).transpose(-1, -2)
    y, U = gla_chunked(C, B, x * dt.unsqueeze(-1), dt * A, scale=1.0, chunk_size=chunk_size, initial_state=h0)
    return y.to(dtype), as_state(U.transpose(-1, -2), dtype)
