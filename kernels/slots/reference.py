"""Reference slot memory with power-decay moving averages, token by token, fp64-capable.

Per head, a memory of ``M`` slots, ``S (M, d_v)`` and a normaliser ``z (M,)``. Token ``t`` writes
``v_t`` to the ``K`` slots ``W_t`` with weights ``w_{t,j}`` and reads the ``K`` slots ``R_t`` with
weights ``r_{t,j}`` (Xiao et al., "RAM-Net", arXiv 2602.11958, power-decay moving average):

    d_{t,j} = (1 - w_{t,j})^gamma = exp(gamma * log(1 - w_{t,j}))
    S_t[m] = d_{t,j} S_{t-1}[m] + w_{t,j} v_t,   z_t[m] = d_{t,j} z_{t-1}[m] + w_{t,j}   for m = W_{t,j}
    S_t[m] = S_{t-1}[m],                        z_t[m] = z_{t-1}[m]                      otherwise
    o_t = sum_j r_{t,j} S_t[R_{t,j}] / (z_t[R_{t,j}] + eps)

In dense form (``w_t``, ``r_t`` the length-``M`` vectors that are zero off the selected slots) this is
``S_t = diag(1 - w_t)^gamma S_{t-1} + w_t v_t^T``, ``o_t = sum_m r_{t,m} S_t[m] / (z_t[m] + eps)``: slots
that are not written do not decay. The read at ``t`` sees the write of ``t`` (read-after-write, as in
linear attention's ``o_t = S_t q_t``), so a single token reads back what it wrote.

Conventions shared by every backend of this family:
- shapes: ``write_idx, read_idx (B, T, H, K)`` int64 slot indices in ``[0, M)``, distinct within one
  token; ``write_w, read_w (B, T, H, K)`` with ``0 <= write_w <= 1``; ``v (B, T, H, d_v)``;
  ``gamma (H,)`` positive; state ``S (B, H, M, d_v)``, ``z (B, H, M)``.
- the decay uses ``min(w, W_MAX)`` with ``W_MAX = 1 - 1e-6``, so that a full write (``w = 1``, e.g. K = 1
  with renormalised weights) keeps ``log(1 - w)`` and its gradient finite; the additive terms use ``w``.

:func:`slot_step` is the one-token update (the decode step): it gathers and scatters only the ``K``
written and ``K`` read rows of the state. :func:`slot_memory_reference` is the loop over it.
"""
from __future__ import annotations

import torch

from ..common import as_state, compute_dtype

W_MAX = 1.0 - 1e-6


def log_keep(w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``gamma * log(1 - min(w, W_MAX))``: the log decay of a slot written with weight ``w``."""
    return gamma * torch.log1p(-w.clamp(max=W_MAX))


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x (B, H, M, ...)`` gathered at ``idx (B, H, K)`` -> ``(B, H, K, ...)``."""
    if x.ndim == 3:
        return torch.gather(x, 2, idx)
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def _put(x: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows at ``idx`` replaced by ``rows`` (out of place, autograd-friendly)."""
    if x.ndim == 3:
        return torch.scatter(x, 2, idx, rows)
    return torch.scatter(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]), rows)


def slot_step(write_idx, write_w, read_idx, read_w, v, gamma, state, eps: float = 1e-6, inplace: bool = False):
    """One token: ``write_idx, write_w, read_idx, read_w (B, H, K)``, ``v (B, H, d_v)``, ``gamma (H,)``,
    ``state = (S (B, H, M, d_v), z (B, H, M))``. Returns ``(o (B, H, d_v), (S, z))``; only the ``K``
    written and ``K`` read rows are computed (the state is returned in the compute dtype).

    ``inplace=False`` returns new state tensors (autograd-friendly, but the scatter copies the whole
    ``M x d_v`` memory); ``inplace=True`` writes the ``K`` rows into the given state tensors when they are
    already in the compute dtype (decoding without autograd: O(K d_v) work per token, whatever ``M``)."""
    dtype = v.dtype
    cd = compute_dtype(dtype)
    S, z = state
    S, z = S.to(cd), z.to(cd)
    w, r, v, gamma = write_w.to(cd), read_w.to(cd), v.to(cd), gamma.to(cd)
    decay = torch.exp(log_keep(w, gamma[None, :, None]))  # (B, H, K)
    S_rows = decay.unsqueeze(-1) * _rows(S, write_idx) + w.unsqueeze(-1) * v.unsqueeze(-2)
    z_rows = decay * _rows(z, write_idx) + w
    if inplace:
        S.scatter_(2, write_idx.unsqueeze(-1).expand(*write_idx.shape, S.shape[-1]), S_rows)
        z.scatter_(2, write_idx, z_rows)
    else:
        S, z = _put(S, write_idx, S_rows), _put(z, write_idx, z_rows)
    o = ((r / (_rows(z, read_idx) + eps)).unsqueeze(-1) * _rows(S, read_idx)).sum(-2)
    return o.to(dtype), (S, z)


def init_slot_state(batch: int, heads: int, slots: int, d_v: int, device=None, dtype=torch.float32):
    """Zero state ``(S (B, H, M, d_v), z (B, H, M))`` in the compute dtype of ``dtype``."""
    cd = compute_dtype(dtype)
    return (torch.zeros(batch, heads, slots, d_v, device=device, dtype=cd),
            torch.zeros(batch, heads, slots, device=device, dtype=cd))


def slot_memory_reference(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int,
                          eps: float = 1e-6, initial_state=None):
    """The token loop over :func:`slot_step`. Returns ``(o (B, T, H, d_v), (S_T, z_T))``."""
    B, T, H, dv = v.shape
    state = init_slot_state(B, H, num_slots, dv, v.device, v.dtype) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        o, state = slot_step(write_idx[:, t], write_w[:, t], read_idx[:, t], read_w[:, t], v[:, t], gamma,
                             state, eps)
        outs.append(o)
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, dv)
    return o, as_state(state, v)
