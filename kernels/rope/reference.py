"""Rotary position embeddings in PyTorch (the reference and the CPU path).

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv 2104.09864), in the
rotate-half convention: a row ``x`` of even length ``D = 2h`` at position ``p`` is rotated pairwise, the
pair ``(x_i, x_{i+h})`` by the angle ``theta_i = p base^(-i/h)``:

    y_i = x_i cos(theta_i) - x_{i+h} sin(theta_i),    y_{i+h} = x_i sin(theta_i) + x_{i+h} cos(theta_i)

computed in at least fp32 and returned in ``x``'s dtype.
"""
from __future__ import annotations

import torch

from ..common import compute_dtype


def rope_reference(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x (B, T, H, D)`` by ``positions (T)`` (D even)."""
    half = x.shape[-1] // 2
    dtype = compute_dtype(x.dtype)
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]  # (T, half)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def rotary_reference(x: torch.Tensor, start: int = 0, base: float = 10000.0, rotated: int | None = None):
    """``x (B, T, G, D)`` at positions ``start .. start + T - 1``: the first ``rotated`` groups (all by
    default) rotated, the others copied; a new tensor."""
    rotated = x.shape[2] if rotated is None else rotated
    positions = torch.arange(start, start + x.shape[1], device=x.device)
    return torch.cat([rope_reference(x[:, :, :rotated], positions, base), x[:, :, rotated:]], dim=2)
