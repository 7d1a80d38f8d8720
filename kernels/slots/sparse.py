"""Sparse slot memory in PyTorch: per token, only the ``K`` written and ``K`` read slot rows are touched;
contract of :func:`kernels.slots.reference.slot_memory_reference` (equations there).

A ``torch.autograd.Function`` with a sequential loop over ``T`` (gather / scatter of ``K`` rows per head
per token, vectorised over batch and heads). Time is ``O(T K d_v)`` and the tensors saved for the
backward are ``O(T K d_v)`` (the pre-write rows of the written slots, indices, weights, values):
nothing saved grows with ``M``. The backward is a reverse scan: it replays the writes to rebuild the
final state (``O(T K d_v)``, cheaper than saving an ``M x d_v`` memory), then walks back in time with an
adjoint memory ``G_S (M, d_v)``, ``G_z (M,)``, restoring each written row from its saved pre-write value,
so the memory at every step is recovered exactly (no division by the decay). At token ``t``, with
``d_j = (1 - w_j)^gamma``, ``m = W_{t,j}``, ``P_j = S_{t-1}[m]`` and ``n = R_{t,j}``:

    read:  dr_j = do . S_t[n] / (z_t[n] + eps);   G_S[n] += r_j do / (z_t[n] + eps);
           G_z[n] -= r_j (do . S_t[n]) / (z_t[n] + eps)^2
    write: dv += sum_j w_j G_S[m];   c_j = G_S[m] . P_j + G_z[m] z_{t-1}[m]
           dw_j = G_S[m] . v + G_z[m] + c_j d_j d(log d_j)/dw_j;   dgamma += c_j d_j log(1 - w_j)
           G_S[m] <- d_j G_S[m];   G_z[m] <- d_j G_z[m]

The working memory ``S`` itself is ``M x d_v`` per head (it is the decode state), allocated once per call.
"""
from __future__ import annotations

import torch

from ..common import as_state, compute_dtype
from .reference import W_MAX


