"""Clebsch-Gordan key lift: a degree-2 feature map of keys and queries, from the appendix "Clebsch-Gordan
Invariant Lift" of Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral Koopman
Operators" (arXiv 2605.06997).

The r components of a key are grouped in even-odd pairs (a_i, b_i) = (k_{2i}, k_{2i+1}), i < r/2, read as
complex numbers z_i = a_i + i b_i. A position-dependent rotation (a rotary phase) multiplies each by its
own e^{i theta_i}. The degree-2 products of a pair split into

    invariant (trivial representation):      |z_i|^2 = a_i^2 + b_i^2          unchanged by any theta_i
    second harmonic (equivariant):           z_i^2   = (a_i^2 - b_i^2, 2 a_i b_i)   rotated by 2 theta_i

Lifts (``lift`` argument), for x (..., r) with r even:

- ``none``: x itself (r features);
- ``cg_invariant``: (|z_0|^2, ..., |z_{r/2-1}|^2) (r/2 features): a Gram matrix of these features does
  not depend on the rotations (the appendix's phase cancellation);
- ``cg``: the invariant block followed by the harmonic pairs (Re z_0^2, Im z_0^2, Re z_1^2, ...) (3r/2
  features), the appendix's "full feature map" combining the invariant and equivariant channels.

Both lifts are homogeneous of degree 2: lift(c x) = c^2 lift(x).
"""
from __future__ import annotations

import torch

KEY_LIFTS = ("none", "cg_invariant", "cg")


def lifted_dim(rank: int, lift: str) -> int:
    """Number of features :func:`key_lift` makes of ``rank`` components."""
    if lift == "none":
        return rank
    if lift == "cg_invariant":
        return rank // 2
    if lift == "cg":
        return 3 * (rank // 2)
    raise ValueError(f"unknown key lift {lift!r}; choose one of {', '.join(KEY_LIFTS)}")


def key_lift(x: torch.Tensor, lift: str) -> torch.Tensor:
    """(..., r) -> (..., lifted_dim(r, lift)); ``none`` returns ``x`` itself (the same tensor)."""
    if lift == "none":
        return x
    if lift not in KEY_LIFTS:
        raise ValueError(f"unknown key lift {lift!r}; choose one of {', '.join(KEY_LIFTS)}")
    if x.shape[-1] % 2:
        raise ValueError(f"key lift {lift!r} pairs components (2i, 2i+1): the last dimension must be even, "
                         f"got {x.shape[-1]}")
    a, b = x[..., 0::2], x[..., 1::2]
    invariant = a * a + b * b
    if lift == "cg_invariant":
        return invariant
    harmonic = torch.stack((a * a - b * b, 2 * a * b), dim=-1).flatten(-2)
    return torch.cat((invariant, harmonic), dim=-1)
