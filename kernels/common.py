"""Small tensor helpers shared by every kernel family (one home for each idiom).

- :func:`compute_dtype` / :func:`at_least_fp32`: statistics, scans and solves run in fp32, but an fp64
  input (a reference or contract check) stays fp64 — never downcast a reference computation.
- :func:`causal_decay_mask`: ``exp(G_t - G_s)`` for ``s <= t`` within a chunk, from inclusive cumulative
  log decays. The segment sums ``G_t - G_s`` are formed directly, never as ``e^{G_t} / e^{G_s}``, so
  strong decays over long chunks do not overflow.
- :func:`pad_time` / :func:`chunk_count`: pad the time axis (dim 1) to a multiple of the chunk length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half / bf16 / fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` of its dtype (a no-op for fp32 and fp64)."""
    return x.to(compute_dtype(x.dtype))


def causal_mask(size: int, device=None) -> torch.Tensor:
    """Lower-triangular boolean ``(size, size)`` mask, ``True`` where ``s <= t``."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def causal_decay_mask(G: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """``M[..., t, s, ...] = exp(G_t - G_s)`` for ``s <= t``, else 0.

    ``G`` holds inclusive cumulative log decays along ``dim`` (the within-chunk time axis); the result
    has that axis replaced by two, ``t`` then ``s``: ``G (b, n, C, h)`` with ``dim=2`` gives
    ``(b, n, C, C, h)``.
    """
    dim = dim % G.ndim
    seg = G.unsqueeze(dim + 1) - G.unsqueeze(dim)  # [..., t, s, ...] = G_t - G_s
    C = G.shape[dim]
    shape = [1] * seg.ndim
    shape[dim], shape[dim + 1] = C, C
    causal = causal_mask(C, G.device).reshape(shape)
    return torch.where(causal, seg, torch.full_like(seg, float("-inf"))).exp()


def pad_time(x: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """Pad dim 1 (time) of ``x`` at the end to a multiple of ``multiple``."""
    pad = (-x.shape[1]) % multiple
    if not pad:
        return x
    spec = [0, 0] * (x.ndim - 2) + [0, pad]
    return F.pad(x, spec, value=value)
