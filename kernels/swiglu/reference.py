"""The SwiGLU gate in PyTorch (the reference and the CPU path).

Shazeer, "GLU Variants Improve Transformer" (arXiv 2002.05202): a row ``h = [a | b]`` of the fused input
projection (``2 F`` columns) becomes ``y = SiLU(a) * b`` (``F`` columns), ``SiLU(a) = a sigmoid(a)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """``h (..., 2 F)`` -> ``SiLU(h[..., :F]) * h[..., F:]`` in ``h``'s dtype."""
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b
