"""Triton kernels for the SKA post-Cholesky chain, forward and backward.

    y_t = W_c q_t,   W_c = C_c L_c^{-T} A_c^p L_c^{-1}   (c = t // chunk_size)

The per-chunk operator ``W`` (P x r) is formed once per chunk by
:func:`kernels.ska.operator.chain_operator` — ``p + 2`` small batched products in the factors' dtype
(fp32), differentiated by autograd — and the kernels apply it to the tokens: per (chunk, batch x head)
and tile of tokens x value dims, ``Y = Q W^T`` (forward); ``dQ = dY W`` and ``dW = dY^T Q`` summed over
the chunk's tokens (backward: one launch, whose programs either own a token tile (``dQ``) or a tile of
value dims (``dW``), so every sum over tokens stays in one program, without atomics).

Precision. fp32 queries: exact fp32 products (``input_precision="ieee"``). bf16/fp16 queries: every
product takes 16-bit operands with fp32 accumulation. The queries are inputs and ``dY`` arrives as the
gradient of a 16-bit output (both exact in 16 bits); ``W`` is rounded once. Measured against fp64 (SKA
chunk_causal, chunk 64, r 32, P 64, ridge 1e-3 and 0.1, both normalisations): one rounding of ``W``
gives 1.6e-3 (bf16) / 2.1e-4 (fp16), the same as rounding ``y`` to the output dtype; two 16-bit pieces
of ``W`` would give 2.5e-6 / 5e-7, below anything a 16-bit output keeps. ``W``'s own products stay fp32:
they are per chunk (~1/chunk_size of the per-token work), on the factors of a Cholesky and a triangular
solve, in PyTorch. For fp16 (max 65504) ``W`` is divided by a power of two near its largest magnitude
and ``dY``'s rows (products over value dims) or columns (products over tokens) likewise.

Rank and value dim are padded to powers of two >= 16 (zero padding keeps the padded coordinates at zero).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launch import launch
from .operator import chain_operator

#: constexpr codes of the product operand dtype
_OPERAND = {torch.bfloat16: 1, torch.float16: 2}


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@triton.jit
def _op(a, OP: tl.constexpr):
    """``a`` as a product operand: unchanged (fp32), bf16 (OP 1) or fp16 (OP 2)."""
    if OP == 1:
        out = a.to(tl.bfloat16)
    elif OP == 2:
        out = a.to(tl.float16)
    else:
        out = a
    return out


@triton.jit
def _mm(a, b, OP: tl.constexpr):
    """``a @ b`` accumulated in fp32: exact fp32 products (OP 0) or 16-bit operands."""
    if OP == 0:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(_op(a, OP), _op(b, OP))
    return out


@triton.jit
def _pow2_scale(m):
    """A power of two at or above ``m`` (1 where ``m`` is 0): dividing by it is exact."""
    return tl.where(m > 0, tl.exp2(tl.ceil(tl.log2(tl.where(m > 0, m, 1.0)))), 1.0)


@triton.jit
def _tile(ptr, base, rows, cols, nrow, ncol, stride):
    """``ptr[base + rows x stride + cols]`` (fp32), zero outside ``rows < nrow``, ``cols < ncol``."""
    m = (rows[:, None] < nrow) & (cols[None, :] < ncol)
    return tl.load(ptr + base + rows[:, None] * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _ska_apply_kernel(Q, W, Y, T, H, N, CS, R, P, NPB,
                      BT: tl.constexpr, BR: tl.constexpr, BPB: tl.constexpr, OP: tl.constexpr):
    """``Y[tokens, pdims] = Q[tokens] W_c[pdims]^T`` for one tile of a chunk's tokens and value dims."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    tb = tl.program_id(2) // NPB
    pb = tl.program_id(2) % NPB
    b = bh // H
    h = bh % H
    mat = ((b * N + n) * H + h).to(tl.int64)
    offs_t = tb * BT + tl.arange(0, BT)                      # token index inside the chunk
    tok = n * CS + offs_t
    ntok = tl.minimum(CS, T - n * CS)                        # tokens of this chunk
    rows = b.to(tl.int64) * T * H + (n * CS).to(tl.int64) * H + h   # row of the chunk's first token in (B*T*H)
    offs_p = pb * BPB + tl.arange(0, BPB)
    cr = tl.arange(0, BR)
    q = _tile(Q, rows * R, offs_t, cr, ntok, R, H * R)      # (BT, BR)
    w = _tile(W, mat * P * R + pb * BPB * R, tl.arange(0, BPB), cr, P - pb * BPB, R, R)   # (BPB, BR)
    if OP == 2:
        ws = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
        w = w / ws
    else:
        ws = 1.0
    y = _mm(q, tl.trans(w), OP) * ws
    ymask = (offs_t[:, None] < ntok) & (offs_p[None, :] < P) & (tok[:, None] < T)
    tl.store(Y + rows * P + offs_t[:, None] * (H * P) + offs_p[None, :], y, mask=ymask)


