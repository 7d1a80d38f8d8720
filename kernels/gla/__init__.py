"""Gated linear attention with a per-head scalar log decay (the r = 0 baseline of Gated KalmaNet).

    U_t = e^{g_t} U_{t-1} + v_t k_t^T,   o_t = U_t q_t * scale

Backends: ``reference`` (token recurrence), ``torch`` (chunked, the default everywhere; there is no
Triton kernel of our own in this family, so on CUDA ``auto`` runs the chunked PyTorch path) and
``fla`` (flash-linear-attention's ``chunk_simple_gla``, CUDA only, imported on first use).
``gla_step`` is the decode step.
"""
from __future__ import annotations

from ..backend import fla_unsupported, resolve_backend
from ..common import full_precision
from .chunked import gla_chunked
from .reference import gla_reference, gla_step

__all__ = ["BACKENDS", "fla_runs_gated", "gla", "gla_chunked", "gla_reference", "gla_step"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "fla")


def fla_runs_gated(dtype, gated: bool) -> bool:
    """Whether the ``fla`` backend runs fla's gated kernels: always (``chunk_simple_gla`` takes the decay)."""
    return True


@full_precision
def gla(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None, backend: str = "auto"):
    """Returns ``(o (B, T, H, d_v), U_T (B, H, d_v, d_k))``."""
    chosen = resolve_backend(backend, q, op="gla", available=BACKENDS,
                             unsupported=fla_unsupported(q, fla_runs_gated(q.dtype, True)))
    if chosen == "reference":
        return gla_reference(q, k, v, g, scale=scale, initial_state=initial_state)
    if chosen == "fla":
        from .outside import gla_fla
        return gla_fla(q, k, v, g, scale=scale, initial_state=initial_state)
    return gla_chunked(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
