"""Chunked PyTorch block scans, linear in ``T`` in time and memory: the ``torch`` backend, which ``auto`` runs on
a CPU (on CUDA ``auto`` runs :mod:`kernels.blockscan.triton`).

For ``h_t = A_t h_{t-1} + b_t`` (dense blocks of block-diagonal linear recurrent units,
arXiv:2602.12021) the sequence is cut into chunks of ``C`` tokens and, batched over all chunks, batch
and blocks at once:

1. each chunk's composite affine map ``h -> P h + l`` (``P = A_last ... A_first``, ``l`` the chunk's
   state from a zero start) by pairwise composition, ``(P2, l2) o (P1, l1) = (P2 P1, P2 l1 + l2)``,
   in ``ceil(log2 C)`` batched steps (``O(m^3)`` per token in total, as batched ``bmm``);
2. a sequential pass over the ``T / C`` chunks for the state entering each chunk,
   ``H_{c+1} = P_c H_c + l_c`` (one batched mat-vec per chunk);
3. the recurrence inside every chunk from its true start state, ``C`` steps of batched mat-vecs.

A sequence longer than :data:`kernels.common.SEGMENT` runs in segments of whole chunks with the state carried
(:func:`kernels.common.in_segments`), so no intermediate grows with the length. No ``T x T`` mask and no
log-depth recursion over the whole sequence; the backward is torch autograd
through these ops, which saves ``O(T m^2)``. Inputs are split with ``unbind``/``split``/``unflatten``
rather than strided slicing, whose backward would allocate a full-size gradient per slice.

For the Jordan transition ``A_t = lam_t I + c_t N`` ("The Illusion of State: Sharp Memory-Decay
Bounds in Linear State Space Models", OpenReview 8Kg8lL3L58) every factor is a polynomial in the
nilpotent shift ``N`` (``N^m = 0``), so ``P_t = sum_{j<m} e_{t,j} N^j`` and multiplying by one more
factor is ``O(m)``: ``e_{t,j} = lam_t e_{t-1,j} + c_t e_{t-1,j-1}``. Applying ``P_t`` to the carried
state is ``(P_t H)_i = sum_j e_{t,j} H_{i+j}`` (``O(m^2)``, a Hankel gather of ``H``). Here the Jordan
path keeps the cumulative form: polynomials ``e_t`` and local states ``l_t`` for every position (a loop
over the ``C`` positions, ``O(m)`` each), the pass over chunks, then ``h_t = l_t + P_t H_c``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import as_state, compute_dtype, in_segments, pad_time, segment_length
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


def _affine_tree(P, l):
    """Compose the affine maps ``h -> P_i h + l_i`` along dim 2 (time, earliest first) by pairwise
    halving: ``log2(C)`` batched steps. Returns the composite ``(P, l)`` with dim 2 of size 1."""
    while P.shape[2] > 1:
        tail_P = tail_l = None
        if P.shape[2] % 2:
            P, tail_P = P.split([P.shape[2] - 1, 1], dim=2)
            l, tail_l = l.split([l.shape[2] - 1, 1], dim=2)
        # pairs via reshape + unbind, not strided slices: a slice's backward allocates a full-size gradient
        P_e, P_o = P.unflatten(2, (-1, 2)).unbind(3)  # earlier, later of each pair
        l_e, l_o = l.unflatten(2, (-1, 2)).unbind(3)
        l = (P_o @ l_e.unsqueeze(-1)).squeeze(-1) + l_o
        P = P_o @ P_e
        if tail_P is not None:
            P, l = torch.cat([P, tail_P], dim=2), torch.cat([l, tail_l], dim=2)
    return P, l


def block_scan_chunked(A, b, initial_state=None, chunk_size: int = 64):
    """Returns ``(h (B, T, N, m), h_last (B, N, m))``; see the module docstring."""
    Bsz, T, N, m = b.shape
    dt = _dtype(A, b, initial_state)
    h0 = b.new_zeros(Bsz, N, m, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return b.new_zeros(Bsz, 0, N, m), as_state(h0, b)
    h, h_last = in_segments(lambda A, b_, h: _block_segment(A, b_, h, chunk_size, dt), (A, b), h0,
                            segment_length(chunk_size))
    return h.to(b.dtype), as_state(h_last, b)


def _block_segment(A, b, h0, chunk_size, dt):
    """:func:`block_scan_chunked` on one segment from ``h0`` in the compute dtype ``dt``: ``(h, h_last)`` in ``dt``."""
    Bsz, T, N, m = b.shape
    C = min(chunk_size, T)
    nc = -(-T // C)
    Ac = pad_time(A.to(dt), C).reshape(Bsz, nc, C, N, m, m)
    bc = pad_time(b.to(dt), C).reshape(Bsz, nc, C, N, m)
    # 1. each chunk's composite map (P_last, l_last); the padded positions (A = 0) sit at the end of
    #    the last chunk, whose outgoing state is never used
    P_last, l_last = _affine_tree(Ac, bc)
    # 2. sequential pass over chunks for the state entering each chunk
    H0, _ = _carry(
        lambda h, P_c, l_c: (P_c @ h.unsqueeze(-1)).squeeze(-1) + l_c,
        zip(P_last[:, :, 0].unbind(1), l_last[:, :, 0].unbind(1)),
        h0,
    )
    # 3. the recurrence inside every chunk at once from its true start state (batched mat-vecs)
    At = Ac.movedim(2, 0)
    bt = bc.movedim(2, 0)
    h, hs = H0, []
    for A_i, b_i in zip(At.unbind(0), bt.unbind(0)):
        h = (A_i @ h.unsqueeze(-1)).squeeze(-1) + b_i
        hs.append(h)
    h = torch.stack(hs, dim=2).reshape(Bsz, nc * C, N, m)[:, :T]
    return h, h[:, -1]


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
        return b.new_zeros(Bsz, 0, N, m), as_state(h0, b)
    c = torch.broadcast_to(c.to(dt), lam.shape)
    h, h_last = in_segments(lambda lam, c, b_, h: _jordan_segment(lam, c, b_, h, chunk_size, dt), (lam, c, b), h0,
                            segment_length(chunk_size))
    return h.to(b.dtype), as_state(h_last, b)


def _jordan_segment(lam, c, b, h0, chunk_size, dt):
    """:func:`jordan_scan_chunked` on one segment from ``h0`` in the compute dtype ``dt``; ``c`` the shape of
    ``lam``: ``(h, h_last)`` in ``dt``."""
    Bsz, T, N, m = b.shape
    C = min(chunk_size, T)
    nc = -(-T // C)
    lam_c = pad_time(lam.to(dt), C).reshape(Bsz, nc, C, N, 1)
    c_c = pad_time(c, C).reshape(Bsz, nc, C, N, 1)
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
    return h, h[:, -1]
