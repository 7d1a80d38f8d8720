"""The ``torch`` backend of the chunk scan (the CPU path): one in-place op per chunk in a Python loop.

The loop runs without autograd (in-place writes into preallocated outputs) and the backward is the same
loop reversed, so the cost is linear in the number of chunks: indexing one chunk of a tensor that autograd
tracks would instead allocate a full-size gradient per chunk (quadratic in T). On a CPU each op is a
cache-friendly pass over one chunk's state; on a GPU each would be one kernel launch, which is why the GPU
path is the single kernel of :mod:`kernels.scan.triton`.
"""
from __future__ import annotations

import torch


class ChunkScanLoop(torch.autograd.Function):
    """``S_c = a_c S_{c-1} + X_c`` over chunks; returns the chunk-start states and the final state."""

    @staticmethod
    def forward(ctx, a, X, initial):
        n = a.shape[-1]
        extra = X.ndim - a.ndim                                 # state dims after the chunk axis
        a_n = a.movedim(-1, 0).reshape(n, *a.shape[:-1], *([1] * extra))
        X_n = X.movedim(a.ndim - 1, 0)
        # one op per chunk, written in place: S_c = X_c + a_c S_{c-1} lands in starts[c + 1]
        starts = X_n.new_empty((n + 1, *X_n.shape[1:]))
        starts[0] = initial
        for c in range(n):
            torch.addcmul(X_n[c], a_n[c], starts[c], out=starts[c + 1])
        ctx.save_for_backward(a_n, starts)
        ctx.chunk_dim, ctx.extra = a.ndim - 1, extra
        return starts[:n].movedim(0, a.ndim - 1), starts[n].clone()

    @staticmethod
    def backward(ctx, d_starts, d_final):
        a_n, starts = ctx.saved_tensors
        n = a_n.shape[0]
        dim = ctx.chunk_dim
        d_starts = None if d_starts is None else d_starts.movedim(dim, 0)
        # dX[c] = dLoss/dS_c = d_final (c = n - 1) or a_{c+1} dX[c+1] + d_starts[c+1]; one op per chunk
        dX = torch.empty_like(starts[1:])
        if n == 0:
            g = torch.zeros_like(starts[0]) if d_final is None else d_final
            da = a_n.new_zeros(starts.shape[:starts.ndim - ctx.extra][1:] + (0,)) if ctx.needs_input_grad[0] else None
            return da, dX.movedim(0, dim), g
        if d_final is None:
            dX[n - 1] = 0
        else:
            dX[n - 1] = d_final
        for c in range(n - 1, 0, -1):
            if d_starts is None:
                torch.mul(dX[c], a_n[c], out=dX[c - 1])
            else:
                torch.addcmul(d_starts[c], a_n[c], dX[c], out=dX[c - 1])
        g = dX[0] * a_n[0]
        if d_starts is not None:
            g += d_starts[0]
        da = None
        if ctx.needs_input_grad[0]:
            state_dims = tuple(range(starts.ndim - ctx.extra, starts.ndim))
            da = (dX * starts[:n]).sum(state_dims).movedim(0, -1)
        return da, dX.movedim(0, dim), g
