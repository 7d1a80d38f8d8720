"""BD-LRU's transition and input from its projections in one Triton kernel forward and one backward.

Per token and block ``k`` (Dubinin, Orvieto & Effenberger, "Improved State Mixing in Higher-order and Block
Diagonal Linear Recurrent Networks", arXiv:2602.12021), each row ``i`` of the block's ``m x (m+1)`` logits
``z`` (the projection's features in their natural order: block, row, column) is normalised by a softmax:

    p_ij = softmax_j(z_i)          A_ij = p_ij (j < m),       b_i = p_im v_i

``logits (B, T, N m (m+1))``, ``v (B, T, N m)``; returns ``A (B, T, N, m, m)`` and ``b (B, T, N, m)``,
contiguous, in fp32 (fp64 stays fp64): what :func:`kernels.blockscan.block_scan` takes. Backward, with
``dp_ij = dA_ij`` (j < m) and ``dp_im = db_i v_i``: ``dz_ij = p_ij (dp_ij - sum_l p_il dp_il)`` and
``dv_i = db_i p_im``; ``p`` is recomputed from the logits (nothing but the inputs is saved).

The PyTorch formula the mixer runs on a CPU (:meth:`mixers.bdlru.BDLRU.gates`) permutes the projection's
weight so that its softmax runs over an outer axis (a softmax over a trailing axis of ``m + 1`` entries is
slow on a CPU); on a GPU that costs a weight copy, a strided softmax each way, a copy of ``A`` into the
layout the scan reads, the product ``a0 v`` and the gradients' concatenation: about a third of the layer's
device time on an H200 at 16K tokens. Here a program holds ``BR`` rows of ``m + 1`` logits (padded to a power
of two); arithmetic in fp32 (fp64 stays fp64), no products for tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_rows, cdiv, compute_dtype, pow2
from ..grad_slots import empty_grad
from ..launch import launch

#: rows of logits per program (fewer for wide rows: at most 1024 entries of a tile, no register spills)
ROWS = 128


@triton.jit
def _rows(n_rows, NM, BR: tl.constexpr):
    """``(rows, token, within, live)`` of this program's ``BR`` rows of the ``(B T N m, m + 1)`` logits: row ``r`` is
    row ``within = r % (N m)`` of token ``r // (N m)``. One 64-bit division a program (its first row); the rows'
    own split is 32-bit (a vector of 64-bit divisions, emulated in software, had made the backward twice as
    slow on an H200 when its stores took the token strides)."""
    r0 = tl.program_id(0).to(tl.int64) * BR
    token0 = r0 // NM
    local = (r0 - token0 * NM).to(tl.int32) + tl.arange(0, BR)
    step = local // NM
    rows = r0 + tl.arange(0, BR)
    return rows, token0 + step, local - step * NM, rows < n_rows


@triton.jit
def _probs(Z, token, within, live, s_z, M: tl.constexpr, BJ: tl.constexpr, FP64: tl.constexpr):
    """``(p, j)``: the softmax of ``BR`` rows of ``m + 1`` logits, padded columns 0; a token's logits start at
    ``token * s_z`` (they may be a column block of a wider projection)."""
    CDT: tl.constexpr = tl.float64 if FP64 else tl.float32
    j = tl.arange(0, BJ)
    start = token * s_z + within * (M + 1)
    keep = live[:, None] & (j[None, :] <= M)
    z = tl.load(Z + start[:, None] + j[None, :], mask=keep, other=0.0).to(CDT)
    z = tl.where(keep, z, -float("inf"))
    e = tl.exp(z - tl.max(tl.where(live[:, None], z, 0.0), axis=1)[:, None])
    e = tl.where(keep, e, 0.0)
    return e / tl.where(live, tl.sum(e, axis=1), 1.0)[:, None], j


@triton.jit
def _gates_fwd(Z, V, A, Bout, n_rows, NM, s_z, s_v, M: tl.constexpr, BR: tl.constexpr, BJ: tl.constexpr,
               FP64: tl.constexpr):
    rows, token, within, live = _rows(n_rows, NM, BR)
    p, j = _probs(Z, token, within, live, s_z, M, BJ, FP64)
    CDT: tl.constexpr = tl.float64 if FP64 else tl.float32
    tl.store(A + rows[:, None] * M + j[None, :], p, mask=live[:, None] & (j[None, :] < M))
    v = tl.load(V + token * s_v + within, mask=live, other=0.0).to(CDT)
    a0 = tl.sum(tl.where(j[None, :] == M, p, 0.0), axis=1)
    tl.store(Bout + rows, a0 * v, mask=live)


@triton.jit
def _gates_bwd(Z, V, DA, DB, DZ, DV, n_rows, NM, s_z, s_v, s_dz, s_dv, M: tl.constexpr, BR: tl.constexpr,
               BJ: tl.constexpr, FP64: tl.constexpr):
    """``dz`` and ``dv`` are written at their token strides ``s_dz``, ``s_dv``, like the inputs they are the
    gradients of (in place in the gradient of the projection the inputs were cut from, where there is one)."""
    rows, token, within, live = _rows(n_rows, NM, BR)
    p, j = _probs(Z, token, within, live, s_z, M, BJ, FP64)
    CDT: tl.constexpr = tl.float64 if FP64 else tl.float32
    v = tl.load(V + token * s_v + within, mask=live, other=0.0).to(CDT)
    db = tl.load(DB + rows, mask=live, other=0.0).to(CDT)
    in_a = live[:, None] & (j[None, :] < M)
    dp = tl.load(DA + rows[:, None] * M + j[None, :], mask=in_a, other=0.0).to(CDT)
    last = j[None, :] == M
    dp = tl.where(last, (db * v)[:, None], dp)
    dz = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    tl.store(DZ + (token * s_dz + within * (M + 1))[:, None] + j[None, :], dz.to(DZ.dtype.element_ty),
             mask=live[:, None] & (j[None, :] <= M))
    a0 = tl.sum(tl.where(last, p, 0.0), axis=1)
    tl.store(DV + token * s_dv + within, (db * a0).to(DV.dtype.element_ty), mask=live)


def _launch_shape(m: int, n_rows: int):
    BJ = pow2(m + 1)
    BR = min(ROWS, max(16, 1024 // BJ))
    return (cdiv(n_rows, BR),), dict(M=m, BR=BR, BJ=BJ)


class _SoftmaxGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, v, m: int):
        lead, Nm = v.shape[:-1], v.shape[-1]
        z, vv = as_rows(logits), as_rows(v)
        cd = compute_dtype(logits.dtype, v.dtype)
        n_rows = z.shape[0] * Nm
        A = torch.empty(*lead, Nm // m, m, m, dtype=cd, device=v.device)
        b = torch.empty(*lead, Nm // m, m, dtype=cd, device=v.device)
        grid, meta = _launch_shape(m, n_rows)
        launch(_gates_fwd, grid, z, vv, A, b, n_rows, Nm, z.stride(0), vv.stride(0), FP64=cd == torch.float64, **meta)
        ctx.save_for_backward(z, vv)
        ctx.shapes = (logits.shape, v.shape, m, cd)
        return A, b

    @staticmethod
    def backward(ctx, dA, db):
        z, vv = ctx.saved_tensors
        z_shape, v_shape, m, cd = ctx.shapes
        n_rows = z.shape[0] * vv.shape[1]
        dA = torch.zeros((*v_shape[:-1], v_shape[-1] // m, m, m), dtype=cd, device=z.device) if dA is None \
            else dA.contiguous()
        db = torch.zeros(v_shape, dtype=cd, device=z.device) if db is None else db.contiguous()
        dz, dv = empty_grad(z), empty_grad(vv)
        grid, meta = _launch_shape(m, n_rows)
        launch(_gates_bwd, grid, z, vv, dA, db, dz, dv, n_rows, vv.shape[1], z.stride(0), vv.stride(0), dz.stride(0),
               dv.stride(0), FP64=cd == torch.float64, **meta)
        return dz.view(z_shape), dv.view(v_shape), None


def softmax_gates_triton(logits: torch.Tensor, v: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.blockscan.reference.softmax_gates_reference`."""
    return _SoftmaxGates.apply(logits, v, m)
