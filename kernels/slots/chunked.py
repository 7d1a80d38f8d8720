"""Chunked slot memory in pure PyTorch: the ``torch`` backend's dense layout, which ``auto`` runs on a CPU for
small and moderate slot counts (:mod:`kernels.slots.sparse` for large ones; on CUDA ``auto`` runs
:mod:`kernels.slots.triton`); contract of :func:`kernels.slots.reference.slot_memory_reference` (Xiao et al.,
"RAM-Net", arXiv 2602.11958).

The memory update is linear in the state: with the write weights scattered to a dense length-``M`` vector
``w_t`` (zero off the ``K`` written slots) and the per-slot log decay ``a_t = gamma log(1 - w_t)`` (zero
on unwritten slots), the memory with its normaliser as an extra value column, ``X = [S, z] (M, d_v + 1)``,
follows the diagonal recurrence

    X_t = diag(e^{a_t}) X_{t-1} + w_t [v_t, 1]^T,      o_t = sum_j r_{t,j} S_t[R_{t,j}] / (z_t[R_{t,j}] + eps)

Within a chunk of ``C`` tokens (``A_t`` the inclusive cumulative log decay from the chunk start, dense
``(C, M)``, ``X_0`` the state entering the chunk), the row ``m = R_{t,i}`` read by token ``t`` is

    X_t[m] = e^{A_t[m]} X_0[m] + sum_{s<=t} E[t,i,s] [v_s, 1],     E[t,i,s] = e^{A_t[m] - A_s[m]} w_s[m]

so the reads only need ``E``, ``(C, K, C)`` per chunk: the addresses are sparse, so the intra-chunk
interactions are gathered at the ``K`` read slots instead of formed over all ``M`` (``O(T C K)``, not
``O(T C M)``). With ``q_{t,i} = r_{t,i} / (z_t[R_{t,i}] + eps)`` the output is two matmuls,

    o_t = sum_s P[t,s] v_s + sum_m Q[t,m] S_0[m],   P[t,s] = sum_i q_{t,i} E[t,i,s],
                                                    Q[t,m] = sum_{i: R_{t,i}=m} q_{t,i} e^{A_t[m]}

and the state passes to the next chunk as ``X_C = e^{A_C} X_0 + sum_s (e^{A_C - A_s} w_s) [v_s, 1]^T``
(a loop over chunks). Every exponent is a difference ``A_t - A_s <= 0`` (never ``e^{A_t} / e^{A_s}``),
so strong decays cannot overflow. The gradient of a log decay is a reverse cumulative sum over the chunk
(as in every chunked gated linear attention): when a write nearly empties its slot (``w -> 1`` with a
large ``gamma``) its true gradient is tiny next to the terms that cancel in that sum, so the fp32
gradients of ``w`` and ``gamma`` then carry a larger relative error than the token scan's. Decays below
``3e-38`` are taken as ``3e-38`` (see :func:`_exp_`). The backward is written by hand (the same
quantities in reverse, the chunk loop run backwards); it saves ``O(T C K + T M (d_v + 1) / C)`` per head.

A sequence longer than :data:`kernels.common.SEGMENT` runs in segments of whole chunks with the memory
carried (:func:`kernels.common.in_segments`), so no intermediate grows with the length.

Cost per head ``O(T (C K (d_v + 1) + M (d_v + 1) + M C))`` time: linear in ``T``; the chunk-start states
are ``M (d_v + 1)`` per chunk, so for very large ``M`` the sparse scan (:mod:`kernels.slots.sparse`) is
the lighter path.
"""
from __future__ import annotations

import math

import torch

from ..common import as_state, compute_dtype, in_segments, pad_time, segment_length
from .reference import W_MAX


def _causal(C: int, K: int, like: torch.Tensor) -> torch.Tensor:
    """``(C K, C)`` 0/1, 1 where the writer ``s`` is not after the reader ``t`` (row ``t K + i``)."""
    keep = torch.ones(C, C, dtype=like.dtype, device=like.device).tril()
    return keep[:, None, :].expand(C, K, C).reshape(C * K, C)


