"""Mamba-2 SSD: ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t``.

Backends: ``reference`` (token recurrence), ``torch`` (chunked, the CPU default; computed through
the GLA chunked path), ``triton`` (chunked Triton kernels), ``mamba_ssm`` (the mamba-ssm package's
``mamba_chunk_scan_combined``, CUDA only, imported on first use). ``ssd_step`` is the one-token decode.
``D`` adds Mamba-2's skip ``y_t += D_h x_t``.
"""
from __future__ import annotations

from ..backend import resolve_backend
from ..common import check_layout, full_precision
from .chunked import ssd_chunked
from .reference import skip, ssd_reference, ssd_step

__all__ = ["BACKENDS", "ssd", "ssd_chunked", "ssd_reference", "ssd_step"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton", "mamba_ssm")


@full_precision
def ssd(x, dt, A, B, C, chunk_size: int = 64, initial_state=None, backend: str = "auto", D=None):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``; with ``D (H,)``, ``y`` includes Mamba-2's skip
    ``D_h x_t`` (the Triton backend adds it in its output kernel, the others after)."""
    check_layout("ssd", x=(x, "B T H P"), dt=(dt, "B T H"), A=(A, "H"), B=(B, "B T H N"), C=(C, "B T H N"),
                 D=(D, "H"), initial_state=(initial_state, "B H N P"))
    wide = max(B.shape[-1], x.shape[-1]) > 128  # the Triton kernels' MAX_DIM (see kernels/ssd/triton.py)
    chosen = resolve_backend(backend, x, op="ssd", available=BACKENDS,
                             unsupported={"triton": "d_state or head dim above 128"} if wide else None)
    if chosen == "triton" and x.shape[1] == 0:  # an empty sequence: the chunked path's empty output and state
        chosen = "torch"
    if chosen == "triton":
        from .triton import ssd_triton
        return ssd_triton(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state, D=D)
    if chosen == "reference":
        y, final = ssd_reference(x, dt, A, B, C, initial_state=initial_state)
    elif chosen == "mamba_ssm":
        from .outside import ssd_mamba_ssm
        y, final = ssd_mamba_ssm(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    else:
        y, final = ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    return skip(y, x, D), final
