"""GLA through flash-linear-attention's ``chunk_simple_gla`` (the ``fla`` backend; CUDA only).

fla's simple GLA is our recurrence exactly (Yang et al., "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635; scalar per-head log decay ``g`` in natural log,
``o_t = scale * U_t q_t``). Its state is ``(K, V)`` by default; ``state_v_first=True`` stores it as
``(V, K)``, which is our ``(d_v, d_k)`` layout, so no transposition is needed. The package is imported
here, on first use; :func:`kernels.backend.resolve_backend` has already checked that it imports and
that the inputs are on CUDA.
"""
from __future__ import annotations

from ..common import as_state


def gla_fla(q, k, v, g, scale: float | None = None, initial_state=None):
    """Same contract as :func:`kernels.gla.chunked.gla_chunked`: ``(o (B, T, H, d_v), U_T (B, H, d_v, d_k))``."""
    from fla.ops.simple_gla import chunk_simple_gla

    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, U = chunk_simple_gla(q, k, v, g.float(), scale=scale, initial_state=h0, output_final_state=True,
                            state_v_first=True)
    return o.to(dtype), as_state(U, dtype)
