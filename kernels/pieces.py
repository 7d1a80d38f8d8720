"""Tensor-core products of fp32 tiles as sums of 16-bit pieces (jitted helpers of the GLA and GKA kernels).

Tensor cores take 16-bit operands and accumulate in fp32. An operand that is an input of the kernel is exact
in its 16-bit dtype; an operand the kernel computed in fp32 (a state, a decay-weighted tile, an iterate) is
fed as ``P`` 16-bit pieces ``a ~= a_1 + a_2 + a_3`` (``a_1`` its rounding, ``a_2`` the rounding of the
remainder, ...), and the products of pieces whose orders sum below ``max(PA, PB)`` are accumulated (pieces of
order ``p`` carry ``u^p``, ``u`` = 2^-8 for bf16, 2^-11 for fp16):

- one piece: one product, operands rounded (relative error ``u``);
- two pieces: ``a_1 b_1 + a_2 b_1 + a_1 b_2`` (two products when ``b`` is exact), error ~``u^2``;
- three pieces hold all 24 bits of an fp32 significand: fp32's product up to the accumulation.

``OP`` is the operand dtype code: 0 fp32 (products stay exact fp32, ``input_precision="ieee"``, never tf32),
1 bf16, 2 fp16. fp16's range ends at 65504: :func:`mm_rows` and :func:`mm_tn` scale the rows or columns of
an operand by a power of two near their largest magnitude first (the scale factors out of the product
exactly); bf16 has fp32's range and skips the scaling.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["operand", "pieces", "mm", "mm_acc", "pow2_scale", "mm_rows", "mm_tn", "state_pieces", "OPERAND_CODES"]

#: constexpr codes of the product operand dtype, by torch dtype name
OPERAND_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


@triton.jit
def operand(a, OP: tl.constexpr):
    """``a`` as a product operand: fp32 (OP 0), bf16 (OP 1) or fp16 (OP 2)."""
    if OP == 1:
        out = a.to(tl.bfloat16)
    elif OP == 2:
        out = a.to(tl.float16)
    else:
        out = a.to(tl.float32)
    return out


@triton.jit
def pieces(b, OP: tl.constexpr, P: tl.constexpr):
    """``b ~= b1 + b2 + b3`` in the operand dtype (the first ``P`` pieces; unused ones repeat ``b1``)."""
    b1 = operand(b, OP)
    b2 = b1
    b3 = b1
    if OP != 0:
        if P > 1:
            r = b - b1.to(tl.float32)
            b2 = operand(r, OP)
            if P > 2:
                b3 = operand(r - b2.to(tl.float32), OP)
    return b1, b2, b3


@triton.jit
def _chain(out, a, b1, b2, b3, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """``out + a @ b`` with ``a`` split into ``PA`` pieces and ``b`` given as ``PB`` pieces (16-bit ``OP``)."""
    a1, a2, a3 = pieces(a, OP, PA)
    if PA > 2:
        out = tl.dot(a3, b1, out)
        if PB > 1:
            out = tl.dot(a2, b2, out)
    if PB > 2:
        out = tl.dot(a1, b3, out)
    if PA > 1:
        out = tl.dot(a2, b1, out)
    if PB > 1:
        out = tl.dot(a1, b2, out)
    return tl.dot(a1, b1, out)


@triton.jit
def mm(a, b1, b2, b3, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """``a @ b`` accumulated in fp32, ``b`` given as pieces ``(b1, b2, b3)`` (:func:`pieces`, ``PB`` of them).
    OP 0: exact fp32 products of ``a`` and ``b1``. 16-bit: ``a`` in ``PA`` pieces, the products of pieces
    ``a_i b_j`` with ``i + j < max(PA, PB)`` (orders from 0), the smallest first."""
    if OP == 0:
        out = tl.dot(a.to(tl.float32), b1, input_precision="ieee")
    else:
        out = _chain(tl.zeros([a.shape[0], b1.shape[1]], dtype=tl.float32), a, b1, b2, b3, OP, PA, PB)
    return out


@triton.jit
def mm_acc(acc, a, b1, b2, b3, s, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """``acc + s (a @ b)`` as :func:`mm`, accumulated into ``acc`` by the products themselves (no product-sized
    temporary) where ``s`` is 1: ``s`` is the power of two the pieces of ``b`` were divided by
    (:func:`state_pieces`), 1 unless fp16."""
    if OP == 0:
        out = tl.dot(a.to(tl.float32), b1, acc, input_precision="ieee")
    elif OP == 2:
        out = acc + mm(a, b1, b2, b3, OP, PA, PB) * s
    else:
        out = _chain(acc, a, b1, b2, b3, OP, PA, PB)
    return out


@triton.jit
def pow2_scale(m):
    """A power of two at or above ``m`` (1 where ``m`` is 0): dividing by it is exact."""
    return tl.where(m > 0, tl.exp2(tl.ceil(tl.log2(tl.where(m > 0, m, 1.0)))), 1.0)


@triton.jit
def mm_rows(a, b1, b2, b3, OP: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr):
    """:func:`mm` with the rows of ``a`` scaled into fp16's range first (they factor out of the product)."""
    if OP == 2:
        sa = pow2_scale(tl.max(tl.abs(a), axis=1))
        out = mm(a / sa[:, None], b1, b2, b3, OP, PA, PB) * sa[:, None]
    else:
        out = mm(a, b1, b2, b3, OP, PA, PB)
    return out


@triton.jit
def mm_tn(a, b, OP: tl.constexpr, P: tl.constexpr):
    """``a^T @ b`` (a sum over rows: tokens), both operands in ``P`` pieces; for fp16 the columns of ``a``
    and ``b`` are scaled into its range first (they index the result's rows and columns)."""
    if OP == 2:
        sa = pow2_scale(tl.max(tl.abs(a), axis=0))
        sb = pow2_scale(tl.max(tl.abs(b), axis=0))
        b1, b2, b3 = pieces(b / sb[None, :], OP, P)
        out = mm(tl.trans(a / sa[None, :]), b1, b2, b3, OP, P, P) * sa[:, None] * sb[None, :]
    else:
        b1, b2, b3 = pieces(b, OP, P)
        out = mm(tl.trans(a), b1, b2, b3, OP, P, P)
    return out


@triton.jit
def state_pieces(s, OP: tl.constexpr, P: tl.constexpr):
    """An fp32 state tile as ``P`` pieces for the right-hand side of a product, and the power of two ``ss``
    it was divided by (fp16: near its largest entry, so no piece overflows; else 1): ``s = ss (s1 + s2 + ..)``."""
    if OP == 2:
        ss = pow2_scale(tl.max(tl.max(tl.abs(s), axis=1), axis=0))
    else:
        ss = 1.0
    s1, s2, s3 = pieces(s / ss, OP, P)
    return s1, s2, s3, ss

