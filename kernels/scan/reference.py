"""The spec of the state pass across chunks: ``S_c = a_c S_{c-1} + X_c`` as a plain loop, differentiated by
autograd (fp64-capable; quadratic memory in the chunk count through autograd's per-step copies, so for
tests and small inputs only)."""
from __future__ import annotations

import torch


def chunk_scan_reference(a: torch.Tensor, X: torch.Tensor, initial: torch.Tensor):
    """``a (*lead, n)``, ``X (*lead, n, *state)``, ``initial (*lead, *state)`` -> ``(starts (*lead, n, *state),
    final (*lead, *state))`` with ``starts[..., c, ...] = S_{c-1}`` and ``S_{-1} = initial``."""
    lead = a.ndim - 1
    extra = X.ndim - a.ndim
    S, starts = initial, []
    for c in range(a.shape[-1]):
        starts.append(S)
        S = a[..., c].reshape(*a.shape[:-1], *([1] * extra)) * S + X.select(lead, c)
    if not starts:
        return X.new_zeros(X.shape), S.clone()
    return torch.stack(starts, lead), S
