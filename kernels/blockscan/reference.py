"""Reference block-diagonal linear scans, token by token, fp64-capable (the spec of the family).

Dense blocks (block-diagonal linear recurrent units, Dubinin, Orvieto & Effenberger, arXiv:2602.12021),
per batch element and block ``n`` of size ``m``:

    h_t = A_t h_{t-1} + b_t                          A_t (m, m), b_t, h_t (m,)

Structured Jordan blocks ("The Illusion of State: Sharp Memory-Decay Bounds in Linear State Space
Models", Dadwal, OpenReview 8Kg8lL3L58):

    A_t = lam_t I + c_t N,     (N h)_i = h_{i+1} (h_m := 0)      i.e. the upper Jordan block for c_t = 1
    h_t = lam_t h_{t-1} + c_t N h_{t-1} + b_t

and its normalised variant, a LayerNorm over the ``m`` components of each block after every step:

    h_t = LN(A_t h_{t-1} + b_t),   LN(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

(biased variance, as ``torch.nn.LayerNorm``; see :func:`kernels.blockscan.jordan_scan_normed` for why
the norm runs per block). The ``*_step`` functions are the one-token decode steps; every reference loop
below is built from them. Computation runs in fp32 at least (fp64 inputs stay fp64); the states after every
token are returned in the dtype of ``b``, the final state in :func:`kernels.common.state_dtype` of it (fp32 for
16-bit inputs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import as_state, compute_dtype

__all__ = [
    "block_scan_reference",
    "block_scan_step",
    "jordan_scan_reference",
    "jordan_step",
    "jordan_scan_normed_reference",
    "jordan_step_normed",
    "shift_up",
    "softmax_gates_reference",
]


def _cdt(*xs):
    """The compute dtype of the tensors among ``xs`` (a coupling ``c`` may be a float)."""
    return compute_dtype(*(x for x in xs if torch.is_tensor(x)))


def shift_up(h: torch.Tensor) -> torch.Tensor:
    """``(N h)_i = h_{i+1}`` along the last axis, with zero shifted in at the end."""
    return F.pad(h[..., 1:], (0, 1))


def block_scan_step(A_t: torch.Tensor, b_t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One token: ``h <- A_t h + b_t``; ``A_t (B, N, m, m)``, ``b_t (B, N, m)``, ``h (B, N, m)``."""
    dt = _cdt(A_t, b_t, h)
    return torch.einsum("bnij,bnj->bni", A_t.to(dt), h.to(dt)) + b_t.to(dt)


def jordan_step(lam_t: torch.Tensor, c_t, b_t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One token: ``h <- lam_t h + c_t N h + b_t``; ``lam_t (B, N)``, ``c_t`` broadcastable to
    ``(B, N)`` (a tensor or a float; the ``(1, 1, N)`` coupling of a scan is accepted too), ``b_t`` and
    ``h (B, N, m)``."""
    dt = _cdt(lam_t, b_t, h, c_t)
    h = h.to(dt)
    if torch.is_tensor(c_t):
        while c_t.ndim > lam_t.ndim and c_t.shape[0] == 1:
            c_t = c_t[0]
        try:
            c_t = torch.broadcast_to(c_t.to(dt), lam_t.shape)
        except RuntimeError:
            raise ValueError(f"jordan_step: c_t of shape {tuple(c_t.shape)} does not broadcast to lam_t's shape "
                             f"(B, N) = {tuple(lam_t.shape)}; pass (N,), (1, N), (B, N) or a float") from None
    else:
        c_t = torch.full_like(lam_t, float(c_t), dtype=dt)
    return lam_t.to(dt)[..., None] * h + c_t[..., None] * shift_up(h) + b_t.to(dt)


def _layer_norm(x, weight, bias, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).square().mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + eps) * weight + bias


def jordan_step_normed(lam_t, c_t, b_t, weight, bias, h, eps: float = 1e-5) -> torch.Tensor:
    """One token of the normalised Jordan scan: ``h <- LN(lam_t h + c_t N h + b_t)``, the LayerNorm over
    the ``m`` components of each block; ``weight`` and ``bias`` broadcastable to ``(N, m)``."""
    pre = jordan_step(lam_t, c_t, b_t, h)
    return _layer_norm(pre, weight.to(pre.dtype), bias.to(pre.dtype), eps)


def block_scan_reference(A, b, initial_state=None):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))``."""
    Bsz, T, N, m = b.shape
    dt = _cdt(A, b, initial_state)
    h = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    hs = []
    for t in range(T):
        h = block_scan_step(A[:, t], b[:, t], h)
        hs.append(h)
    return _stack(hs, h, b)


def jordan_scan_reference(lam, c, b, initial_state=None):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))``; ``c`` broadcastable to ``lam (B, T, N)``."""
    Bsz, T, N, m = b.shape
    dt = _cdt(lam, b, initial_state, c)
    h = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    c = torch.broadcast_to(c, lam.shape) if torch.is_tensor(c) else torch.full_like(lam, float(c))
    hs = []
    for t in range(T):
        h = jordan_step(lam[:, t], c[:, t], b[:, t], h)
        hs.append(h)
    return _stack(hs, h, b)


def jordan_scan_normed_reference(lam, c, b, weight, bias, eps: float = 1e-5, initial_state=None):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))`` of ``h_t = LN(A_t h_{t-1} + b_t)``."""
    Bsz, T, N, m = b.shape
    dt = _cdt(lam, b, initial_state, c, weight, bias)
    h = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    c = torch.broadcast_to(c, lam.shape) if torch.is_tensor(c) else torch.full_like(lam, float(c))
    hs = []
    for t in range(T):
        h = jordan_step_normed(lam[:, t], c[:, t], b[:, t], weight, bias, h, eps=eps)
        hs.append(h)
    return _stack(hs, h, b)


def _stack(hs, h_last, like):
    Bsz, T, N, m = like.shape
    if T == 0:
        return like.new_zeros(Bsz, 0, N, m), as_state(h_last, like)
    return torch.stack(hs, dim=1).to(like.dtype), as_state(h_last, like)


def softmax_gates_reference(logits: torch.Tensor, v: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BD-LRU's transition and input from its projections (the spec of :mod:`kernels.blockscan.gates`): each row
    of a block's ``m x (m+1)`` logits (features in the order block, row, column) through a softmax, ``A`` its
    first ``m`` columns and ``b`` its last times ``v``. ``logits (..., N m (m+1))``, ``v (..., N m)``; returns
    ``A (..., N, m, m)`` and ``b (..., N, m)`` in fp32 (fp64 stays fp64)."""
    cd = _cdt(logits, v)
    p = torch.softmax(logits.to(cd).unflatten(-1, (-1, m, m + 1)), dim=-1)
    return p[..., :m], p[..., m] * v.to(cd).unflatten(-1, (-1, m))
