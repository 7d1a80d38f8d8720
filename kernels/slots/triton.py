"""Sparse slot memory in Triton, forward and backward; contract of
:func:`kernels.slots.reference.slot_memory_reference` (equations there, backward in
:mod:`kernels.slots.sparse`).

Sequential over time: one program per (batch, head) walks the ``T`` tokens and, per token, touches only
the ``K`` written and ``K`` read rows of the ``M x d_v`` memory (and of ``z``), which lives in global
memory; a program holds one token's ``K x d_v`` rows in registers (``d_v`` in one tile, so the
normaliser ``z`` is never shared between programs). Time ``O(T K d_v)`` per head, independent of ``M``;
parallelism is ``B * H`` programs, so this is the kernel for large ``M`` (where a dense chunked form
would cost ``O(T M)``), not a chunk-parallel one. ``tl.debug_barrier()`` orders each token's stores
before the next loads, since a read slot may be the one just written (read-after-write).

The decay ``d = (1 - w)^gamma`` is computed in PyTorch and passed in, so its derivative with respect to
``w`` and ``gamma`` is left to autograd; the kernels return ``dL/dd`` next to the direct ``dL/dw``.

- ``_slots_fwd``: writes, then reads; saves the pre-write rows ``P_t = S_{t-1}[W_t]`` and ``z_{t-1}[W_t]``
  (``O(T K d_v)``). With ``READ=False`` it only replays the writes (used by the backward to rebuild the
  final memory instead of saving an ``M x d_v`` tensor).
- ``_slots_bwd``: the reverse scan with the adjoint memory ``G_S (M x d_v)``, ``G_z (M)``, restoring each
  written row from ``P_t`` so the memory at every step is exact.

Indices within one token must be distinct (top-K gives distinct slots). Everything is fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch

__all__ = ["slot_memory_triton"]


@triton.jit
def _slots_fwd(
    WI, WW, DEC, RI, RW, V, S, Z, P, PZ, O,
    T, H, M, K, DV, eps,
    READ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_DV)
    km = offs_k < K
    dm = offs_d < DV
    kd = km[:, None] & dm[None, :]
    s_base = S + pid * M * DV
    z_base = Z + pid * M
    for t in range(T):
        tok = (b * T + t) * H + h
        wi = tl.load(WI + tok * K + offs_k, mask=km, other=0)
        w = tl.load(WW + tok * K + offs_k, mask=km, other=0.0)
        dec = tl.load(DEC + tok * K + offs_k, mask=km, other=0.0)
        v = tl.load(V + tok * DV + offs_d, mask=dm, other=0.0)
        rows = tl.load(s_base + wi[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        zr = tl.load(z_base + wi, mask=km, other=0.0)
        if READ:
            save = (pid * T + t) * K
            tl.store(P + (save + offs_k)[:, None] * DV + offs_d[None, :], rows, mask=kd)
            tl.store(PZ + save + offs_k, zr, mask=km)
        tl.store(s_base + wi[:, None] * DV + offs_d[None, :], dec[:, None] * rows + w[:, None] * v[None, :], mask=kd)
        tl.store(z_base + wi, dec * zr + w, mask=km)
        tl.debug_barrier()
        if READ:
            ri = tl.load(RI + tok * K + offs_k, mask=km, other=0)
            r = tl.load(RW + tok * K + offs_k, mask=km, other=0.0)
            rrows = tl.load(s_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
            rz = tl.load(z_base + ri, mask=km, other=1.0)
            o = tl.sum((r / (rz + eps))[:, None] * rrows, 0)
            tl.store(O + tok * DV + offs_d, o, mask=dm)
            tl.debug_barrier()


@triton.jit
def _slots_bwd(
    WI, WW, DEC, RI, RW, V, S, Z, P, PZ, DO, GS, GZ, DR, DW, DDEC, DVO,
    T, H, M, K, DV, eps,
    BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_DV)
    km = offs_k < K
    dm = offs_d < DV
    kd = km[:, None] & dm[None, :]
    s_base = S + pid * M * DV
    z_base = Z + pid * M
    g_base = GS + pid * M * DV
    gz_base = GZ + pid * M
    for i in range(T):
        t = T - 1 - i
        tok = (b * T + t) * H + h
        # read of token t (it came after the write of t)
        ri = tl.load(RI + tok * K + offs_k, mask=km, other=0)
        r = tl.load(RW + tok * K + offs_k, mask=km, other=0.0)
        do = tl.load(DO + tok * DV + offs_d, mask=dm, other=0.0)
        rows = tl.load(s_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        rz = tl.load(z_base + ri, mask=km, other=1.0)
        inv = 1.0 / (rz + eps)
        dot = tl.sum(rows * do[None, :], 1)
        tl.store(DR + tok * K + offs_k, dot * inv, mask=km)
        g = tl.load(g_base + ri[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        tl.store(g_base + ri[:, None] * DV + offs_d[None, :], g + (r * inv)[:, None] * do[None, :], mask=kd)
        gz = tl.load(gz_base + ri, mask=km, other=0.0)
        tl.store(gz_base + ri, gz - r * inv * inv * dot, mask=km)
        tl.debug_barrier()
        # write of token t
        wi = tl.load(WI + tok * K + offs_k, mask=km, other=0)
        w = tl.load(WW + tok * K + offs_k, mask=km, other=0.0)
        dec = tl.load(DEC + tok * K + offs_k, mask=km, other=0.0)
        v = tl.load(V + tok * DV + offs_d, mask=dm, other=0.0)
        save = (pid * T + t) * K
        prow = tl.load(P + (save + offs_k)[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        pz = tl.load(PZ + save + offs_k, mask=km, other=0.0)
        gs = tl.load(g_base + wi[:, None] * DV + offs_d[None, :], mask=kd, other=0.0)
        gzw = tl.load(gz_base + wi, mask=km, other=0.0)
        tl.store(DVO + tok * DV + offs_d, tl.sum(w[:, None] * gs, 0), mask=dm)
        tl.store(DDEC + tok * K + offs_k, tl.sum(gs * prow, 1) + gzw * pz, mask=km)
        tl.store(DW + tok * K + offs_k, tl.sum(gs * v[None, :], 1) + gzw, mask=km)
        tl.store(g_base + wi[:, None] * DV + offs_d[None, :], dec[:, None] * gs, mask=kd)
        tl.store(gz_base + wi, dec * gzw, mask=km)
        tl.store(s_base + wi[:, None] * DV + offs_d[None, :], prow, mask=kd)
        tl.store(z_base + wi, pz, mask=km)
        tl.debug_barrier()


def _blocks(K, dv):
    return triton.next_power_of_2(K), triton.next_power_of_2(dv)


def _state(S0, z0, B, H, M, dv, like):
    if S0 is None:
        return like.new_zeros(B, H, M, dv), like.new_zeros(B, H, M)
    return S0.float().contiguous().clone(), z0.float().contiguous().clone()


class _TritonSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wi, w, dec, ri, r, v, S0, z0, num_slots, eps):
        B, T, H, K = wi.shape
        dv = v.shape[-1]
        BK, BD = _blocks(K, dv)
        wi, ri = wi.contiguous(), ri.contiguous()
        w, dec, r, v = (x.float().contiguous() for x in (w, dec, r, v))
        S, z = _state(S0, z0, B, H, num_slots, dv, v)
        P = v.new_empty(B, H, T, K, dv)
        Pz = v.new_empty(B, H, T, K)
        o = v.new_empty(B, T, H, dv)
        launch(_slots_fwd, (B * H,), wi, w, dec, ri, r, v, S, z, P, Pz, o, T, H, num_slots, K, dv, eps,
                             READ=True, BLOCK_K=BK, BLOCK_DV=BD)
        ctx.save_for_backward(wi, w, dec, ri, r, v, P, Pz, *(() if S0 is None else (S0, z0)))
        ctx.meta = (num_slots, eps, S0 is None)
        return o, S, z

    @staticmethod
    def backward(ctx, do, dS, dz):
        wi, w, dec, ri, r, v, P, Pz, *init = ctx.saved_tensors
        M, eps, no_init = ctx.meta
        B, T, H, K = wi.shape
        dv = v.shape[-1]
        BK, BD = _blocks(K, dv)
        S, z = _state(*(init if init else (None, None)), B, H, M, dv, v)
        # rebuild the final memory by replaying the writes (nothing M-sized was saved)
        launch(_slots_fwd, (B * H,), wi, w, dec, ri, r, v, S, z, P, Pz, v, T, H, M, K, dv, eps,
                             READ=False, BLOCK_K=BK, BLOCK_DV=BD)
        GS = v.new_zeros(B, H, M, dv) if dS is None else dS.float().contiguous().clone()
        GZ = v.new_zeros(B, H, M) if dz is None else dz.float().contiguous().clone()
        do = v.new_zeros(B, T, H, dv) if do is None else do.float().contiguous()
        dr, dw, ddec = (v.new_empty(B, T, H, K) for _ in range(3))
        dvo = v.new_empty(B, T, H, dv)
        launch(_slots_bwd, (B * H,), wi, w, dec, ri, r, v, S, z, P, Pz, do, GS, GZ, dr, dw, ddec, dvo,
                             T, H, M, K, dv, eps, BLOCK_K=BK, BLOCK_DV=BD)
        dS0, dz0 = (None, None) if no_init else (GS, GZ)
        return None, dw, ddec, None, dr, dvo, dS0, dz0, None, None


def slot_memory_triton(write_idx, write_w, read_idx, read_w, v, gamma, num_slots: int, eps: float = 1e-6,
                       initial_state=None):
    """Returns ``(o (B, T, H, d_v), (S_T (B, H, M, d_v), z_T (B, H, M)))`` (state in fp32)."""
    from .reference import log_keep
    if v.dtype == torch.float64:
        raise TypeError("slot_memory_triton: fp64 is not supported by the Triton kernels; use backend='torch' "
                        "or 'reference' for fp64")
    dec = torch.exp(log_keep(write_w.float(), gamma.float()[:, None]))
    S0, z0 = (None, None) if initial_state is None else initial_state
    o, S, z = _TritonSlots.apply(write_idx, write_w, dec, read_idx, read_w, v, S0, z0, num_slots, eps)
    return o.to(v.dtype), (S, z)
