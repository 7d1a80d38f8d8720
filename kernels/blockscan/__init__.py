"""The ``blockscan`` family: linear recurrences whose transition is a small dense block per channel group.

Per batch element, for ``N`` independent blocks of size ``m`` (layout batch, time first):

    h_t = A_t h_{t-1} + b_t          A_t (m, m), b_t, h_t (m,),   h_0 = initial_state (or 0)

* :func:`block_scan` — dense blocks, the recurrence of block-diagonal linear recurrent units (BD-LRU;
  Dubinin, Orvieto & Effenberger, "Improved State Mixing in Higher-order and Block Diagonal Linear Recurrent
  Networks", arXiv:2602.12021).
* :func:`jordan_scan` — the structured transition ``A_t = lam_t I + c_t N`` with ``N`` the nilpotent
  shift (ones on the superdiagonal, ``(N h)_i = h_{i+1}``), i.e. the upper Jordan block
  ``J = lam I + N`` for ``c = 1`` (the defective-Jordan SSM of Dadwal, "The Illusion of State: Sharp
  Memory-Decay Bounds in Linear State Space Models", OpenReview 8Kg8lL3L58). All such transitions are
  polynomials in ``N`` and commute, so a product of them is a truncated polynomial
  ``sum_{j<m} e_j N^j``; the chunked path multiplies these in ``O(m)`` per factor instead of ``O(m^3)``.
* :func:`softmax_gates` — BD-LRU's transitions and inputs from its projections (a row softmax per block,
  :mod:`.gates`), one Triton kernel each way on the GPU path.
* :func:`jordan_scan_normed` — the same with a LayerNorm of the state after every step,
  ``h_t = LN(A_t h_{t-1} + b_t)`` (the paper's cure for the polynomial blow-up); nonlinear and
  therefore sequential.

Backward (all backends agree): with ``g_t = dL/dh_t`` accumulated from the future,
``g_{t-1} += A_t^T g_t``, ``dA_t = g_t h_{t-1}^T``, ``db_t = g_t``, ``d initial_state = A_1^T g_1``.

Backends: ``reference`` (token loop from the step functions, fp64-capable), ``torch`` (chunked, linear
in ``T``, the CPU default; for the normed scan it is the reference loop: no parallel form exists),
``triton`` (chunk-parallel kernels for the linear scans, three launches forward and three backward at any
``T``; a sequential kernel over ``B N`` chains for the normed scan). ``chunk_size`` is the chunk length of
both chunked paths; it does not change the result.
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from ..common import full_precision
from .reference import (
    block_scan_reference,
    block_scan_step,
    jordan_scan_normed_reference,
    jordan_scan_reference,
    jordan_step,
    jordan_step_normed,
    softmax_gates_reference,
)

__all__ = [
    "BACKENDS",
    "block_scan",
    "block_scan_step",
    "jordan_scan",
    "jordan_step",
    "jordan_scan_normed",
    "jordan_step_normed",
    "jordan_transition",
    "softmax_gates",
    "softmax_gates_reference",
]

#: the backends every op of this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton")


def _check_common(op, b, initial_state):
    if b.ndim != 4:
        raise ValueError(f"{op}: b must be (B, T, N, m), got shape {tuple(b.shape)}")
    Bsz, T, N, m = b.shape
    if m < 1:
        raise ValueError(f"{op}: block size m = b.shape[-1] must be >= 1, got {m}")
    if initial_state is not None and tuple(initial_state.shape) != (Bsz, N, m):
        raise ValueError(
            f"{op}: initial_state must be (B, N, m) = {(Bsz, N, m)}, got {tuple(initial_state.shape)}; "
            f"pass None for a zero initial state"
        )


def _check_chunk(op, chunk_size):
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")


def _broadcast_c(op, c, lam):
    if not torch.is_tensor(c):
        return torch.full_like(lam, float(c))
    try:
        shape = torch.broadcast_shapes(c.shape, lam.shape)
    except RuntimeError:
        shape = None
    if shape != lam.shape:
        raise ValueError(
            f"{op}: c of shape {tuple(c.shape)} does not broadcast to lam's shape (B, T, N) = "
            f"{tuple(lam.shape)}; pass c as (N,), (1, 1, N), (B, T, N) or a float"
        )
    return c


def _check_jordan(op, lam, b):
    if lam.ndim != 3 or tuple(lam.shape) != tuple(b.shape[:3]):
        raise ValueError(f"{op}: lam must be (B, T, N) = {tuple(b.shape[:3])}, got {tuple(lam.shape)}")


@full_precision
def block_scan(A, b, initial_state=None, chunk_size: int = 64, backend: str = "auto"):
    """``h_t = A_t h_{t-1} + b_t`` per block. ``A (B, T, N, m, m)``, ``b (B, T, N, m)``,
    ``initial_state (B, N, m)`` or None. Returns ``(h (B, T, N, m), h_last (B, N, m))``, ``h`` the state
    after every token, in the dtype of ``b``, and ``h_last`` in :func:`kernels.common.state_dtype` of ``b``,
    ``torch.promote_types(b.dtype, torch.float32)`` (fp32 for 16-bit inputs, on every backend), so that a state
    passed to the next call is not rounded to 16 bits; an fp32 ``initial_state`` is read as it is."""
    op = "block_scan"
    _check_common(op, b, initial_state)
    _check_chunk(op, chunk_size)
    if A.shape != b.shape + b.shape[-1:]:
        raise ValueError(f"{op}: A must be (B, T, N, m, m) = {tuple(b.shape + b.shape[-1:])}, got {tuple(A.shape)}")
    which = resolve_backend(backend, b, op=op, available=BACKENDS)
    if which == "reference":
        return block_scan_reference(A, b, initial_state)
    if which == "torch":
        from .chunked import block_scan_chunked

        return block_scan_chunked(A, b, initial_state, chunk_size=chunk_size)
    from .triton import block_scan_triton

    return block_scan_triton(A, b, initial_state, chunk_size=chunk_size)


def softmax_gates(logits, v, m: int, backend: str = "auto"):
    """``(A (..., N, m, m), b (..., N, m))`` from ``logits (..., N m (m+1))`` and ``v (..., N m)``: each row of a
    block's ``m x (m+1)`` logits through a softmax, ``A`` its first ``m`` columns, ``b`` its last times ``v``
    (:func:`.reference.softmax_gates_reference`). Backends ``reference`` / ``torch`` (that formula) and
    ``triton`` (:mod:`.gates`)."""
    m = int(m)
    if m < 1 or v.shape[-1] % m or logits.shape[-1] != v.shape[-1] * (m + 1) or logits.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"softmax_gates: expected logits (..., N m (m+1)) and v (..., N m) for block size {m}, "
                         f"got logits {tuple(logits.shape)} and v {tuple(v.shape)}")
    if resolve_backend(backend, v, op="softmax_gates", available=BACKENDS) == "triton":
        from .gates import softmax_gates_triton

        return softmax_gates_triton(logits, v, m)
    return softmax_gates_reference(logits, v, m)


def jordan_transition(lam, c, m: int):
    """The materialised transition ``lam I + c N`` of shape ``lam.shape + (m, m)`` (for checks and
    for :func:`block_scan`); ``c`` broadcastable to ``lam``."""
    c = c if torch.is_tensor(c) else torch.tensor(float(c), dtype=lam.dtype, device=lam.device)
    eye = torch.eye(m, dtype=lam.dtype, device=lam.device)
    shift = torch.diag(torch.ones(m - 1, dtype=lam.dtype, device=lam.device), 1)
    return lam[..., None, None] * eye + torch.broadcast_to(c, lam.shape)[..., None, None] * shift


@full_precision
def jordan_scan(lam, c, b, initial_state=None, chunk_size: int = 64, backend: str = "auto"):
    """``h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t`` per block, ``(N h)_i = h_{i+1}``.

    ``lam (B, T, N)``; ``c`` broadcastable to ``(B, T, N)`` (a per-block coupling as ``(N,)`` or
    ``(1, 1, N)``, or a float); ``b (B, T, N, m)``; ``initial_state (B, N, m)`` or None. Returns
    ``(h (B, T, N, m), h_last (B, N, m))``; gradients flow to ``lam``, ``c`` (reduced to its shape),
    ``b`` and ``initial_state``. ``h`` is in the dtype of ``b``, ``h_last`` in :func:`kernels.common.state_dtype`
    of ``b``, ``torch.promote_types(b.dtype, torch.float32)`` (fp32 for 16-bit inputs, on every backend), so that
    a state passed to the next call is not rounded to 16 bits; an fp32 ``initial_state`` is read as it is.
    """
    op = "jordan_scan"
    _check_common(op, b, initial_state)
    _check_chunk(op, chunk_size)
    _check_jordan(op, lam, b)
    c = _broadcast_c(op, c, lam)
    which = resolve_backend(backend, b, op=op, available=BACKENDS)
    if which == "reference":
        return jordan_scan_reference(lam, c, b, initial_state)
    if which == "torch":
        from .chunked import jordan_scan_chunked

        return jordan_scan_chunked(lam, c, b, initial_state, chunk_size=chunk_size)
    from .triton import jordan_scan_triton

    return jordan_scan_triton(lam, c, b, initial_state, chunk_size=chunk_size)


@full_precision
def jordan_scan_normed(lam, c, b, weight, bias, eps: float = 1e-5, initial_state=None, backend: str = "auto"):
    """``h_t = LN(lam_t h_{t-1} + c_t N h_{t-1} + b_t)`` with a LayerNorm after every step.

    The norm runs over the ``m`` components of EACH BLOCK (not over the whole ``N * m`` state):
    ``LN(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias``, biased variance, ``weight`` and
    ``bias`` broadcastable to ``(N, m)`` (``(m,)`` shares them across blocks). Why per block: in the
    paper the normalised state is one ``16 x 16`` Jordan block (``d_model = 16``, a single block), and
    the LayerNorm runs over "the components of ``h_t``", i.e. over that block; with ``N`` blocks the
    per-block norm is the direct generalisation, keeps the blocks independent (one program per
    (batch, block) in the Triton kernel, no cross-block reduction per token) and still caps each
    block's ``k^{m-1}`` transient, which is what the norm is for. For ``m = 1`` the per-block norm
    would erase the state (output = bias), so ``m >= 2`` is required.

    Nonlinear, hence sequential: backends ``reference`` (token loop), ``torch`` (the same loop — there
    is no parallel form) and ``triton`` (one fused chain per (batch, block), forward and backward).
    Returns ``(h (B, T, N, m), h_last (B, N, m))``, ``h`` in the dtype of ``b``, ``h_last`` in
    :func:`kernels.common.state_dtype` of ``b``, ``torch.promote_types(b.dtype, torch.float32)`` (fp32 for 16-bit
    inputs, on every backend), so that a state passed to the next call is not rounded to 16 bits; an fp32
    ``initial_state`` is read as it is.
    """
    op = "jordan_scan_normed"
    _check_common(op, b, initial_state)
    _check_jordan(op, lam, b)
    c = _broadcast_c(op, c, lam)
    N, m = b.shape[-2:]
    if m < 2:
        raise ValueError(f"{op}: the per-block LayerNorm needs block size m >= 2 (m = 1 maps every state to "
                         f"bias); use jordan_scan for m = 1")
    for name, p in (("weight", weight), ("bias", bias)):
        try:
            ok = torch.broadcast_shapes(p.shape, (N, m)) == (N, m)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{op}: {name} of shape {tuple(p.shape)} must broadcast to (N, m) = {(N, m)}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")
    which = resolve_backend(backend, b, op=op, available=BACKENDS)
    if which in ("reference", "torch"):
        return jordan_scan_normed_reference(lam, c, b, weight, bias, eps=eps, initial_state=initial_state)
    from .triton import jordan_scan_normed_triton

    return jordan_scan_normed_triton(lam, c, b, weight, bias, eps=eps, initial_state=initial_state)
