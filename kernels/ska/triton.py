"""Triton kernels for the SKA post-Cholesky chain, forward and backward.

    Z0 = L^{-1} q,   Z_i = A Z_{i-1} (i = 1..p),   U = L^{-T} Z_p,   y = C U

per (batch, chunk, head) with per-token queries, ``c = t // chunk_size``. ``L^{-1}`` is passed in
precomputed (one triangular solve per chunk in torch; its gradient flows back to ``L`` through
torch's autograd), so every stage is a ``tl.dot`` on tiles held in SRAM. Row-major over tokens:
``Z0 = Q Linv^T``, ``Z_i = Z_{i-1} A^T``, ``U = Z_p Linv``, ``Y = U C^T``.

Backward (a second kernel, one program per (chunk, batch*head) looping over the chunk's tokens, so
the per-chunk gradients need no atomics):

    dU = dY C,  dC = dY^T U,  dLinv = Z_p^T dU + dZ_0^T Q,  dZ_p = dU Linv,
    dZ_{i-1} = dZ_i A,  dA = sum_i dZ_i^T Z_{i-1},  dQ = dZ_0 Linv

(``Z_{i-1}`` is recomputed from ``Z_0``: O(p^2) small matmuls, p is 1-4 in practice).
Everything in fp32 (``input_precision="ieee"``); inputs of other dtypes are cast to fp32 and the
result cast back. Rank and value dim are padded to powers of two >= 16 (zero padding keeps the
padded coordinates at zero through the chain).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import triton_interpreting
from ..launch import launch


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@triton.jit
def _load_mat(ptr, base, nrow, ncol, BROW: tl.constexpr, BCOL: tl.constexpr):
    rows = tl.arange(0, BROW)
    cols = tl.arange(0, BCOL)
    m = (rows[:, None] < nrow) & (cols[None, :] < ncol)
    return tl.load(ptr + base + rows[:, None] * ncol + cols[None, :], mask=m, other=0.0)


@triton.jit
def _store_mat(ptr, base, val, nrow, ncol, BROW: tl.constexpr, BCOL: tl.constexpr):
    rows = tl.arange(0, BROW)
    cols = tl.arange(0, BCOL)
    m = (rows[:, None] < nrow) & (cols[None, :] < ncol)
    tl.store(ptr + base + rows[:, None] * ncol + cols[None, :], val, mask=m)


@triton.jit
def _ska_chain_fwd_kernel(Q, LI, A, Cm, Y, T, H, N, CS, R, P,
                          POW: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    tb = tl.program_id(2)
    b = bh // H
    h = bh % H
    mat = ((b * N + n) * H + h).to(tl.int64)
    li = _load_mat(LI, mat * R * R, R, R, BR, BR)
    aw = _load_mat(A, mat * R * R, R, R, BR, BR)
    cm = _load_mat(Cm, mat * P * R, P, R, BP, BR)
    offs_t = tb * BT + tl.arange(0, BT)                       # token index inside the chunk
    tok = n * CS + offs_t
    tmask = (offs_t < CS) & (tok < T)
    tok64 = b.to(tl.int64) * T + tok.to(tl.int64)           # row in (B*T)
    cr = tl.arange(0, BR)
    cp = tl.arange(0, BP)
    q = tl.load(Q + (tok64[:, None] * H + h) * R + cr[None, :], mask=tmask[:, None] & (cr[None, :] < R), other=0.0)
    z = tl.dot(q, tl.trans(li), input_precision="ieee")
    for _ in tl.static_range(POW):
        z = tl.dot(z, tl.trans(aw), input_precision="ieee")
    u = tl.dot(z, li, input_precision="ieee")
    y = tl.dot(u, tl.trans(cm), input_precision="ieee")
    tl.store(Y + (tok64[:, None] * H + h) * P + cp[None, :], y, mask=tmask[:, None] & (cp[None, :] < P))


@triton.jit
def _ska_chain_bwd_kernel(Q, LI, A, Cm, DY, DQ, DLI, DA, DC, T, H, N, CS, R, P,
                          POW: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr):
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    mat = ((b * N + n) * H + h).to(tl.int64)
    li = _load_mat(LI, mat * R * R, R, R, BR, BR)
    aw = _load_mat(A, mat * R * R, R, R, BR, BR)
    cm = _load_mat(Cm, mat * P * R, P, R, BP, BR)
    cr = tl.arange(0, BR)
    cp = tl.arange(0, BP)
    dli = tl.zeros((BR, BR), dtype=tl.float32)
    da = tl.zeros((BR, BR), dtype=tl.float32)
    dc = tl.zeros((BP, BR), dtype=tl.float32)
    for t0 in range(0, CS, BT):
        offs_t = t0 + tl.arange(0, BT)
        tok = n * CS + offs_t
        tmask = (offs_t < CS) & (tok < T)
        tok64 = b.to(tl.int64) * T + tok.to(tl.int64)           # row in (B*T)
        qmask = tmask[:, None] & (cr[None, :] < R)
        q = tl.load(Q + (tok64[:, None] * H + h) * R + cr[None, :], mask=qmask, other=0.0)
        dy = tl.load(DY + (tok64[:, None] * H + h) * P + cp[None, :], mask=tmask[:, None] & (cp[None, :] < P),
                     other=0.0)
        z0 = tl.dot(q, tl.trans(li), input_precision="ieee")
        zp = z0
        for _ in tl.static_range(POW):
            zp = tl.dot(zp, tl.trans(aw), input_precision="ieee")
        u = tl.dot(zp, li, input_precision="ieee")
        du = tl.dot(dy, cm, input_precision="ieee")                       # (BT, BR)
        dc += tl.dot(tl.trans(dy), u, input_precision="ieee")            # (BP, BR)
        dli += tl.dot(tl.trans(zp), du, input_precision="ieee")
        dz = tl.dot(du, tl.trans(li), input_precision="ieee")            # dZ_p
        for j in tl.static_range(POW):                                  # i = p - j = p .. 1: dz holds dZ_i
            zi = z0
            for _ in tl.static_range(POW - 1 - j):
                zi = tl.dot(zi, tl.trans(aw), input_precision="ieee")    # Z_{i-1}
            da += tl.dot(tl.trans(dz), zi, input_precision="ieee")
            dz = tl.dot(dz, aw, input_precision="ieee")                  # dZ_{i-1}
        dli += tl.dot(tl.trans(dz), q, input_precision="ieee")
        dq = tl.dot(dz, li, input_precision="ieee")
        tl.store(DQ + (tok64[:, None] * H + h) * R + cr[None, :], dq, mask=qmask)
    _store_mat(DLI, mat * R * R, dli, R, R, BR, BR)
    _store_mat(DA, mat * R * R, da, R, R, BR, BR)
    _store_mat(DC, mat * P * R, dc, P, R, BP, BR)


def _block_t(chunk_size: int) -> int:
    return min(64, _pow2(chunk_size)) if not triton_interpreting() else min(32, _pow2(chunk_size))


def _block_t_backward(chunk_size: int, BR: int, BP: int) -> int:
    """Tokens per step of the backward: it keeps six (r x r or P x r) matrices resident next to its token
    tiles, so the token tile shrinks as they grow. Shared memory from Triton 3.7.1's compiler: r 64, P 128 at
    64 tokens took 240 KB (power 2, 3 stages; over the 227 KB of an H100, where it failed), 144 KB at 32 tokens
    (power 4, 1 stage); r 64, P 32 at 64 tokens 176 KB (over the 163 KB of sm_80); r 64, P 256 at 16 tokens
    144 KB."""
    tiles = BR * BP
    if BR >= 128 or tiles > 8192:
        cap = 16
    elif BR >= 64 or tiles > 2048:
        cap = 32
    else:
        cap = 64
    return min(cap, _block_t(chunk_size))


#: the backward's token loop gains little from multi-buffered loads next to its resident matrices, and
#: each extra stage costs shared memory (r 64, P 128, 64 tokens: 240 KB at 3 stages, 192 KB at 1)
BACKWARD_STAGES = 1


class _SKAChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Linv, A, C, q, power: int, chunk_size: int):
        B, T, H, R = q.shape
        N, P = Linv.shape[1], C.shape[-2]
        Linv, A, C, q = (x.contiguous() for x in (Linv, A, C, q))
        y = torch.empty(B, T, H, P, device=q.device, dtype=torch.float32)
        BT = _block_t(chunk_size)
        grid = (N, B * H, triton.cdiv(chunk_size, BT))
        launch(_ska_chain_fwd_kernel, grid, q, Linv, A, C, y, T, H, N, chunk_size, R, P,
                                    POW=power, BT=BT, BR=_pow2(R), BP=_pow2(P))
        ctx.save_for_backward(Linv, A, C, q)
        ctx.power, ctx.chunk_size = power, chunk_size
        return y

    @staticmethod
    def backward(ctx, dy):
        Linv, A, C, q = ctx.saved_tensors
        B, T, H, R = q.shape
        N, P = Linv.shape[1], C.shape[-2]
        dy = dy.contiguous().float()
        dq = torch.empty_like(q)
        dli, da, dc = torch.empty_like(Linv), torch.empty_like(A), torch.empty_like(C)
        BR, BP = _pow2(R), _pow2(P)
        launch(_ska_chain_bwd_kernel, (N, B * H), q, Linv, A, C, dy, dq, dli, da, dc, T, H, N, ctx.chunk_size, R, P,
               POW=ctx.power, BT=_block_t_backward(ctx.chunk_size, BR, BP), BR=BR, BP=BP, num_stages=BACKWARD_STAGES)
        return dli, da, dc, dq, None, None


def ska_chain_triton(Linv, A, C, q, power: int, chunk_size: int):
    """Triton version of :func:`kernels.ska.operator.ska_chain_torch` (same shapes), fp32 inside.

    Linv, A (B, N, H, r, r); C (B, N, H, P, r); q (B, T, H, r), T <= N * chunk_size -> (B, T, H, P).
    """
    B, T, H, R = q.shape
    N = Linv.shape[1]
    if T > N * chunk_size:
        raise ValueError(f"ska_chain: T={T} tokens need at least {-(-T // chunk_size)} chunks, got {N}")
    if power < 0:
        raise ValueError(f"ska_chain: power must be >= 0, got {power}")
    out_dtype = q.dtype
    y = _SKAChain.apply(Linv.float(), A.float(), C.float(), q.float(), int(power), int(chunk_size))
    return y.to(out_dtype)