def _triangle(C: int, like: torch.Tensor) -> torch.Tensor:
    """``(C, C)`` with ones where ``s <= t`` (row ``s``, column ``t``): ``x @ it`` is a cumsum over ``x``'s last
    axis, ``x @ it.T`` the reverse cumsum."""
    return torch.ones(C, C, dtype=like.dtype, device=like.device).triu()


def _exp_(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """In place ``exp`` of log decays ``x <= 0``, times the 0/1 mask ``keep`` if given. Arguments are clamped
    to ``[log(tiny) + 1, 0]`` first: CPU ``exp`` is many times slower on ``-inf`` (a causal mask) and on
    arguments whose result is denormal (strong decays), so a decay below ``3e-38`` is taken as ``3e-38``
    (it multiplies terms that are then ~30 orders of magnitude below the leading one); the upper clamp
    only removes rounding of ``A_t - A_s`` above 0 and keeps masked-out entries finite."""
    lo = math.log(torch.finfo(x.dtype).tiny) + 1.0
    x.clamp_(min=lo, max=0.0).exp_()
    return x if keep is None else x.mul_(keep)


def _flat_rows(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Slot indices ``(n, G, C, K)`` -> row numbers ``(n G C K,)`` into a ``(n G M, ...)`` table (whole-row
    copies with ``index_select`` / ``index_add_`` are much faster than an element-wise gather)."""
    n, G = idx.shape[:2]
    base = torch.arange(n * G, device=idx.device).view(n, G, 1, 1) * num_slots
    return (idx + base).reshape(-1)


def _decays(wiT, w, gamma, num_slots):
    """Dense slot-major cumulative log decays ``AdT (n, G, M, C)`` and write weights ``WdT`` of every chunk,
    and ``log(1 - min(w, W_MAX))`` per written entry."""
    n, G, C, K = w.shape
    lk = torch.log1p(-w.clamp(max=W_MAX))
    a = (gamma.view(1, G, 1, 1) * lk).transpose(-1, -2)
    # an inclusive cumulative sum over the chunk as a matmul with a triangular ones matrix (a cumsum over
    # a short last axis is several times slower on CPU)
    AdT = torch.matmul(w.new_zeros(n, G, num_slots, C).scatter_(2, wiT, a), _triangle(C, w))
    WdT = w.new_zeros(n, G, num_slots, C).scatter_(2, wiT, w.transpose(-1, -2))
    return AdT, WdT, lk


class _ChunkedSlots(torch.autograd.Function):
    """Inputs chunk-major, ``G = B H``: ``wi, ri (n, G, C, K)`` int64, ``w, r (n, G, C, K)``,
    ``V1 = [v, 1] (n, G, C, d_v + 1)``, ``gamma (G,)``, ``X0 (G, M, d_v + 1)``. Returns
    ``(O1 (n, G, C, d_v + 1), X_T (G, M, d_v + 1))``; ``O1[..., :d_v]`` is the output (the last column
    is scratch and receives no gradient)."""

    @staticmethod
    def forward(ctx, wi, w, ri, r, V1, gamma, X0, num_slots, eps):
        n, G, C, K = wi.shape
        M, dv1 = num_slots, V1.shape[-1]
        wiT, riT = wi.transpose(-1, -2), ri.transpose(-1, -2)  # (n, G, K, C)
        AdT, WdT, lk = _decays(wiT, w, gamma, M)
        Ar = torch.gather(AdT, 2, riT).transpose(-1, -2)  # (n, G, C, K): A_t at the slots t reads
        eAr = _exp_(Ar.clone())
        rows = _flat_rows(ri, M)
        # E[t, i, s] = exp(A_t[m] - A_s[m]) w_s[m], m = R_{t,i}, s <= t
        Ex = AdT.view(-1, C).index_select(0, rows).view(n, G, C * K, C).neg_().add_(Ar.reshape(n, G, C * K, 1))
        _exp_(Ex, _causal(C, K, Ex))
        E = WdT.view(-1, C).index_select(0, rows).view(n, G, C * K, C).mul_(Ex)
        # chunk contributions to the state, and the state entering every chunk
        ete = _exp_(AdT[..., -1:] - AdT)  # (n, G, M, C)
        to_end = ete * WdT
        U = torch.matmul(to_end, V1)  # (n, G, M, d_v + 1)
        dec = _exp_(AdT[..., -1].clone())  # (n, G, M)
        states = V1.new_empty(n + 1, G, M, dv1)
        if X0 is None:
            states[0] = 0
        else:
            states[0] = X0
        for c in range(n):
            torch.addcmul(U[c], dec[c, :, :, None], states[c], out=states[c + 1])
        starts, X = states[:n], states[n]
        # reads: the normaliser at the read rows, then o = P v + Q S_0
        z0r = torch.gather(starts[..., -1], 2, ri.reshape(n, G, C * K)).view(n, G, C, K)
        E5 = E.view(n, G, C, K, C)
        zr = E5.sum(-1).addcmul_(z0r, eAr).add_(eps)
        q = (r / zr).contiguous()
        P = torch.matmul(q.unsqueeze(-2), E5).squeeze(-2)  # (n, G, C, C)
        Q = w.new_zeros(n, G, C, M).scatter_add_(-1, ri, q * eAr)   # a slot read twice counts twice
        O1 = torch.matmul(P, V1).add_(torch.matmul(Q, starts))
        ctx.save_for_backward(wi, w, ri, V1, gamma, Ex, E, eAr, z0r, zr, q, P, Q, starts, dec, AdT, WdT, lk, ete)
        ctx.num_slots, ctx.has_init = M, X0 is not None
        return O1, X

    @staticmethod
    def backward(ctx, dO1, dX_T):
        wi, w, ri, V1, gamma, Ex, E, eAr, z0r, zr, q, P, Q, starts, dec, AdT, WdT, lk, ete = ctx.saved_tensors
        n, G, C, K = wi.shape
        M, dv1 = ctx.num_slots, V1.shape[-1]
        wiT, riT = wi.transpose(-1, -2), ri.transpose(-1, -2)
        dO = dO1.clone()
        dO[..., -1] = 0  # the scratch column
        # chunk-local gradients (given the state entering the chunk)
        dP = torch.matmul(dO, V1.transpose(-1, -2))  # (n, G, C, C)
        dV1 = torch.matmul(P.transpose(-1, -2), dO)  # (n, G, C, d_v + 1)
        dQ = torch.matmul(dO, starts.transpose(-1, -2))  # (n, G, C, M)
        dX_local = torch.matmul(Q.transpose(-1, -2), dO)  # (n, G, M, d_v + 1): last column 0
        E5 = E.view(n, G, C, K, C)
        dQr = torch.gather(dQ, -1, ri)  # (n, G, C, K)
        dq = torch.matmul(E5, dP.unsqueeze(-1)).squeeze(-1).addcmul_(dQr, eAr)
        dr = dq / zr
        dzr = -dr * q
        dX_local[..., -1].scatter_add_(2, ri.reshape(n, G, C * K), (dzr * eAr).reshape(n, G, C * K))
        dAr = (dQr * q + dzr * z0r) * eAr
        # dE[t, i, s] = q[t, i] dP[t, s] + dzr[t, i];  E = Ex * w_s[m]
        dE = (q.unsqueeze(-1) * dP.unsqueeze(-2)).add_(dzr.unsqueeze(-1)).reshape(n, G, C * K, C)
        dWcol = dE * Ex
        dEE = dE.mul_(E)  # the gradient of the exponent A_t[m] - A_s[m]
        dAr = dAr + dEE.view(n, G, C, K, C).sum(-1)
        rows = _flat_rows(ri, M)
        dAdT = w.new_zeros(n, G, M, C)
        dAdT.view(-1, C).index_add_(0, rows, dEE.view(-1, C), alpha=-1)
        dAdT.scatter_add_(2, riT, dAr.transpose(-1, -2))
        dWdT = w.new_zeros(n, G, M, C)
        dWdT.view(-1, C).index_add_(0, rows, dWcol.view(-1, C))
        # the chunk loop, reversed: g = gradient of the state entering chunk c + 1
        grads = V1.new_empty(n + 1, G, M, dv1)
        if dX_T is None:
            grads[n] = 0
        else:
            grads[n] = dX_T
        for c in range(n - 1, -1, -1):
            torch.addcmul(dX_local[c], dec[c, :, :, None], grads[c + 1], out=grads[c])
        dU, g = grads[1:], grads[0]
        ddec = (dU * starts).sum(-1)  # (n, G, M)
        # U = to_end V1, dec = exp(A_C), to_end = exp(A_C - A_s) w_s
        to_end = ete * WdT
        dto_end = torch.matmul(dU, V1.transpose(-1, -2))  # (n, G, M, C)
        dV1 = dV1.add_(torch.matmul(to_end.transpose(-1, -2), dU))
        dWdT.addcmul_(dto_end, ete)
        dY = dto_end.mul_(to_end)
        dAdT.sub_(dY)
        dAdT[..., -1] += dY.sum(-1) + ddec * dec
        # A = cumsum(a): da_t = sum_{t' >= t} dA_t'
        daT = torch.matmul(dAdT, _triangle(C, dAdT).T)
        da = torch.gather(daT, 2, wiT).transpose(-1, -2)  # (n, G, C, K)
        dw = torch.gather(dWdT, 2, wiT).transpose(-1, -2)
        g_ = gamma.view(1, G, 1, 1)
        dlog = torch.where(w <= W_MAX, -g_ / (1 - w.clamp(max=W_MAX)), torch.zeros_like(w))
        dw = dw + da * dlog
        dgamma = (da * lk).sum((0, 2, 3))
        dV1[..., -1] = 0
        return (None, dw, None, dr, dV1, dgamma, g if ctx.has_init else None, None, None)


def slot_memory_chunked(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                        chunk_size: int = 32, initial_state=None):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))``."""
    cd = compute_dtype(v.dtype)
    state = None if initial_state is None else tuple(s.to(cd) for s in initial_state)

    def segment(wi, ww, ri, rw, v_, state):
        return _slots_segment(wi, ww, ri, rw, v_, gamma, num_slots, eps, chunk_size, state)

    o, state = in_segments(segment, (write_idx, write_w, read_idx, read_w, v), state, segment_length(chunk_size))
    return o.to(v.dtype), as_state(state, v)


def _slots_segment(write_idx, write_w, read_idx, read_w, v, gamma, num_slots, eps, chunk_size, initial_state):
    """:func:`slot_memory_chunked` on one segment; output and state in the compute dtype."""
    cd = compute_dtype(v.dtype)
    B, T, H, dv = v.shape
    K = write_idx.shape[-1]
    M, C = num_slots, chunk_size
    n = -(-T // C)
    G = B * H
    pad = n * C - T
    if pad:
        spare = torch.arange(K, device=v.device).expand(B, pad, H, K)  # distinct slots, zero weights
        write_idx, read_idx = torch.cat([write_idx, spare], 1), torch.cat([read_idx, spare], 1)

    def chunked(x):  # (B, T, H, ...) -> (n, G, C, ...), chunk-major: one chunk's states are contiguous
        x = pad_time(x, C)
        x = x.reshape(B, n, C, H, *x.shape[3:])
        return x.permute(1, 0, 3, 2, *range(4, x.ndim)).reshape(n, G, C, *x.shape[4:])

    V1 = torch.cat([chunked(v.to(cd)), v.new_ones(n, G, C, 1, dtype=cd)], -1)
    X0 = None
    if initial_state is not None:
        X0 = torch.cat([initial_state[0].to(cd), initial_state[1].to(cd).unsqueeze(-1)], -1).reshape(G, M, dv + 1)
    O1, X = _ChunkedSlots.apply(chunked(write_idx), chunked(write_w.to(cd)), chunked(read_idx),
                                chunked(read_w.to(cd)), V1, gamma.to(cd).repeat(B), X0, M, eps)
    o = O1[..., :dv].reshape(n, B, H, C, dv).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, dv)[:, :T]
    X = X.view(B, H, M, dv + 1)
    return o, (X[..., :dv], X[..., dv])
