"""Gated linear attention with a per-head scalar log decay (the r = 0 baseline of Gated KalmaNet).

    U_t = e^{g_t} U_{t-1} + v_t k_t^T,   o_t = U_t q_t * scale

Backends: ``reference`` (token recurrence), ``torch`` (chunked, the CPU path), ``triton`` (the chunk stages
of :mod:`kernels.gla.triton`: four launches forward and backward whatever the length; chunk sizes powers of
two >= 16, fp32 and 16-bit inputs) and ``fla`` (flash-linear-attention's ``chunk_simple_gla``, CUDA only,
imported on first use; ``auto`` prefers it on CUDA where it is installed). ``gla_step`` is the decode step.
"""
from __future__ import annotations

import torch

from ..backend import NO_FP64, BackendUnavailable, fla_unsupported, resolve_backend
from ..common import check_chunk_size, check_layout, full_precision, no_decay
from .chunked import gla_chunked
from .reference import gla_reference, gla_step

__all__ = ["BACKENDS", "fla_runs_gated", "gla", "gla_chunked", "gla_reference", "gla_step"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton", "fla")


def fla_runs_gated(dtype, gated: bool) -> bool:
    """Whether the ``fla`` backend runs fla's gated kernels: always (``chunk_simple_gla`` takes the decay)."""
    return True


@full_precision
def gla(q, k, v, g, scale: float | None = None, chunk_size: int = 64, initial_state=None, backend: str = "auto"):
    """Returns ``(o (B, T, H, d_v), U_T (B, H, d_v, d_k))``: ``o`` in ``q``'s dtype, ``U_T`` in
    :func:`kernels.common.state_dtype` of it, ``torch.promote_types(q.dtype, torch.float32)`` (fp32 for 16-bit
    inputs, on every backend), so that a state passed to the next call is not rounded to 16 bits; an fp32
    ``initial_state`` is read as it is. ``g`` None is no decay (as fla's ``chunk_simple_gla`` takes it): causal
    linear attention."""
    g = no_decay(v) if g is None else g
    sizes = check_layout("gla", q=(q, "B T Hqk K"), k=(k, "B T Hqk K"), v=(v, "B T H V"), g=(g, "B T H"),
                         initial_state=(initial_state, "B H V K"))
    if sizes["Hqk"] not in (1, sizes["H"]):
        raise ValueError(f"gla: q and k must have one head per value head ({sizes['H']}) or one head shared by all "
                         f"of them, got {sizes['Hqk']}")
    check_chunk_size("gla", chunk_size)
    chosen = resolve_backend(backend, q, op="gla", available=BACKENDS, unsupported=_fla_refuses(q, sizes))
    if chosen == "reference":
        return gla_reference(q, k, v, g, scale=scale, initial_state=initial_state)
    if chosen == "triton":
        why = _triton_refuses(q, chunk_size)
        if why is None:
            from .triton import gla_triton
            return gla_triton(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
        if backend == "triton":
            raise BackendUnavailable(f"gla: the triton backend {why}; or use backend='torch'")
    if chosen == "fla":
        from .outside import gla_fla
        return gla_fla(q, k, v, g, scale=scale, initial_state=initial_state)
    return gla_chunked(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)


def _fla_refuses(q, sizes) -> dict:
    """``{"fla": why}`` where fla's ``chunk_simple_gla`` cannot take these inputs, else ``{}``. Its state pass
    reads the head count of ``k`` as every tensor's, so one query/key head shared by all value heads would read
    ``v``, ``g`` and the state at the wrong strides; and it keeps its gates and states in fp32."""
    if sizes["Hqk"] != sizes["H"]:
        return {"fla": f"needs q and k with one head per value head (pass q.expand(-1, -1, {sizes['H']}, -1) and k "
                       f"alike)"}
    if q.dtype == torch.float64:
        return {"fla": NO_FP64}
    return fla_unsupported(q, fla_runs_gated(q.dtype, True))


def triton_chunk_size_problem(chunk_size: int) -> str | None:
    """Why the triton backend cannot take ``chunk_size``, or None (the mixer asks when it is built)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"needs chunk_size a power of two >= 16, got {chunk_size}"
    return None


def _triton_refuses(q, chunk_size: int) -> str | None:
    """Why the triton backend cannot take these inputs, or None (``auto`` then runs the chunked path)."""
    why = triton_chunk_size_problem(chunk_size)
    if why:
        return why
    if q.dtype == torch.float64:
        return NO_FP64
    return None
