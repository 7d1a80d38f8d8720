"""Chunked PyTorch block scans (the CPU default), linear in ``T`` in time and memory.

For ``h_t = A_t h_{t-1} + b_t`` (dense blocks of block-diagonal linear recurrent units,
arXiv:2602.12021) the sequence is cut into chunks of ``C`` tokens. Within chunk ``c``, with ``s`` its
first token, all chunks at once (a loop over the ``C`` positions, batched over chunks, batch and blocks):

    P_t = A_t P_{t-1},  P_{s-1} = I            (cumulative transition,   P_t = A_t ... A_s)
    l_t = A_t l_{t-1} + b_t,  l_{s-1} = 0      (local state from a zero start)

then a sequential pass over the ``T / C`` chunks carries the state (one batched mat-vec per chunk),
``H_{c+1} = P_{last} H_c + l_{last}``, and finally ``h_t = l_t + P_t H_c``. No ``T x T`` mask and no
log-depth recursion; the backward is torch autograd through these ops, which saves ``O(T m^2)``
(every input slice is taken with ``unbind`` so the backward stacks each gradient once instead of
allocating a full-size gradient per slice).

For the Jordan transition ``A_t = lam_t I + c_t N`` ("The Illusion of State: Sharp Memory-Decay
Bounds in Linear State Space Models", OpenReview 8Kg8lL3L58) every factor is a polynomial in the
nilpotent shift ``N`` (``N^m = 0``), so ``P_t = sum_{j<m} e_{t,j} N^j`` and multiplying by one more
factor is ``O(m)``: ``e_{t,j} = lam_t e_{t-1,j} + c_t e_{t-1,j-1}``. Applying ``P_t`` to the carried
state is ``(P_t H)_i = sum_j e_{t,j} H_{i+j}`` (``O(m^2)``, a Hankel gather of ``H``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import compute_dtype, pad_time
from .reference import shift_up

__all__ = ["block_scan_chunked", "jordan_scan_chunked"]


def _dtype(*xs):
    dt = xs[0].dtype
    for x in xs[1:]:
        if torch.is_tensor(x):
            dt = torch.promote_types(dt, x.dtype)
    return compute_dtype(dt)


def _carry(step, n_chunks_inputs, h0):
    """Sequential pass over chunks: returns the stacked states entering each chunk and the last one."""
    starts = []
    h = h0
    for inputs in n_chunks_inputs:
        starts.append(h)
        h = step(h, *inputs)
    return torch.stack(starts, dim=1), h


def block_scan_chunked(A, b, initial_state=None, chunk_size: int = 64):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))``; see the module docstring."""
    Bsz, T, N, m = b.shape
    dt = _dtype(A, b, initial_state)
    h0 = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return b.new_zeros(Bsz, 0, N, m), h0.to(b.dtype)
    C = min(chunk_size, T)
    nc = -(-T // C)
    Ac = pad_time(A.to(dt), C).reshape(Bsz, nc, C, N, m, m)
    bc = pad_time(b.to(dt), C).reshape(Bsz, nc, C, N, m)
    A_steps = Ac.unbind(2)
    b_steps = bc.unbind(2)
    P, L = A_steps[0], b_steps[0]
    Ps, Ls = [P], [L]
    for A_i, b_i in zip(A_steps[1:], b_steps[1:]):
        P = A_i @ P
        L = (A_i @ L.unsqueeze(-1)).squeeze(-1) + b_i
        Ps.append(P)
        Ls.append(L)
    P_all = torch.stack(Ps, dim=2)  # (B, nc, C, N, m, m)
    L_all = torch.stack(Ls, dim=2)  # (B, nc, C, N, m)
    # padded positions sit at the end of the last chunk, whose outgoing state is never used
    H0, _ = _carry(
        lambda h, P_c, l_c: (P_c @ h.unsqueeze(-1)).squeeze(-1) + l_c,
        zip(Ps[-1].unbind(1), Ls[-1].unbind(1)),
        h0,
    )
    h = L_all + (P_all @ H0[:, :, None, :, :, None]).squeeze(-1)
    h = h.reshape(Bsz, nc * C, N, m)[:, :T]
    return h.to(b.dtype), h[:, -1].to(b.dtype)


def _hankel(h):
    """``H[..., i, j] = h[..., i + j]`` (zero past the end): ``(..., m) -> (..., m, m)``."""
    m = h.shape[-1]
    return F.pad(h, (0, m)).unfold(-1, m, 1)[..., :m, :]


def _poly_apply(e, h):
    """``(sum_j e_j N^j) h`` for polynomial coefficients ``e (..., m)`` and vectors ``h (..., m)``."""
    return (_hankel(h) * e.unsqueeze(-2)).sum(-1)


def jordan_scan_chunked(lam, c, b, initial_state=None, chunk_size: int = 64):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))``; ``c`` broadcastable to ``lam (B, T, N)``."""
    Bsz, T, N, m = b.shape
    dt = _dtype(lam, b, initial_state, c)
    h0 = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return b.new_zeros(Bsz, 0, N, m), h0.to(b.dtype)
    C = min(chunk_size, T)
    nc = -(-T // C)
    lam_c = pad_time(lam.to(dt), C).reshape(Bsz, nc, C, N, 1)
    c_c = pad_time(torch.broadcast_to(c.to(dt), lam.shape), C).reshape(Bsz, nc, C, N, 1)
    b_c = pad_time(b.to(dt), C).reshape(Bsz, nc, C, N, m)
    lam_s, c_s, b_s = lam_c.unbind(2), c_c.unbind(2), b_c.unbind(2)
    # P_s = lam_s + c_s N, l_s = b_s
    e = F.pad(torch.cat([lam_s[0], c_s[0]], dim=-1), (0, m - 2)) if m >= 2 else lam_s[0]
    L = b_s[0]
    Es, Ls = [e], [L]
    for lam_i, c_i, b_i in zip(lam_s[1:], c_s[1:], b_s[1:]):
        e = lam_i * e + c_i * F.pad(e[..., :-1], (1, 0))
        L = lam_i * L + c_i * shift_up(L) + b_i
        Es.append(e)
        Ls.append(L)
    E_all = torch.stack(Es, dim=2)  # (B, nc, C, N, m) polynomial coefficients of P_t
    L_all = torch.stack(Ls, dim=2)
    H0, _ = _carry(
        lambda h, e_c, l_c: _poly_apply(e_c, h) + l_c,
        zip(Es[-1].unbind(1), Ls[-1].unbind(1)),
        h0,
    )
    h = L_all + (_hankel(H0)[:, :, None] * E_all.unsqueeze(-2)).sum(-1)
    h = h.reshape(Bsz, nc * C, N, m)[:, :T]
    return h.to(b.dtype), h[:, -1].to(b.dtype)
