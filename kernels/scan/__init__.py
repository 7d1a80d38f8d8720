"""The state pass across chunks shared by the chunked kernels: ``S_c = a_c S_{c-1} + X_c``.

A chunked linear recurrence (gated linear attention, GKA's ``(H, U)`` statistics, SSD) computes each
chunk's own contribution ``X_c`` and decay ``a_c`` in parallel, then passes the state from chunk to chunk:
``S_c = a_c S_{c-1} + X_c`` with ``S_{-1}`` the initial state. :func:`chunk_scan` returns the state every
chunk starts from and the final state, differentiable in ``a``, ``X`` and the initial state.

Backends (``backend="auto"`` follows :func:`kernels.device.plan_for`): ``reference`` (the loop through
autograd, :mod:`.reference`), ``torch`` (the CPU path: one in-place op per chunk in a Python loop with a
hand-written backward, :mod:`.loop`), ``triton`` (the GPU path: one kernel forward and one backward
whatever the chunk count, :mod:`.triton`).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from ..common import at_least_fp32, state_dtype
from .loop import ChunkScanLoop
from .reference import chunk_scan_reference

__all__ = ["BACKENDS", "chunk_scan", "chunk_scan_reference"]

#: the backends this family implements (``auto`` picks among them)
BACKENDS = ("reference", "torch", "triton")


def chunk_scan(a: torch.Tensor, X: torch.Tensor, initial: torch.Tensor | None = None, backend: str = "auto"):
    """Pass states across chunks: ``S_c = a_c S_{c-1} + X_c`` with ``S_{-1} = initial`` (zero if None).

    ``a`` ``(*lead, n)`` per-chunk decay factors, ``X`` ``(*lead, n, *state)`` per-chunk contributions,
    ``initial`` ``(*lead, *state)``. Returns ``(starts (*lead, n, *state), final (*lead, *state))``,
    ``starts[..., c, ...] = S_{c-1}`` (the state each chunk starts from), in ``X``'s dtype, and ``final`` in
    :func:`kernels.common.state_dtype` of it, ``torch.promote_types(X.dtype, torch.float32)``: the pass runs in
    fp32 for 16-bit ``X`` on every backend and ``initial`` is read as it is, so a final state handed to the next
    call is not rounded to 16 bits. Differentiable in all three.
    """
    lead = a.ndim - 1
    if X.shape[:a.ndim] != a.shape:
        raise ValueError(f"chunk_scan: X {tuple(X.shape)} must start with the shape of a {tuple(a.shape)}")
    if initial is not None and initial.shape != X.shape[:lead] + X.shape[a.ndim:]:
        raise ValueError(f"chunk_scan: initial {tuple(initial.shape)} must be a's leading dims then the state's, "
                         f"{tuple(X.shape[:lead] + X.shape[a.ndim:])}: X's shape without its chunk axis")
    which = resolve_backend(backend, X, op="chunk_scan", available=BACKENDS)
    if which == "triton" and a.shape[-1] > 0:
        from .triton import chunk_scan_triton  # lazy: triton is optional (a zero initial state is not formed)

        return chunk_scan_triton(a, X, initial)    # the pass in fp32 for 16-bit X, initial read as it is
    cd = state_dtype(X)
    Xc = X.to(cd)                                   # the pass in fp32 for 16-bit X (a no-op for fp32 and fp64)
    if initial is None:
        initial = Xc.new_zeros(X.shape[:lead] + X.shape[a.ndim:])
    initial = initial.to(cd)
    scan = chunk_scan_reference if which == "reference" else ChunkScanLoop.apply
    starts, final = scan(at_least_fp32(a), Xc, initial)
    return starts.to(X.dtype), final.to(cd)        # (fp64 decays would promote the reference's state)
