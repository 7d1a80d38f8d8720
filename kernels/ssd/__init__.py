"""Mamba-2 SSD: ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t``.

Backends: ``reference`` (token recurrence), ``torch`` (chunked, the CPU default; computed through
the GLA chunked path), ``triton`` (chunked Triton kernels), ``mamba_ssm`` (the mamba-ssm package's
``mamba_chunk_scan_combined``, CUDA only, imported on first use). ``ssd_step`` is the one-token decode.
``D`` adds Mamba-2's skip ``y_t += D_h x_t``.
"""
from __future__ import annotations

import torch

from ..backend import NO_FP64, resolve_backend
from ..common import check_chunk_size, check_layout, full_precision
from .chunked import ssd_chunked
from .reference import skip, ssd_reference, ssd_step

__all__ = ["BACKENDS", "ssd", "ssd_chunked", "ssd_reference", "ssd_step"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton", "mamba_ssm")
#: largest d_state and head dim of the Triton kernels (mamba-ssm's default d_state is 128); checked for sm_80
#: and sm_90 by python -m zoo.benchmark.compile_check
TRITON_MAX_DIM = 128


@full_precision
def ssd(x, dt, A, B, C, chunk_size: int = 64, initial_state=None, backend: str = "auto", D=None):
    """Returns ``(y (B, T, H, P), final_state (B, H, N, P))``; with ``D (H,)``, ``y`` includes Mamba-2's skip
    ``D_h x_t`` (the Triton backend adds it in its output kernel, the others after). ``y`` is in ``x``'s dtype,
    ``final_state`` in :func:`kernels.common.state_dtype` of it, ``torch.promote_types(x.dtype, torch.float32)``
    (fp32 for 16-bit inputs, on every backend), so that a state passed to the next call is not rounded to 16
    bits; an fp32 ``initial_state`` is read as it is."""
    _check_layout(x, dt, A, B, C, D, initial_state)
    check_chunk_size("ssd", chunk_size)
    unsupported = {}
    if x.dtype == torch.float64:  # mamba-ssm keeps A and its states in fp32: an fp64 call would be rounded to them
        unsupported = {"triton": NO_FP64, "mamba_ssm": NO_FP64}
    if max(B.shape[-1], x.shape[-1]) > TRITON_MAX_DIM:
        unsupported["triton"] = f"d_state or head dim above {TRITON_MAX_DIM}"
    chosen = resolve_backend(backend, x, op="ssd", available=BACKENDS, unsupported=unsupported)
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


def _check_layout(x, dt, A, B, C, D, initial_state) -> None:
    """Refuse, on every backend and in one line naming the tensor, inputs whose shapes disagree (the reference and
    torch backends broadcast a one-head ``dt``, ``A`` or ``B`` into another model, the Triton kernels refused).
    ``B`` and ``C`` of fewer groups than heads say how to spread the groups over the heads."""
    H = x.shape[2] if x.dim() == 4 else 0
    for name, t in (("B", B), ("C", C)):
        G = t.shape[2] if t.dim() == 4 else 0
        if 0 < G < H and H % G == 0:
            fix = (f"for one group shared by every head pass {name}.expand(-1, -1, {H}, -1)" if G == 1 else
                   f"for {G} groups of {H // G} consecutive heads each (Mamba-2's grouping) pass "
                   f"{name}.repeat_interleave({H // G}, dim=2)")
            raise ValueError(f"ssd: {name} of shape {tuple(t.shape)} must be (B, T, H, N) with H = {H}, one row per "
                             f"head; {fix}")
    check_layout("ssd", x=(x, "B T H P"), dt=(dt, "B T H"), A=(A, "H"), B=(B, "B T H N"), C=(C, "B T H N"),
                 D=(D, "H"), initial_state=(initial_state, "B H N P"))
