"""The chunk scan ``S_c = a_c S_{c-1} + X_c`` as one Triton kernel forward and one backward (the GPU path).

Each program owns one block of ``BLOCK`` state elements of one lead index (a (batch, head) pair, say) and
walks the ``n`` chunks in order, keeping its block of the state in registers: it stores the state each
chunk starts from and, at the end, the final state. The backward walks the chunks in reverse with the
total gradient ``G_c = dL/dS_c`` in registers (``G_{n-1} = dfinal``, ``G_{c-1} = a_c G_c + dstarts_c``),
stores ``dX_c = G_c``, ``dinitial = a_0 G_0 + dstarts_0``, and per chunk its block's share of
``da_c = <G_c, S_{c-1}>``, summed over the blocks afterwards (one reduction).

So a layer's state pass is two launches whatever the number of chunks, where the Python loop of
:mod:`kernels.scan.loop` makes one per chunk. The arithmetic runs in the compute dtype (fp32 for
16-bit inputs, fp64 stays fp64); there is no product to put on tensor cores.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import cdiv, compute_dtype, pow2
from ..launch import launch


@triton.jit
def _scan_fwd(A, X, S0, STARTS, FIN, n, D, HAS_INIT: tl.constexpr, BLOCK: tl.constexpr):
    pid_d = tl.program_id(0)
    lead = tl.program_id(1).to(tl.int64)
    offs = pid_d * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    if HAS_INIT:
        s = tl.load(S0 + lead * D + offs, mask=mask, other=0.0)
    else:
        s = tl.zeros([BLOCK], dtype=FIN.dtype.element_ty)
    for c in range(n):
        row = (lead * n + c) * D
        tl.store(STARTS + row + offs, s, mask=mask)
        a = tl.load(A + lead * n + c)
        x = tl.load(X + row + offs, mask=mask, other=0.0)
        s = a * s + x
    tl.store(FIN + lead * D + offs, s, mask=mask)


@triton.jit
def _scan_bwd(A, STARTS, DSTARTS, DFIN, DX, DA, DS0, n, D, n_blocks,
              HAS_DSTARTS: tl.constexpr, HAS_DFIN: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK: tl.constexpr):
    pid_d = tl.program_id(0)
    lead = tl.program_id(1).to(tl.int64)
    offs = pid_d * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    if HAS_DFIN:
        g = tl.load(DFIN + lead * D + offs, mask=mask, other=0.0)
    else:
        g = tl.zeros([BLOCK], dtype=DX.dtype.element_ty)
    for i in range(n):
        c = n - 1 - i
        row = (lead * n + c) * D
        tl.store(DX + row + offs, g, mask=mask)
        s_prev = tl.load(STARTS + row + offs, mask=mask, other=0.0)
        tl.store(DA + (lead * n_blocks + pid_d) * n + c, tl.sum(g * s_prev, axis=0))
        a = tl.load(A + lead * n + c)
        g = a * g
        if HAS_DSTARTS:
            g += tl.load(DSTARTS + row + offs, mask=mask, other=0.0)
    if HAS_INIT:
        tl.store(DS0 + lead * D + offs, g, mask=mask)


def _block(D: int) -> int:
    return min(512, max(16, pow2(D)))


class _ChunkScanTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, X, initial):
        ctx.set_materialize_grads(False)                       # an unused output is no zero-filled gradient
        lead_shape, n = a.shape[:-1], a.shape[-1]
        state_shape = X.shape[a.ndim:]
        cd = compute_dtype(X.dtype)
        L, D = math.prod(lead_shape), math.prod(state_shape)
        a_f = a.to(cd).reshape(L, n).contiguous()
        X_f = X.to(cd).reshape(L, n, D).contiguous()
        s0 = None if initial is None else initial.to(cd).reshape(L, D).contiguous()
        starts = X_f.new_empty(L, n, D)
        fin = X_f.new_empty(L, D)
        BLOCK = _block(D)
        launch(_scan_fwd, (cdiv(D, BLOCK), L), a_f, X_f, fin if s0 is None else s0, starts, fin, n, D,
               HAS_INIT=s0 is not None, BLOCK=BLOCK)
        ctx.save_for_backward(a_f, starts)
        state_shape = X.shape[:a.ndim - 1] + X.shape[a.ndim:]
        ctx.shapes = (a.shape, X.shape, state_shape, a.dtype, X.dtype, None if initial is None else initial.dtype)
        return starts.view(X.shape).to(X.dtype), fin.view(state_shape)     # the final state in the compute dtype

    @staticmethod
    def backward(ctx, d_starts, d_final):
        a_f, starts = ctx.saved_tensors
        a_shape, X_shape, state_shape, a_dt, X_dt, init_dt = ctx.shapes
        if d_starts is None and d_final is None:
            return None, None, None
        L, n, D = starts.shape
        cd = starts.dtype
        BLOCK = _block(D)
        n_blocks = cdiv(D, BLOCK)
        dX = starts.new_empty(L, n, D)
        da = starts.new_empty(L, n_blocks, n)
        has_init = init_dt is not None
        ds0 = starts.new_empty(L, D) if has_init else da
        dst = None if d_starts is None else d_starts.to(cd).reshape(L, n, D).contiguous()
        dfin = None if d_final is None else d_final.to(cd).reshape(L, D).contiguous()
        launch(_scan_bwd, (n_blocks, L), a_f, starts, dst if dst is not None else starts,
               dfin if dfin is not None else dX, dX, da, ds0, n, D, n_blocks,
               HAS_DSTARTS=dst is not None, HAS_DFIN=dfin is not None, HAS_INIT=has_init, BLOCK=BLOCK)
        da = (da.sum(1) if n_blocks > 1 else da.view(L, n)).view(a_shape).to(a_dt)
        return da, dX.view(X_shape).to(X_dt), ds0.view(state_shape).to(init_dt) if has_init else None


def chunk_scan_triton(a: torch.Tensor, X: torch.Tensor, initial: torch.Tensor | None):
    """Same contract as :func:`kernels.scan.reference.chunk_scan_reference` (``initial`` None: zero), ``starts`` in
    ``X``'s dtype and ``final`` in the compute dtype (:func:`kernels.common.state_dtype` of ``X``)."""
    return _ChunkScanTriton.apply(a, X, initial)
