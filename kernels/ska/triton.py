"""Triton kernels of SKA's GPU path (the ``triton`` backend), forward and backward.

The whole op is three stages of two kernels each (forward, backward), plus a few PyTorch operations
for the key scale ``s`` (a max over time of the key norms, as the CPU path computes it; the norms' gradient is
added to ``dk`` by the statistics' backward kernel, which reads the keys anyway):

1. **Statistics** (``_ska_stats_kernel`` / ``_ska_stats_bwd_kernel``). One program per (batch, chunk, head)
   and tile of value dims forms the chunk's raw ``G = sum w_t k_t k_t^T``, ``M = sum w_t w_{t-1} k_t
   k_{t-1}^T`` (the lag-one pair of token ``t`` belongs to ``t``'s chunk, so the pair across a chunk
   boundary is the later chunk's) and ``C = sum w_t v_t k_t^T``; it writes them one chunk later, so that
   one ``cumsum`` over chunks gives every chunk the statistics of the chunks before it (``prefix``: of all
   chunks, a sum). They live in one flat buffer ``S (B, N, H, 2 r^2 + P r)`` (``G``, ``M``, ``C`` row-major
   one after the other). The backward reads the suffix sums of ``dS`` over chunks (one ``flip`` and one
   ``cumsum``) and gives each token ``dk_t = w_t (D_G + D_G^T) k_t + w_t D_C^T v_t`` plus the lag-one terms
   ``w_t (D_M w_{t-1} k_{t-1} + D_M'^T w_{t+1} k_{t+1})`` (``D_M'`` that of the chunk of ``t + 1``) and
   ``dv_t = w_t D_C k_t``.
2. **Operator** (``_ska_operator_kernel`` / ``_ska_operator_bwd_kernel``). One program per (batch, chunk,
   head) matrix, rank ``r <= 64`` padded to ``BR`` (identity on the padding) in registers: ``G = sym(G_raw)
   / s^2 + lambda I``, its Cholesky factor (right-looking, column by column; on a non-positive pivot it
   retries with the jitters ``1e-4 * 10^j``, j = 0..3, and then takes the square roots of the clamped
   diagonal, as :func:`kernels.ska.operator.cholesky_jitter` does, without leaving the kernel),
   ``L^{-1}`` by forward substitution, ``A_w = L^{-1} M L^{-T}``, ``power_iters`` steps of power iteration
   for ``sigma``, ``A = clamp(gamma, 1, gamma_max) A_w / max(sigma, 1)`` and the readout operator
   ``W = (C / s^2) L^{-T} A^p L^{-1}`` (the query's ``1 / s`` folded in), over tiles of value dims.
   Nothing is read back to the host: the jitter is chosen inside the program.
   The backward is written out, in the forward's order. With ``C' = C / s^2``, ``U_0 = C' L^{-T}``, ``U_{i+1} =
   U_i A`` (recomputed from ``U_0``) and ``W = U_p L^{-1}``, per tile of value rows: ``dA = sum_i U_i^T dU_{i+1}``,
   ``dL^{-1} = U_p^T dW + dU_0^T C'``, ``dC' = dU_0 L^{-1}``; then ``dA_w = alpha dA``, ``dM = L^{-T} dA_w
   L^{-1}``, ``dL^{-1} += dA_w L^{-1} M^T + dA_w^T L^{-1} M`` and,
   through the Cholesky factor and its inverse, ``dG = -sym(L^{-T} Phi(dL^{-1} L^{-T}) L^{-1})`` (``Phi``:
   the lower triangle with half the diagonal; only the clamped diagonal where every jitter failed),
   ``dgamma`` per matrix (summed over batch and chunks in PyTorch) and ``ds = -2 / s (<dG, G_raw / s^2> +
   <dM, M / s^2> + <dC', C'>)``. ``sigma`` is detached, as in every SKA path.
3. **Readout** (``_ska_apply_kernel`` / ``_ska_apply_bwd_kernel``): ``y_t = W_c q_t`` per chunk and tile of
   tokens x value dims; ``dQ = dY W`` and ``dW = dY^T Q`` summed over the chunk's tokens (one launch, whose
   programs own either a token tile or a tile of value dims, so every sum over tokens stays in one
   program, without atomics). :func:`ska_chain_triton` runs this stage alone on given factors (``W`` then
   formed by :func:`kernels.ska.operator.chain_operator` in PyTorch).

The keys, values and queries are read at their strides (column blocks of the layer's fused projection, in
place), ``y`` is written in the queries' 16-bit dtype, and ``dq``, ``dk``, ``dv`` go into the projection's
gradient where :mod:`kernels.grad_slots` has a slot for them.

Precision. fp32 inputs: every product in exact fp32 (``input_precision="ieee"``). bf16/fp16 inputs:

- statistics: the products ``w_t k_t k_t^T``, ``w_t v_t k_t^T`` of two 16-bit numbers are exact in fp32
  (``w`` a 0/1 mask), so the tensor cores take the inputs as they are and accumulate in fp32: the
  statistics are the fp32 sums of exact products. Their backward multiplies 16-bit inputs with the fp32
  suffix sums ``D``, fed as two 16-bit tiles (:mod:`kernels.split_dot`: ~16 bits of ``D`` in bf16).
- operator: fp32 throughout, on purpose (``FP32_DOT_KERNELS``). The normalised keys have norm <= 1, so ``G``'s
  condition number reaches ``(1 + tokens seen / lambda)`` (``4e6`` after 4096 tokens at ``lambda = 1e-3``), and
  ``L^{-1}`` carries it into ``A_w`` and ``W``: a 16-bit rounding of ``G`` (``2^-8`` in bf16) would move ``W``
  by O(1). These are ``r x r`` products
  once per chunk (~1/chunk_size of the per-token work).
- readout: ``W`` is rounded once to 16 bits for the tensor cores; the queries and ``dY`` are exact in 16
  bits. Measured against fp64 (chunk 64, r 32, P 64, ridge 1e-3 and 0.1, both normalisations): one
  rounding of ``W`` gives 1.6e-3 (bf16) / 2.1e-4 (fp16), the same as rounding ``y`` to the output dtype.
  For fp16 (max 65504) ``W`` is divided by a power of two near its largest magnitude and ``dY``'s rows
  (products over value dims) or columns (products over tokens) likewise.

Rank ``r <= 64`` (:data:`MAX_RANK`: an ``r x r`` tile per matrix in registers); a larger rank runs the
statistics and the operator in PyTorch (:func:`kernels.ska.chunked.ska_chunked`) with this readout. Rank and
value dim are padded to powers of two >= 16 (zero padding keeps the padded coordinates at zero).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..common import cdiv, pad_time, pow2, unit_last
from ..grad_slots import empty_grad
from ..launch import launch
from ..split_dot import dot_x_state
from .operator import JITTERS, SCALE_FLOOR, chain_operator

#: constexpr codes of the product operand dtype
_OPERAND = {torch.bfloat16: 1, torch.float16: 2}
#: the largest rank the statistics and operator kernels take (an r x r fp32 tile per matrix in registers)
MAX_RANK = 64
#: chunk length of the statistics kernels in ``prefix`` mode (the one operator is the sum over these chunks)
PREFIX_CHUNK = 64
#: kernels whose products stay fp32 for 16-bit inputs, and why (read by zoo.benchmark.compile_check)
FP32_DOT_KERNELS = {
    "_ska_operator_kernel": "the Cholesky factor, its inverse and A_w = L^-1 M L^-T of a Gram matrix whose condition "
                            "number reaches (tokens seen) / ridge: a 16-bit rounding would move W by O(1)",
    "_ska_operator_bwd_kernel": "the backward of the same factorisation (same conditioning as the forward)",
}


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
def _ska_apply_kernel(Q, W, Y, T, H, N, CS, R, P, NPB, sqb, sqt, sqh,
                      BT: tl.constexpr, BR: tl.constexpr, BPB: tl.constexpr, OP: tl.constexpr):
    """``Y[tokens, pdims] = Q[tokens] W_c[pdims]^T`` for one tile of a chunk's tokens and value dims (``Q`` at its
    strides, ``Y`` contiguous in its own dtype)."""
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
    q_at = b.to(tl.int64) * sqb + (n * CS).to(tl.int64) * sqt + h * sqh
    offs_p = pb * BPB + tl.arange(0, BPB)
    cr = tl.arange(0, BR)
    q = _tile(Q, q_at, offs_t, cr, ntok, R, sqt)            # (BT, BR)
    w = _tile(W, mat * P * R + pb * BPB * R, tl.arange(0, BPB), cr, P - pb * BPB, R, R)   # (BPB, BR)
    if OP == 2:
        ws = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
        w = w / ws
    else:
        ws = 1.0
    y = _mm(q, tl.trans(w), OP) * ws
    ymask = (offs_t[:, None] < ntok) & (offs_p[None, :] < P) & (tok[:, None] < T)
    tl.store(Y + rows * P + offs_t[:, None] * (H * P) + offs_p[None, :], y.to(Y.dtype.element_ty), mask=ymask)


@triton.jit
def _ska_apply_bwd_kernel(Q, W, DY, DQ, DW, T, H, N, CS, R, P, NTB, NPB, sqb, sqt, sqh, syb, syt, syh,
                          sdb, sdt, sdh, BT: tl.constexpr, BR: tl.constexpr, BPB: tl.constexpr, OP: tl.constexpr):
    """Program ``j < NTB``: ``dQ`` of token tile ``j`` (summed over value tiles). Program ``NTB + i``: ``dW`` of
    value tile ``i`` (summed over the chunk's token tiles). ``Q``, ``dY`` and ``dQ`` at their strides."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    j = tl.program_id(2)
    b = bh // H
    h = bh % H
    mat = ((b * N + n) * H + h).to(tl.int64)
    ntok = tl.minimum(CS, T - n * CS)
    first = (n * CS).to(tl.int64)
    q_at = b.to(tl.int64) * sqb + first * sqt + h * sqh
    dy_at = b.to(tl.int64) * syb + first * syt + h * syh
    cr = tl.arange(0, BR)
    cp = tl.arange(0, BPB)
    if j < NTB:
        offs_t = j * BT + tl.arange(0, BT)
        dq = tl.zeros([BT, BR], dtype=tl.float32)
        for pb in range(NPB):
            dy = _tile(DY, dy_at + pb * BPB, offs_t, cp, ntok, P - pb * BPB, syt)         # (BT, BPB)
            w = _tile(W, mat * P * R + pb * BPB * R, cp, cr, P - pb * BPB, R, R)       # (BPB, BR)
            if OP == 2:  # rows of dY and all of W into fp16's range (both factor out)
                ys = _pow2_scale(tl.max(tl.abs(dy), axis=1))
                ws = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
                dq += _mm(dy / ys[:, None], w / ws, OP) * (ys[:, None] * ws)
            else:
                dq += _mm(dy, w, OP)
        # each branch names its own mask: Triton 3.6 refuses a name bound to two shapes across the branches
        keep_q = (offs_t[:, None] < ntok) & (cr[None, :] < R)
        dq_at = b.to(tl.int64) * sdb + first * sdt + h * sdh
        tl.store(DQ + dq_at + offs_t[:, None] * sdt + cr[None, :], dq.to(DQ.dtype.element_ty), mask=keep_q)
    else:
        pb = j - NTB
        dw = tl.zeros([BPB, BR], dtype=tl.float32)
        for t0 in range(0, CS, BT):
            offs_t = t0 + tl.arange(0, BT)
            dy = _tile(DY, dy_at + pb * BPB, offs_t, cp, ntok, P - pb * BPB, syt)         # (BT, BPB)
            q = _tile(Q, q_at, offs_t, cr, ntok, R, sqt)                                  # (BT, BR)
            if OP == 2:  # columns of dY (they index dW's rows) into fp16's range
                col_scale = _pow2_scale(tl.max(tl.abs(dy), axis=0))
                dw += _mm(tl.trans(dy / col_scale[None, :]), q, OP) * col_scale[:, None]
            else:
                dw += _mm(tl.trans(dy), q, OP)
        offs_p = pb * BPB + cp
        keep_w = (offs_p[:, None] < P) & (cr[None, :] < R)
        tl.store(DW + mat * P * R + offs_p[:, None] * R + cr[None, :], dw, mask=keep_w)


def _tiles(chunk_size: int, R: int, P: int):
    """``(BT, BR, BPB)``: tokens, rank (padded) and value dims per program; every tile fits any GPU's
    registers (at most 64 x 64 fp32 operands and accumulators)."""
    return min(64, pow2(chunk_size, 16)), pow2(R, 16), min(64, pow2(P, 16))


def _warps(op: int, backward: bool = False) -> int:
    """fp32 products run on the CUDA cores, whose dot layouts need twice the registers of an mma's (64 x 64
    tiles at 4 warps spilled 744 bytes on sm_90), and the backward holds an accumulator next to its two
    operands (fp16, whose scaling adds temporaries, spilled 344 bytes at 4 warps): 8 warps for those."""
    return 8 if op == 0 or backward else 4


class _SKAApply(torch.autograd.Function):
    """``y_t = W_{t // chunk_size} q_t``: W (B, N, H, P, r) fp32, q (B, T, H, r) at any token and head strides ->
    y (B, T, H, P) in q's dtype (16-bit queries) or fp32. ``dq`` comes in q's dtype, written into the gradient
    buffer of the projection q was cut from where :mod:`kernels.grad_slots` has one."""

    @staticmethod
    def forward(ctx, W, q, chunk_size: int):
        B, T, H, R = q.shape
        N, P = W.shape[1], W.shape[-2]
        W, q = W.contiguous(), unit_last(q)
        op = _OPERAND.get(q.dtype, 0)
        y = torch.empty(B, T, H, P, device=q.device, dtype=q.dtype if op else torch.float32)
        BT, BR, BPB = _tiles(chunk_size, R, P)
        npb = cdiv(P, BPB)
        launch(_ska_apply_kernel, (N, B * H, cdiv(chunk_size, BT) * npb), q, W, y, T, H, N, chunk_size, R,
               P, npb, q.stride(0), q.stride(1), q.stride(2), BT=BT, BR=BR, BPB=BPB, OP=op, num_warps=_warps(op))
        ctx.save_for_backward(W, q)
        ctx.chunk_size, ctx.op = chunk_size, op
        return y

    @staticmethod
    def backward(ctx, dy):
        W, q = ctx.saved_tensors
        B, T, H, R = q.shape
        N, P = W.shape[1], W.shape[-2]
        cs = ctx.chunk_size
        dy = unit_last(dy)
        dq = empty_grad(q)
        dW = torch.empty_like(W)
        BT, BR, BPB = _tiles(cs, R, P)
        ntb, npb = cdiv(cs, BT), cdiv(P, BPB)
        launch(_ska_apply_bwd_kernel, (N, B * H, ntb + npb), q, W, dy, dq, dW, T, H, N, cs, R, P, ntb, npb,
               q.stride(0), q.stride(1), q.stride(2), dy.stride(0), dy.stride(1), dy.stride(2), dq.stride(0),
               dq.stride(1), dq.stride(2), BT=BT, BR=BR, BPB=BPB, OP=ctx.op, num_warps=_warps(ctx.op, backward=True))
        return dW, dq, None


# --------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------
@triton.jit
def _input(x):
    """A loaded input tile as a product operand: fp64 (the interpreter's oracle runs) goes to fp32."""
    if x.dtype == tl.float64:
        x = x.to(tl.float32)
    return x


@triton.jit
def _dot_exact(a, b):
    """``a @ b`` accumulated in fp32 with exact products: two 16-bit tiles of one type go to the tensor cores
    as they are (the product of two bf16 or two fp16 numbers is exact in fp32), anything else in fp32."""
    if (a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16) or (a.dtype == tl.float16 and b.dtype == tl.float16):
        out = tl.dot(a, b)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _rows(base, t, stride_t, cols, live, ncol):
    """Rows ``t`` (where ``live``) and columns ``cols < ncol`` of a (time, features) slice, in its own dtype."""
    m = live[:, None] & (cols[None, :] < ncol)
    return _input(tl.load(base + t[:, None].to(tl.int64) * stride_t + cols[None, :], mask=m, other=0.0))


@triton.jit
def _weights(wb, t, live, HAS_W: tl.constexpr, BT: tl.constexpr):
    """``w_t`` (0 where not ``live``), or ones without a mask."""
    if HAS_W:
        w = tl.load(wb + t, mask=live, other=0.0).to(tl.float32)
    else:
        w = tl.full([BT], 1.0, tl.float32)
    return w


@triton.jit
def _weighted(x, w, HAS_W: tl.constexpr):
    """``w_t x_t`` in ``x``'s dtype (exact for a 0/1 mask)."""
    if HAS_W:
        x = (x * w[:, None]).to(x.dtype)
    return x


@triton.jit
def _ska_stats_kernel(K, V, WT, S, T, H, N, CS, R, P, SHIFT, skb, skt, skh, svb, svt, svh, swb,
                      BT: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, HAS_W: tl.constexpr):
    """Program (m, j), m = (b, n, h): the raw statistics of chunk ``n - SHIFT`` (zero if negative) into slot
    ``m`` of ``S``: ``G`` and ``M`` (j = 0) or the value rows ``(j - 1) BP ...`` of ``C`` (j >= 1)."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    h = m % H
    n = (m // H) % N
    b = m // (H * N)
    c = n - SHIFT
    t0 = c * CS
    ntok = tl.where(c >= 0, tl.minimum(CS, T - t0), 0)
    out = S + m.to(tl.int64) * (2 * R * R + P * R)
    kb = K + b.to(tl.int64) * skb + h * skh
    wb = WT + b.to(tl.int64) * swb
    cr = tl.arange(0, BR)
    ct = tl.arange(0, BT)
    if j == 0:
        G = tl.zeros([BR, BR], dtype=tl.float32)
        M = tl.zeros([BR, BR], dtype=tl.float32)
        for i0 in range(0, CS, BT):
            live = i0 + ct < ntok
            t = t0 + i0 + ct
            k = _rows(kb, t, skt, cr, live, R)
            kp = _rows(kb, t - 1, skt, cr, live & (t >= 1), R)
            w = _weights(wb, t, live, HAS_W, BT)
            wp = _weights(wb, t - 1, live & (t >= 1), HAS_W, BT)
            wk = _weighted(k, w, HAS_W)
            G += _dot_exact(tl.trans(wk), k)
            M += _dot_exact(tl.trans(wk), _weighted(kp, wp, HAS_W))
        mm = (cr[:, None] < R) & (cr[None, :] < R)
        tl.store(out + cr[:, None] * R + cr[None, :], G, mask=mm)
        tl.store(out + R * R + cr[:, None] * R + cr[None, :], M, mask=mm)
    else:
        vb = V + b.to(tl.int64) * svb + h * svh
        cp = (j - 1) * BP + tl.arange(0, BP)
        C = tl.zeros([BP, BR], dtype=tl.float32)
        for i0 in range(0, CS, BT):
            live = i0 + ct < ntok
            t = t0 + i0 + ct
            k = _rows(kb, t, skt, cr, live, R)
            v = _rows(vb, t, svt, cp, live, P)
            C += _dot_exact(tl.trans(_weighted(v, _weights(wb, t, live, HAS_W, BT), HAS_W)), k)
        tl.store(out + 2 * R * R + cp[:, None] * R + cr[None, :], C, mask=(cp[:, None] < P) & (cr[None, :] < R))


@triton.jit
def _ska_stats_bwd_kernel(K, V, WT, D, DN, DK, DV, T, H, N, ND, CS, R, P, skb, skt, skh, svb, svt, svh, swb,
                          sdkb, sdkt, sdkh, sdvb, sdvt, sdvh, PREFIX: tl.constexpr, BT: tl.constexpr,
                          BR: tl.constexpr, BP: tl.constexpr, HAS_W: tl.constexpr, HAS_DN: tl.constexpr):
    """Program (m, i), m = (b, c, h): ``dk``, ``dv`` of the tokens ``i BT ...`` of chunk ``c``. ``D (B, ND, H, F)``
    holds the gradient reaching each chunk's own statistics: ``D[0]`` for every chunk (``PREFIX``: the one
    operator reads them all), else ``D[N - 2 - c]`` (suffix sums in reversed chunk order; none for the last
    chunk, which no chunk reads). ``HAS_DN``: ``DN (B, T, H)`` fp32 is the gradient of the key norms ``|k_t|``,
    which adds ``DN_t k_t / |k_t|`` (0 where ``k_t = 0``). ``dk``, ``dv`` are written at their strides."""
    m = tl.program_id(0)
    i = tl.program_id(1)
    h = m % H
    c = (m // H) % N
    b = m // (H * N)
    F = 2 * R * R + P * R
    if PREFIX:
        slot = c * 0
        slot_next = c * 0
    else:
        slot = N - 2 - c
        slot_next = N - 3 - c
    has = slot >= 0
    has_next = slot_next >= 0
    dd = D + ((b * ND + tl.maximum(slot, 0)) * H + h).to(tl.int64) * F
    dn = D + ((b * ND + tl.maximum(slot_next, 0)) * H + h).to(tl.int64) * F
    cr = tl.arange(0, BR)
    mm = (cr[:, None] < R) & (cr[None, :] < R) & has
    mat = cr[:, None] * R + cr[None, :]
    DG = tl.load(dd + mat, mask=mm, other=0.0)
    DM = tl.load(dd + R * R + mat, mask=mm, other=0.0)
    DMn = tl.load(dn + R * R + mat, mask=mm & has_next, other=0.0)
    ct = i * BT + tl.arange(0, BT)
    t = c * CS + ct
    live = (ct < CS) & (t < T)
    kb = K + b.to(tl.int64) * skb + h * skh
    wb = WT + b.to(tl.int64) * swb
    k = _rows(kb, t, skt, cr, live, R)
    w = _weights(wb, t, live, HAS_W, BT)
    wk = _weighted(k, w, HAS_W)
    prev = live & (t >= 1)
    wkp = _weighted(_rows(kb, t - 1, skt, cr, prev, R), _weights(wb, t - 1, prev, HAS_W, BT), HAS_W)
    nxt = live & (t + 1 < T)
    wkn = _weighted(_rows(kb, t + 1, skt, cr, nxt, R), _weights(wb, t + 1, nxt, HAS_W, BT), HAS_W)
    # d(w_t k_t) of the lag-one pairs (t, t-1) (chunk c's) and (t+1, t) (the next chunk's for the last token)
    last = t == (c + 1) * CS - 1
    dwk = dot_x_state(wkp, tl.trans(DM)) + tl.where(last[:, None], dot_x_state(wkn, DMn), dot_x_state(wkn, DM))
    if HAS_W:
        dwk = dwk * w[:, None]
    dk = dot_x_state(wk, DG + tl.trans(DG)) + dwk
    if HAS_DN:
        dn = tl.load(DN + (b.to(tl.int64) * T + t) * H + h, mask=live, other=0.0)
        norm = tl.sqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1))
        dk += tl.where(norm > 0, dn / tl.where(norm > 0, norm, 1.0), 0.0)[:, None] * k.to(tl.float32)
    vb = V + b.to(tl.int64) * svb + h * svh
    dvb = DV + b.to(tl.int64) * sdvb + h * sdvh
    for p0 in range(0, P, BP):
        cp = p0 + tl.arange(0, BP)
        DC = tl.load(dd + 2 * R * R + cp[:, None] * R + cr[None, :],
                     mask=(cp[:, None] < P) & (cr[None, :] < R) & has, other=0.0)
        v = _rows(vb, t, svt, cp, live, P)
        dk += dot_x_state(_weighted(v, w, HAS_W), DC)
        dv = dot_x_state(wk, tl.trans(DC))
        tl.store(dvb + t[:, None].to(tl.int64) * sdvt + cp[None, :], dv.to(DV.dtype.element_ty),
                 mask=live[:, None] & (cp[None, :] < P))
    dkb = DK + b.to(tl.int64) * sdkb + h * sdkh
    tl.store(dkb + t[:, None].to(tl.int64) * sdkt + cr[None, :], dk.to(DK.dtype.element_ty),
             mask=live[:, None] & (cr[None, :] < R))


# --------------------------------------------------------------------------------------------------
# the per-chunk operator
# --------------------------------------------------------------------------------------------------
@triton.jit
def _cholesky(G, R, rows, cols, BR: tl.constexpr):
    """``(L, bad)``: the lower Cholesky factor of the symmetric tile ``G`` (identity outside the leading
    ``R x R`` block) column by column, right-looking, and 1.0 if a pivot was not positive (else 0.0)."""
    A = G
    L = tl.where((rows[:, None] == cols[None, :]) & (rows[:, None] >= R), 1.0, 0.0)
    bad = tl.sum(tl.zeros([BR], dtype=tl.float32), axis=0)
    for j in range(R):
        col = tl.sum(tl.where(cols[None, :] == j, A, 0.0), axis=1)                 # A[:, j]
        piv = tl.sum(tl.where(rows == j, col, 0.0), axis=0)
        bad = tl.maximum(bad, tl.where(piv > 0, 0.0, 1.0))                          # NaN fails too
        lj = tl.where(rows >= j, col / tl.sqrt(tl.where(piv > 0, piv, 1.0)), 0.0)  # L[:, j]
        L = tl.where(cols[None, :] == j, lj[:, None], L)
        A = A - lj[:, None] * lj[None, :]
    return L, bad


@triton.jit
def _lower_inverse(L, R, rows, cols):
    """``L^{-1}`` of a lower-triangular tile (identity outside the leading ``R x R`` block), row by row:
    ``L^{-1}[j] = (e_j - sum_{k<j} L[j, k] L^{-1}[k]) / L[j, j]``."""
    Li = tl.where((rows[:, None] == cols[None, :]) & (rows[:, None] >= R), 1.0, 0.0)
    for j in range(R):
        lrow = tl.sum(tl.where(rows[:, None] == j, L, 0.0), axis=0)                 # L[j, :]
        ljj = tl.sum(tl.where(cols == j, lrow, 0.0), axis=0)
        acc = tl.sum(tl.where(cols < j, lrow, 0.0)[:, None] * Li, axis=0)          # sum_k L[j, k] L^{-1}[k, :]
        new = (tl.where(cols == j, 1.0, 0.0) - acc) / ljj
        Li = tl.where(rows[:, None] == j, new[None, :], Li)
    return Li


@triton.jit
def _mm32(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _chain(cq, Li, A, power):
    """``W = ((C' L^{-T}) A ... A) L^{-1}`` for a tile of rows of ``C'``, in the torch path's order: ``C' L^{-T}``
    (the whitened ``C``) stays moderate where ``L^{-T} A^p L^{-1}`` alone would reach ``1 / lambda`` and cancel."""
    U = _mm32(cq, tl.trans(Li))
    for _ in range(power):
        U = _mm32(U, A)
    return _mm32(U, Li)


@triton.jit
def _ska_operator_kernel(S, SC, GAM, W, LI, AW, SIG, BAD, H, NO, R, P, ssb, ssn, ssh, ridge, gamma_max,
                         power_iters, power, jitter_first, inv_sqrt_r, BR: tl.constexpr, BP: tl.constexpr):
    """Program m = (b, n, h): from the raw statistics ``S[m]`` and the key scale, ``W[m]`` (P x R) and what the
    backward reads (``L^{-1}``, ``A_w``, ``sigma``, whether the jitters all failed)."""
    m = tl.program_id(0)
    h = m % H
    n = (m // H) % NO
    b = m // (H * NO)
    base = S + m.to(tl.int64) * (2 * R * R + P * R)
    rows = tl.arange(0, BR)
    cols = tl.arange(0, BR)
    eye = rows[:, None] == cols[None, :]
    inside = (rows[:, None] < R) & (cols[None, :] < R)
    s = tl.load(SC + b * ssb + n * ssn + h * ssh)
    inv2 = 1.0 / (s * s)
    mat = rows[:, None] * R + cols[None, :]
    g = tl.load(base + mat, mask=inside, other=0.0)
    gt = tl.load(base + cols[None, :] * R + rows[:, None], mask=inside, other=0.0)
    G = 0.5 * (g + gt) * inv2 + tl.where(eye, tl.where(rows[:, None] < R, ridge, 1.0), 0.0)
    L, bad = _cholesky(G, R, rows, cols, BR)
    jitter = jitter_first
    for _ in range(4):                      # the jitters 1e-4 * 10^j, tried only after a failure
        if bad > 0:
            L, bad = _cholesky(G + tl.where(eye & inside, jitter, 0.0), R, rows, cols, BR)
        jitter = jitter * 10.0
    if bad > 0:                             # all failed: square roots of the diagonal clamped at the last jitter
        diag = tl.sum(tl.where(eye, G, 0.0), axis=1)
        L = tl.where(eye, tl.sqrt(tl.maximum(diag, jitter * 0.1))[:, None], 0.0)
    Li = _lower_inverse(L, R, rows, cols)
    mn = tl.load(base + R * R + mat, mask=inside, other=0.0) * inv2
    Aw = _mm32(_mm32(Li, mn), tl.trans(Li))                                         # L^{-1} M L^{-T}
    v = tl.where(cols < R, inv_sqrt_r, 0.0)                                         # power iteration on A_w^T A_w
    for _ in range(power_iters):
        u = tl.sum(Aw * v[None, :], axis=1)
        v = tl.sum(Aw * u[:, None], axis=0)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, axis=0)), 1e-30)
    u = tl.sum(Aw * v[None, :], axis=1)
    sigma = tl.sqrt(tl.sum(u * u, axis=0))
    gam = tl.minimum(tl.maximum(tl.load(GAM + h), 1.0), gamma_max)
    A = (gam / tl.maximum(sigma, 1.0)) * Aw
    for p0 in range(0, P, BP):
        cp = p0 + tl.arange(0, BP)
        pm = (cp[:, None] < P) & (cols[None, :] < R)
        cq = tl.load(base + 2 * R * R + cp[:, None] * R + cols[None, :], mask=pm, other=0.0) * inv2
        tl.store(W + m.to(tl.int64) * P * R + cp[:, None] * R + cols[None, :], _chain(cq, Li, A, power), mask=pm)
    out = m.to(tl.int64) * R * R + mat
    tl.store(LI + out, Li, mask=inside)
    tl.store(AW + out, Aw, mask=inside)
    tl.store(SIG + m, sigma)
    tl.store(BAD + m, bad)


@triton.jit
def _ska_operator_bwd_kernel(S, SC, GAM, DW, LI, AW, SIG, BAD, DS, DSC, DGAM, H, NO, R, P, ssb, ssn, ssh, ridge,
                             gamma_max, power, jitter_last, BR: tl.constexpr, BP: tl.constexpr):
    """Program m = (b, n, h): from ``dW[m]``, the gradients of the raw statistics ``dS[m]``, of the key scale
    and of ``gamma`` (this matrix's share)."""
    m = tl.program_id(0)
    h = m % H
    n = (m // H) % NO
    b = m // (H * NO)
    base = S + m.to(tl.int64) * (2 * R * R + P * R)
    dbase = DS + m.to(tl.int64) * (2 * R * R + P * R)
    rows = tl.arange(0, BR)
    cols = tl.arange(0, BR)
    eye = rows[:, None] == cols[None, :]
    inside = (rows[:, None] < R) & (cols[None, :] < R)
    s = tl.load(SC + b * ssb + n * ssn + h * ssh)
    inv2 = 1.0 / (s * s)
    mat = rows[:, None] * R + cols[None, :]
    saved = m.to(tl.int64) * R * R + mat
    Li = tl.load(LI + saved, mask=inside, other=0.0) + tl.where(eye & (rows[:, None] >= R), 1.0, 0.0)
    Aw = tl.load(AW + saved, mask=inside, other=0.0)
    sigma = tl.load(SIG + m)
    graw = tl.load(GAM + h)
    alpha = tl.minimum(tl.maximum(graw, 1.0), gamma_max) / tl.maximum(sigma, 1.0)
    A = alpha * Aw
    # U_0 = C' L^{-T}, U_{i+1} = U_i A, W = U_p L^{-1} (C' = C / s^2), per tile of value rows, in the torch path's
    # order (U_i recomputed from U_0): dL^{-1} = U_p^T dW + dU_0^T C', dA = sum_i U_i^T dU_{i+1}, dC' = dU_0 L^{-1}
    dLi = tl.zeros([BR, BR], dtype=tl.float32)
    dA = tl.zeros([BR, BR], dtype=tl.float32)
    dsum = tl.sum(tl.zeros([BR], dtype=tl.float32), axis=0)       # <dX, X> over the scaled statistics
    for p0 in range(0, P, BP):
        cp = p0 + tl.arange(0, BP)
        pm = (cp[:, None] < P) & (cols[None, :] < R)
        cq = tl.load(base + 2 * R * R + cp[:, None] * R + cols[None, :], mask=pm, other=0.0) * inv2
        dw = tl.load(DW + m.to(tl.int64) * P * R + cp[:, None] * R + cols[None, :], mask=pm, other=0.0)
        U0 = _mm32(cq, tl.trans(Li))
        U = U0
        for _ in range(power):
            U = _mm32(U, A)
        dLi += _mm32(tl.trans(U), dw)
        dU = _mm32(dw, tl.trans(Li))
        for i in range(power):
            Uj = U0
            for _ in range(power - 1 - i):
                Uj = _mm32(Uj, A)
            dA += _mm32(tl.trans(Uj), dU)
            dU = _mm32(dU, tl.trans(A))
        dLi += _mm32(tl.trans(dU), cq)
        dcq = _mm32(dU, Li)
        tl.store(dbase + 2 * R * R + cp[:, None] * R + cols[None, :], dcq * inv2, mask=pm)
        dsum += tl.sum(dcq * cq)
    # A = clamp(gamma) A_w / max(sigma, 1) (sigma detached); torch's clamp passes the gradient at the bounds
    dalpha = tl.sum(dA * Aw)
    keep = (graw >= 1.0) & (graw <= gamma_max)
    tl.store(DGAM + m, tl.where(keep, dalpha / tl.maximum(sigma, 1.0), 0.0))
    dAw = alpha * dA
    # A_w = L^{-1} M L^{-T}
    mn = tl.load(base + R * R + mat, mask=inside, other=0.0) * inv2
    dmn = _mm32(tl.trans(Li), _mm32(dAw, Li))
    dLi += _mm32(dAw, _mm32(Li, tl.trans(mn))) + _mm32(tl.trans(dAw), _mm32(Li, mn))
    dsum += tl.sum(dmn * mn)
    # L^{-1} of L = chol(G): dG = -L^{-T} Phi(dL^{-1} L^{-T}) L^{-1}, symmetrised
    X = _mm32(dLi, tl.trans(Li))
    phi = tl.where(rows[:, None] > cols[None, :], X, tl.where(eye, 0.5 * X, 0.0))
    dG = -_mm32(tl.trans(Li), _mm32(phi, Li))
    dG = 0.5 * (dG + tl.trans(dG))
    gn = 0.5 * (tl.load(base + mat, mask=inside, other=0.0) +
                tl.load(base + cols[None, :] * R + rows[:, None], mask=inside, other=0.0)) * inv2
    # every jitter failed: L came from the diagonal of G clamped at the last jitter
    diag = tl.sum(tl.where(eye, gn, 0.0), axis=1) + ridge
    fallback = tl.load(BAD + m) > 0
    dG = tl.where(fallback, tl.where(eye & (diag[:, None] >= jitter_last), dG, 0.0), dG)
    dsum += tl.sum(dG * gn)
    tl.store(dbase + mat, dG * inv2, mask=inside)
    tl.store(dbase + R * R + mat, dmn * inv2, mask=inside)
    tl.store(DSC + m, -2.0 * dsum / s)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def _stats_tiles(chunk_size: int, R: int, P: int):
    """``(BT, BR, BP, warps)``: tokens, rank and value dims per program of the statistics kernels. The
    backward holds three ``r x r`` gradient tiles next to five token tiles; with a 64-wide rank the token and
    value tiles shrink to 32 rows (fp32 spilled ~50 KB at 64 on sm_90, none at 32 with 8 warps)."""
    BR = pow2(R, 16)
    tile = 64 if BR <= 32 else 32
    return min(tile, pow2(chunk_size, 16)), BR, min(tile, pow2(P, 16)), 8


def _operator_tiles(R: int, P: int):
    """``(BR, BP, warps)``: the operator kernels hold several ``r x r`` fp32 tiles and multiply them on the
    CUDA cores, whose product layouts repeat each operand row and column across threads, so the warps grow
    with the rank (ptxas on sm_90, backward spills: rank 32 3.8 KB at 4 warps, 2 KB at 8; rank 64 47 KB at
    8, 7.4 KB at 16), and value tiles of 32 rows."""
    BR = pow2(R, 16)
    return BR, min(32, pow2(P, 16)), 4 if BR <= 16 else 8 if BR <= 32 else 16


def flat_statistics(G, M, C) -> torch.Tensor:
    """``G, M (..., r, r), C (..., P, r)`` -> the flat statistics ``(..., 2 r^2 + P r)`` the kernels read."""
    return torch.cat([G.flatten(-2), M.flatten(-2), C.flatten(-2)], dim=-1)


def split_statistics(S, r: int, P: int):
    """The inverse of :func:`flat_statistics`: views ``G, M (..., r, r), C (..., P, r)`` of ``S``."""
    G, M, C = S.split([r * r, r * r, P * r], dim=-1)
    return G.unflatten(-1, (r, r)), M.unflatten(-1, (r, r)), C.unflatten(-1, (P, r))


class _SKAStatistics(torch.autograd.Function):
    """k (B, T, H, r), v (B, T, H, P), w (B, T) fp32 or None -> S (B, N, H, 2 r^2 + P r) fp32: chunk n's
    statistics over the chunks before it (``prefix``: S (B, 1, H, .) over every token); and the key norms
    ``|k_t|`` (B, T, H) fp32, whose gradient the statistics' backward kernel adds to ``dk`` (the key scale is
    a max over them: the norms' own backward would be one more pass over ``k`` and a sum of two gradients)."""

    @staticmethod
    def forward(ctx, k, v, w, chunk_size: int, prefix: bool):
        ctx.set_materialize_grads(False)
        B, T, H, R = k.shape
        P = v.shape[-1]
        N = cdiv(T, chunk_size)
        own = torch.empty(B, N, H, 2 * R * R + P * R, device=k.device, dtype=torch.float32)
        BT, BR, BP, warps = _stats_tiles(chunk_size, R, P)
        wt = k if w is None else w
        launch(_ska_stats_kernel, (B * N * H, 1 + cdiv(P, BP)), k, v, wt, own, T, H, N, chunk_size, R, P,
               0 if prefix else 1, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
               wt.stride(0), BT=BT, BR=BR, BP=BP, HAS_W=w is not None, num_warps=warps)
        ctx.save_for_backward(k, v, w)
        ctx.meta = (chunk_size, prefix)
        S = own.sum(dim=1, keepdim=True) if prefix else own.cumsum(dim=1)
        return S, torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)

    @staticmethod
    def backward(ctx, dS, dknorm):
        k, v, w = ctx.saved_tensors
        chunk_size, prefix = ctx.meta
        B, T, H, R = k.shape
        P = v.shape[-1]
        N = cdiv(T, chunk_size)
        if dS is None:
            dS = torch.zeros(B, 1 if prefix else N, H, 2 * R * R + P * R, device=k.device, dtype=torch.float32)
        # chunk c's own statistics reach every later slot: D[N - 2 - c] = sum_{n > c} dS[n] (reversed suffix sums)
        D = dS.contiguous() if prefix else dS.flip(1).cumsum(dim=1)
        dn = D if dknorm is None else dknorm.contiguous()
        dk, dv = empty_grad(k), empty_grad(v)
        BT, BR, BP, warps = _stats_tiles(chunk_size, R, P)
        wt = k if w is None else w
        launch(_ska_stats_bwd_kernel, (B * N * H, cdiv(chunk_size, BT)), k, v, wt, D, dn, dk, dv, T, H, N,
               D.shape[1], chunk_size, R, P, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
               v.stride(2), wt.stride(0), dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1),
               dv.stride(2), PREFIX=prefix, BT=BT, BR=BR, BP=BP, HAS_W=w is not None, HAS_DN=dknorm is not None,
               num_warps=warps)
        return dk, dv, None, None, None


class _SKAOperator(torch.autograd.Function):
    """S (B, N, H, 2 r^2 + P r) raw statistics, s (B, N, H) key scale (any strides), gamma (H,) fp32 ->
    W (B, N, H, P, r) fp32, the readout operator ``(C / s^2) L^{-T} A^p L^{-1}`` of every matrix."""

    @staticmethod
    def forward(ctx, S, s, gamma, R: int, P: int, ridge: float, gamma_max: float, power: int, power_iters: int):
        B, NO, H = S.shape[:3]
        dev = S.device
        S = S.contiguous()
        W = torch.empty(B, NO, H, P, R, device=dev, dtype=torch.float32)
        Li, Aw = (torch.empty(B, NO, H, R, R, device=dev, dtype=torch.float32) for _ in range(2))
        sig, bad = (torch.empty(B, NO, H, device=dev, dtype=torch.float32) for _ in range(2))
        BR, BP, warps = _operator_tiles(R, P)
        launch(_ska_operator_kernel, (B * NO * H,), S, s, gamma, W, Li, Aw, sig, bad, H, NO, R, P, s.stride(0),
               s.stride(1), s.stride(2), float(ridge), float(gamma_max), int(power_iters), int(power), JITTERS[0],
               1.0 / math.sqrt(R), BR=BR, BP=BP, num_warps=warps)
        ctx.save_for_backward(S, s, gamma, Li, Aw, sig, bad)
        ctx.meta = (R, P, ridge, gamma_max, power)
        return W

    @staticmethod
    def backward(ctx, dW):
        S, s, gamma, Li, Aw, sig, bad = ctx.saved_tensors
        R, P, ridge, gamma_max, power = ctx.meta
        B, NO, H = S.shape[:3]
        dS = torch.empty_like(S)
        ds, dg = (torch.empty(B, NO, H, device=S.device, dtype=torch.float32) for _ in range(2))
        BR, BP, warps = _operator_tiles(R, P)
        launch(_ska_operator_bwd_kernel, (B * NO * H,), S, s, gamma, dW.contiguous(), Li, Aw, sig, bad, dS, ds, dg,
               H, NO, R, P, s.stride(0), s.stride(1), s.stride(2), float(ridge), float(gamma_max), int(power),
               JITTERS[-1], BR=BR, BP=BP, num_warps=warps)
        # power 0 reads no A: gamma then gets no gradient at all, as on the torch path
        dgamma = dg.sum(dim=(0, 1)) if ctx.needs_input_grad[2] and power > 0 else None
        return dS, ds, dgamma, None, None, None, None, None, None


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
    return _apply(W, q, chunk_size)


def _apply(W, q, chunk_size: int):
    """``y_t = W_{t // chunk_size} q_t`` in q's dtype (16-bit queries: 16-bit products)."""
    qk = q if q.dtype in _OPERAND else q.float()     # (an fp32 q is itself)
    y = _SKAApply.apply(W, qk, int(chunk_size))
    return y if y.dtype == q.dtype else y.to(q.dtype)


def key_scale(knorm, w, *, prefix: bool, chunk_size: int, normalisation: str) -> torch.Tensor:
    """The key scale of every operator, (B, N, H) (``prefix``: (B, 1, H)), from the key norms ``knorm`` (B, T, H)
    fp32, as the CPU path computes it: the largest weighted-in key norm over the whole sequence (``seq_max``) or
    over the chunks before (``running_max``), at least ``SCALE_FLOOR``. A view with stride 0 over chunks for
    ``seq_max``."""
    B, T, H = knorm.shape
    if w is not None:
        knorm = knorm * (w > 0)[:, :, None]
    if prefix or normalisation == "seq_max":
        s = knorm.amax(dim=1, keepdim=True).clamp_min(SCALE_FLOOR)
        return s if prefix else s.expand(B, cdiv(T, chunk_size), H)
    N = cdiv(T, chunk_size)
    cmax = pad_time(knorm, chunk_size).reshape(B, N, chunk_size, H).amax(dim=2)
    return torch.cummax(F.pad(cmax, (0, 0, 1, 0))[:, :-1], dim=1).values.clamp_min(SCALE_FLOOR)


def _statistics(k, v, w, chunk_size: int, prefix: bool):
    """``(S, |k_t|)`` of :class:`_SKAStatistics` (``k``, ``v`` with unit-stride features)."""
    k, v = unit_last(k), unit_last(v)
    if w is not None:
        w = w.detach().to(device=k.device, dtype=torch.float32).contiguous()
    return _SKAStatistics.apply(k, v, w, int(chunk_size), prefix)


def ska_statistics_triton(k, v, w=None, *, chunk_size: int, mode: str = "chunk_causal") -> torch.Tensor:
    """The raw statistics every operator reads, differentiable in ``k`` and ``v``: k (B, T, H, r), v (B, T, H, P),
    w (B, T) fp32 0/1 or None -> S (B, N, H, 2 r^2 + P r) fp32 (:func:`split_statistics` gives ``G, M, C``).
    ``chunk_causal``: chunk n's statistics over the chunks before it (N = ceil(T / chunk_size)); ``prefix``:
    over every token (N = 1; ``chunk_size`` is then the kernels' unit of time)."""
    return _statistics(k, v, w, chunk_size, mode == "prefix")[0]


def ska_operator_triton(S, s, gamma, *, rank: int, value_dim: int, ridge: float, gamma_max: float, power: int,
                        power_iters: int) -> torch.Tensor:
    """The readout operator of every matrix, differentiable in ``S``, ``s`` and ``gamma``: S (B, N, H, 2 r^2 + P r)
    raw statistics, s (B, N, H) key scale (clamped; any strides), gamma (H,) -> W (B, N, H, P, r) fp32,
    ``W = (C / s^2) L^{-T} A^p L^{-1}`` (:func:`kernels.ska.operator.solve_operator` and
    :func:`kernels.ska.operator.chain_operator`, with the query's ``1 / s``)."""
    if rank > MAX_RANK:
        raise ValueError(f"ska_operator_triton: rank {rank} is above {MAX_RANK} (an r x r tile per program); "
                         f"use kernels.ska.operator.solve_operator")
    H = S.shape[2]
    g = gamma.to(device=S.device, dtype=torch.float32) if torch.is_tensor(gamma) else \
        torch.full((H,), float(gamma), device=S.device, dtype=torch.float32)
    return _SKAOperator.apply(S, s, g.expand(H).contiguous(), int(rank), int(value_dim), float(ridge),
                              float(gamma_max), int(power), int(power_iters))


def ska_triton(q, k, v, w=None, *, ridge: float = 1e-3, power: int = 2, gamma=1.0, gamma_max: float = 1.5,
               mode: str = "chunk_causal", chunk_size: int = 64, normalisation: str = "seq_max",
               power_iters: int = 6) -> torch.Tensor:
    """SKA with the Triton kernels (see the module docstring): q, k (B, T, H, r), v (B, T, H, P), w (B, T) 0/1
    or None -> y (B, T, H, P) in q's dtype. Same function as :func:`kernels.ska.chunked.ska_chunked` (modes
    ``prefix`` and ``chunk_causal``), computed in fp32 (fp64 inputs too); ``w`` gets no gradient."""
    if normalisation not in ("seq_max", "running_max"):
        raise ValueError(f"ska: unknown normalisation {normalisation!r}; choose seq_max or running_max")
    if mode not in ("prefix", "chunk_causal"):
        raise ValueError(f"ska_triton: mode must be prefix or chunk_causal, got {mode!r} "
                         f"(recurrent = ska_recurrent, or chunk_causal with chunk_size=1)")
    if chunk_size < 1:
        raise ValueError(f"ska: chunk_size must be >= 1, got {chunk_size}")
    if power < 0:
        raise ValueError(f"ska: power must be >= 0, got {power}")
    T, R, P = q.shape[1], q.shape[-1], v.shape[-1]
    if R > MAX_RANK:
        from .chunked import ska_chunked
        return ska_chunked(q, k, v, w, ridge=ridge, power=power, gamma=gamma, gamma_max=gamma_max, mode=mode,
                           chunk_size=chunk_size, normalisation=normalisation, power_iters=power_iters,
                           chain=ska_chain_triton)
    prefix = mode == "prefix"
    cs = PREFIX_CHUNK if prefix else chunk_size
    wf = None if w is None else w.detach().to(device=k.device, dtype=torch.float32).contiguous()
    S, knorm = _statistics(k, v, wf, cs, prefix)
    s = key_scale(knorm, wf, prefix=prefix, chunk_size=cs, normalisation=normalisation)
    W = ska_operator_triton(S, s, gamma, rank=R, value_dim=P, ridge=ridge, gamma_max=gamma_max, power=power,
                            power_iters=power_iters)
    return _apply(W, q, T if prefix else chunk_size)
