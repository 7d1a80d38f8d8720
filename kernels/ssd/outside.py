"""SSD through mamba-ssm's ``mamba_chunk_scan_combined`` (the ``mamba_ssm`` backend; CUDA only).

mamba-ssm's chunked SSD (Dao & Gu, "Transformers are SSMs", arXiv:2405.21060) takes ``x (b, l, h, p)``,
``dt (b, l, h)``, ``A (h,)``, ``B, C (b, l, g, n)`` with ``g`` groups of heads sharing ``B, C``: our
per-head ``B, C (B, T, H, N)`` are ``g = H`` groups. We pass ``dt`` already positive (no
``dt_softplus``, no ``dt_bias``) and no ``D`` / ``z`` (the skip and the gate live in the mixer). Its
states are ``(b, h, p, n)``; ours are ``(B, H, N, P)``, so initial and final states are transposed.
The package is imported here, on first use; :func:`kernels.backend.resolve_backend` has already checked
that it imports and that the inputs are on CUDA.
"""
from __future__ import annotations

from ..common import as_state


def ssd_mamba_ssm(x, dt, A, B, C, chunk_size: int = 64, initial_state=None):
    """Same contract as :func:`kernels.ssd.chunked.ssd_chunked`: ``(y (B, T, H, P), final_state (B, H, N, P))``."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    dtype = x.dtype
    h0 = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    y, final = mamba_chunk_scan_combined(x, dt.to(dtype), A.float(), B.to(dtype), C.to(dtype), chunk_size,
                                         initial_states=h0, return_final_states=True)
    return y.to(dtype), as_state(final.transpose(-1, -2), dtype)