@triton.jit
def _ska_apply_bwd_kernel(Q, W, DY, DQ, DW, T, H, N, CS, R, P, NTB, NPB,
                          BT: tl.constexpr, BR: tl.constexpr, BPB: tl.constexpr, OP: tl.constexpr):
    """Program ``j < NTB``: ``dQ`` of token tile ``j`` (summed over value tiles). Program ``NTB + i``: ``dW`` of
    value tile ``i`` (summed over the chunk's token tiles)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    j = tl.program_id(2)
    b = bh // H
    h = bh % H
    mat = ((b * N + n) * H + h).to(tl.int64)
    ntok = tl.minimum(CS, T - n * CS)
    rows = b.to(tl.int64) * T * H + (n * CS).to(tl.int64) * H + h
    cr = tl.arange(0, BR)
    cp = tl.arange(0, BPB)
    if j < NTB:
        offs_t = j * BT + tl.arange(0, BT)
        dq = tl.zeros([BT, BR], dtype=tl.float32)
        for pb in range(NPB):
            dy = _tile(DY, rows * P + pb * BPB, offs_t, cp, ntok, P - pb * BPB, H * P)    # (BT, BPB)
            w = _tile(W, mat * P * R + pb * BPB * R, cp, cr, P - pb * BPB, R, R)       # (BPB, BR)
            if OP == 2:  # rows of dY and all of W into fp16's range (both factor out)
                ys = _pow2_scale(tl.max(tl.abs(dy), axis=1))
                ws = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
                dq += _mm(dy / ys[:, None], w / ws, OP) * (ys[:, None] * ws)
            else:
                dq += _mm(dy, w, OP)
        m = (offs_t[:, None] < ntok) & (cr[None, :] < R)
        tl.store(DQ + rows * R + offs_t[:, None] * (H * R) + cr[None, :], dq, mask=m)
    else:
        pb = j - NTB
        dw = tl.zeros([BPB, BR], dtype=tl.float32)
        for t0 in range(0, CS, BT):
            offs_t = t0 + tl.arange(0, BT)
            dy = _tile(DY, rows * P + pb * BPB, offs_t, cp, ntok, P - pb * BPB, H * P)    # (BT, BPB)
            q = _tile(Q, rows * R, offs_t, cr, ntok, R, H * R)                             # (BT, BR)
            if OP == 2:  # columns of dY (they index dW's rows) into fp16's range
                ys = _pow2_scale(tl.max(tl.abs(dy), axis=0))
                dw += _mm(tl.trans(dy / ys[None, :]), q, OP) * ys[:, None]
            else:
                dw += _mm(tl.trans(dy), q, OP)
        offs_p = pb * BPB + cp
        m = (offs_p[:, None] < P) & (cr[None, :] < R)
        tl.store(DW + mat * P * R + offs_p[:, None] * R + cr[None, :], dw, mask=m)


def _tiles(chunk_size: int, R: int, P: int):
    """``(BT, BR, BPB)``: tokens, rank (padded) and value dims per program; every tile fits any GPU's
    registers (at most 64 x 64 fp32 operands and accumulators)."""
    return min(64, _pow2(chunk_size)), _pow2(R), min(64, _pow2(P))


def _warps(op: int, backward: bool = False) -> int:
    """fp32 products run on the CUDA cores, whose dot layouts need twice the registers of an mma's (64 x 64
    tiles at 4 warps spilled 744 bytes on sm_90), and the backward holds an accumulator next to its two
    operands (fp16, whose scaling adds temporaries, spilled 344 bytes at 4 warps): 8 warps for those."""
    return 8 if op == 0 or backward else 4


class _SKAApply(torch.autograd.Function):
    """``y_t = W_{t // chunk_size} q_t``: W (B, N, H, P, r) fp32, q (B, T, H, r) -> y (B, T, H, P) fp32."""

    @staticmethod
    def forward(ctx, W, q, chunk_size: int):
        B, T, H, R = q.shape
        N, P = W.shape[1], W.shape[-2]
        W, q = W.contiguous(), q.contiguous()
        op = _OPERAND.get(q.dtype, 0)
        y = torch.empty(B, T, H, P, device=q.device, dtype=torch.float32)
        BT, BR, BPB = _tiles(chunk_size, R, P)
        npb = triton.cdiv(P, BPB)
        launch(_ska_apply_kernel, (N, B * H, triton.cdiv(chunk_size, BT) * npb), q, W, y, T, H, N, chunk_size, R,
               P, npb, BT=BT, BR=BR, BPB=BPB, OP=op, num_warps=_warps(op))
        ctx.save_for_backward(W, q)
        ctx.chunk_size, ctx.op = chunk_size, op
        return y

    @staticmethod
    def backward(ctx, dy):
        W, q = ctx.saved_tensors
        B, T, H, R = q.shape
        N, P = W.shape[1], W.shape[-2]
        cs = ctx.chunk_size
        dy = dy.contiguous().float()
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        dW = torch.empty_like(W)
        BT, BR, BPB = _tiles(cs, R, P)
        ntb, npb = triton.cdiv(cs, BT), triton.cdiv(P, BPB)
        launch(_ska_apply_bwd_kernel, (N, B * H, ntb + npb), q, W, dy, dq, dW, T, H, N, cs, R, P, ntb, npb,
               BT=BT, BR=BR, BPB=BPB, OP=ctx.op, num_warps=_warps(ctx.op, backward=True))
        return dW, dq.to(q.dtype), None


def ska_chain_triton(Linv, A, C, q, power: int, chunk_size: int):
    """Triton version of :func:`kernels.ska.operator.ska_chain_torch` (same shapes).

    Linv, A (B, N, H, r, r); C (B, N, H, P, r); q (B, T, H, r), T <= N * chunk_size -> (B, T, H, P) in q's
    dtype. The factors are taken in fp32 (fp64 ones too); bf16/fp16 queries make the token products 16-bit.
    """
    B, T, H, R = q.shape
    N = Linv.shape[1]
    if T > N * chunk_size:
        raise ValueError(f"ska_chain: T={T} tokens need at least {-(-T // chunk_size)} chunks, got {N}")
    if power < 0:
        raise ValueError(f"ska_chain: power must be >= 0, got {power}")
    W = chain_operator(Linv.float(), A.float(), C.float(), int(power))
    qk = q if q.dtype in _OPERAND else q.float()
    return _SKAApply.apply(W, qk, int(chunk_size)).to(q.dtype)