def _flat(idx: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``(B, T, H, K)`` slot indices -> ``(T, B*H*K)`` row indices into a ``(B*H*M, ...)`` memory."""
    B, T, H, K = idx.shape
    base = (torch.arange(B * H, device=idx.device) * num_slots).reshape(B, 1, H, 1)
    return (idx + base).permute(1, 0, 2, 3).reshape(T, B * H * K)


def _by_time(x: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, K[, ...])`` -> ``(T, B*H*K[, ...])``."""
    B, T, H, K = x.shape[:4]
    return x.transpose(0, 1).reshape(T, B * H * K, *x.shape[4:])


def _replay(S, z, wi, new_rows, new_z):
    for t in range(wi.shape[0]):
        S.index_copy_(0, wi[t], new_rows[t])
        z.index_copy_(0, wi[t], new_z[t])


class _SparseSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, write_idx, write_w, read_idx, read_w, v, gamma, S0, z0, num_slots, eps):
        B, T, H, K = write_idx.shape
        dv = v.shape[-1]
        M = num_slots
        wi, ri = _flat(write_idx, M), _flat(read_idx, M)
        w, r = _by_time(write_w), _by_time(read_w)  # (T, BHK)
        g = gamma.reshape(1, 1, H, 1).expand(B, T, H, K)
        wc = w.clamp(max=W_MAX)
        dec = torch.exp(_by_time(g) * torch.log1p(-wc))
        vk = _by_time(v.unsqueeze(3).expand(B, T, H, K, dv))  # (T, BHK, dv)
        S = v.new_zeros(B * H * M, dv) if S0 is None else S0.reshape(B * H * M, dv).clone()
        z = v.new_zeros(B * H * M) if z0 is None else z0.reshape(B * H * M).clone()
        P = v.new_empty(T, B * H * K, dv)
        Pz = v.new_empty(T, B * H * K)
        o = v.new_empty(T, B * H, dv)
        for t in range(T):
            rows, zr = S.index_select(0, wi[t]), z.index_select(0, wi[t])
            P[t], Pz[t] = rows, zr
            S.index_copy_(0, wi[t], dec[t, :, None] * rows + w[t, :, None] * vk[t])
            z.index_copy_(0, wi[t], dec[t] * zr + w[t])
            coef = r[t] / (z.index_select(0, ri[t]) + eps)
            o[t] = (coef[:, None] * S.index_select(0, ri[t])).reshape(B * H, K, dv).sum(1)
        ctx.save_for_backward(wi, ri, w, r, dec, vk, P, Pz, gamma,
                              *(() if S0 is None else (S0, z0)))
        ctx.meta = (B, T, H, K, dv, M, eps, S0 is None)
        return (o.reshape(T, B, H, dv).transpose(0, 1), S.reshape(B, H, M, dv), z.reshape(B, H, M))

    @staticmethod
    def backward(ctx, do, dS_T, dz_T):
        B, T, H, K, dv, M, eps, no_init = ctx.meta
        wi, ri, w, r, dec, vk, P, Pz, gamma, *init = ctx.saved_tensors
        # rebuild the final memory by replaying the writes
        S = P.new_zeros(B * H * M, dv) if no_init else init[0].reshape(B * H * M, dv).clone()
        z = P.new_zeros(B * H * M) if no_init else init[1].reshape(B * H * M).clone()
        _replay(S, z, wi, dec[..., None] * P + w[..., None] * vk, dec * Pz + w)
        GS = P.new_zeros(B * H * M, dv) if dS_T is None else dS_T.reshape(B * H * M, dv).clone()
        Gz = P.new_zeros(B * H * M) if dz_T is None else dz_T.reshape(B * H * M).clone()
        do = (P.new_zeros(T, B * H, dv) if do is None else
              do.transpose(0, 1).reshape(T, B * H, 1, dv).expand(T, B * H, K, dv).reshape(T, B * H * K, dv))
        dr = P.new_empty(T, B * H * K)
        gS = P.new_empty(T, B * H * K, dv)
        gz = P.new_empty(T, B * H * K)
        for t in reversed(range(T)):
            inv = 1.0 / (z.index_select(0, ri[t]) + eps)
            dot = (do[t] * S.index_select(0, ri[t])).sum(-1)
            dr[t] = dot * inv
            GS.index_add_(0, ri[t], (r[t] * inv)[:, None] * do[t])
            Gz.index_add_(0, ri[t], -r[t] * inv * inv * dot)
            gS[t], gz[t] = GS.index_select(0, wi[t]), Gz.index_select(0, wi[t])
            GS.index_copy_(0, wi[t], dec[t, :, None] * gS[t])
            Gz.index_copy_(0, wi[t], dec[t] * gz[t])
            S.index_copy_(0, wi[t], P[t])
            z.index_copy_(0, wi[t], Pz[t])
        c = (gS * P).sum(-1) + gz * Pz
        wc = w.clamp(max=W_MAX)
        g = gamma.reshape(1, 1, H, 1).expand(B, 1, H, K).reshape(1, B * H * K)
        dlog = torch.where(w <= W_MAX, -g / (1 - wc), torch.zeros_like(w))
        dw = (gS * vk).sum(-1) + gz + c * dec * dlog
        dgamma = (c * dec * torch.log1p(-wc)).reshape(T, B, H, K).sum((0, 1, 3))
        dvv = (w[..., None] * gS).reshape(T, B, H, K, dv).sum(3).transpose(0, 1)

        def unflat(x):
            return x.reshape(T, B, H, K).transpose(0, 1)

        dS0 = None if no_init else GS.reshape(B, H, M, dv)
        dz0 = None if no_init else Gz.reshape(B, H, M)
        return None, unflat(dw), None, unflat(dr), dvv, dgamma, dS0, dz0, None, None


def slot_memory_sparse(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                       initial_state=None):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))``."""
    dtype = v.dtype
    cd = compute_dtype(dtype)
    S0, z0 = (None, None) if initial_state is None else (initial_state[0].to(cd), initial_state[1].to(cd))
    o, S, z = _SparseSlots.apply(write_idx, write_w.to(cd), read_idx, read_w.to(cd), v.to(cd), gamma.to(cd),
                                 S0, z0, num_slots, eps)
    return o.to(dtype), as_state((S, z), dtype)
