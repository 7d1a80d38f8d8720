"""The beta gate of the GLA and GKA layers, ``(k beta, v beta)`` with ``beta = sigmoid(raw)`` per head, in one
Triton kernel each way for both tensors (the GPU path), where the formula launches three forward (the sigmoid
and two products) and about eight backward.

A program takes ``BR`` rows and walks the heads ``NH`` at a time, a ``(BR, NH, d)`` tile of ``k`` and one of
``v`` per step; the backward forms ``dk = dk' beta``, ``dv = dv' beta`` and ``draw = beta (1 - beta) (sum dk'
k + sum dv' v)`` per row and head (both sums complete within the step). ``k``, ``v`` and ``raw`` may be column
blocks of wider tensors (any row stride; heads ``d`` apart), as the layers' projections and normalised keys
are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import as_rows, cdiv, compute_dtype, pow2
from ..grad_slots import empty_grad
from ..launch import launch


@triton.jit
def _head_tile(rows, heads, D, BD: tl.constexpr, s_row, row_ok, head_ok):
    """Offsets and mask of a ``(rows, heads, BD)`` tile of a ``(n_rows, H, D)`` tensor with row stride ``s_row``
    (heads ``D`` apart, unit stride within a head)."""
    i = tl.arange(0, BD)
    off = rows[:, None, None] * s_row + heads[None, :, None] * D + i[None, None, :]
    return off, row_ok[:, None, None] & head_ok[None, :, None] & (i < D)[None, None, :]


@triton.jit
def _beta_rows(RAW, pid, n_rows, H, h0, s_raw, BR: tl.constexpr, NH: tl.constexpr, FP64: tl.constexpr):
    """``(rows, heads, row mask, head mask, beta (BR, NH))`` of program ``pid``'s rows at heads ``h0..``, beta in
    the compute dtype (fp32; fp64 for fp64 inputs)."""
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)
    heads = h0 + tl.arange(0, NH)
    row_ok, head_ok = rows < n_rows, heads < H
    raw = tl.load(RAW + rows[:, None] * s_raw + heads[None, :], mask=row_ok[:, None] & head_ok[None, :], other=0.0)
    return rows, heads, row_ok, head_ok, tl.sigmoid(raw.to(tl.float64 if FP64 else tl.float32))


@triton.jit
def _scale_heads(X, XO, rows, heads, row_ok, head_ok, D, BD: tl.constexpr, s_x, H, beta):
    """One ``(rows, heads, BD)`` tile of ``x`` (row stride ``s_x``) times ``beta`` into the contiguous ``XO``."""
    off, m = _head_tile(rows, heads, D, BD, s_x, row_ok, head_ok)
    out, _ = _head_tile(rows, heads, D, BD, H * D, row_ok, head_ok)
    x = tl.load(X + off, mask=m, other=0.0).to(beta.dtype)
    tl.store(XO + out, (x * beta[:, :, None]).to(XO.dtype.element_ty), mask=m)


@triton.jit
def _scale_heads_bwd(X, DXO, DX, rows, heads, row_ok, head_ok, D, BD: tl.constexpr, s_x, s_dxo, s_dx, beta):
    """``dx = dx' beta`` of one tile into ``DX`` (row stride ``s_dx``); returns ``sum dx' x`` per row and head."""
    off, m = _head_tile(rows, heads, D, BD, s_x, row_ok, head_ok)
    g_off, _ = _head_tile(rows, heads, D, BD, s_dxo, row_ok, head_ok)
    out, _ = _head_tile(rows, heads, D, BD, s_dx, row_ok, head_ok)
    x = tl.load(X + off, mask=m, other=0.0).to(beta.dtype)
    dxo = tl.load(DXO + g_off, mask=m, other=0.0).to(beta.dtype)
    tl.store(DX + out, (dxo * beta[:, :, None]).to(DX.dtype.element_ty), mask=m)
    return tl.sum(dxo * x, axis=2)


@triton.jit
def _beta_fwd(K, V, RAW, KO, VO, n_rows, H, DK, DV, s_k, s_v, s_raw,
              BR: tl.constexpr, NH: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, FP64: tl.constexpr):
    pid = tl.program_id(0)
    for h0 in range(0, H, NH):
        rows, heads, row_ok, head_ok, beta = _beta_rows(RAW, pid, n_rows, H, h0, s_raw, BR, NH, FP64)
        _scale_heads(K, KO, rows, heads, row_ok, head_ok, DK, BDK, s_k, H, beta)
        _scale_heads(V, VO, rows, heads, row_ok, head_ok, DV, BDV, s_v, H, beta)


@triton.jit
def _beta_bwd(K, V, RAW, DKO, DVO, DK, DVV, DRAW, n_rows, H, DK_DIM, DV_DIM, s_k, s_v, s_raw, s_dko, s_dvo,
              s_dk, s_dv, BR: tl.constexpr, NH: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, FP64: tl.constexpr):
    pid = tl.program_id(0)
    for h0 in range(0, H, NH):
        rows, heads, row_ok, head_ok, beta = _beta_rows(RAW, pid, n_rows, H, h0, s_raw, BR, NH, FP64)
        dot = _scale_heads_bwd(K, DKO, DK, rows, heads, row_ok, head_ok, DK_DIM, BDK, s_k, s_dko, s_dk, beta)
        dot += _scale_heads_bwd(V, DVO, DVV, rows, heads, row_ok, head_ok, DV_DIM, BDV, s_v, s_dvo, s_dv, beta)
        tl.store(DRAW + rows[:, None] * H + heads[None, :], (beta * (1.0 - beta) * dot).to(DRAW.dtype.element_ty),
                 mask=row_ok[:, None] & head_ok[None, :])


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x (..., H, d)`` as ``(rows, H d)``: a view where its heads are ``d`` apart with unit stride inside (a
    column block of a wider tensor qualifies), else a copy."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return as_rows(x.flatten(-2))


def _beta_blocks(H: int, dk: int, dv: int, n_rows: int) -> tuple[int, int, int, int]:
    """``(BR, NH, BDK, BDV)``: about 2048 entries per ``(BR, NH, d)`` tile (the backward holds four of them)."""
    BDK, BDV = pow2(dk), pow2(dv)
    NH = max(1, min(pow2(H), 256 // max(BDK, BDV)))
    return max(1, min(64, 2048 // (NH * max(BDK, BDV)), pow2(n_rows))), NH, BDK, BDV


class _BetaScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, raw):
        dk, dv, H = k.shape[-1], v.shape[-1], raw.shape[-1]
        kr, vr, rr = _head_rows(k), _head_rows(v), as_rows(raw)
        n_rows = rr.shape[0]
        ko, vo = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype,
                                                                                   device=v.device)
        BR, NH, BDK, BDV = _beta_blocks(H, dk, dv, n_rows)
        launch(_beta_fwd, (cdiv(n_rows, BR),), kr, vr, rr, ko, vo, n_rows, H, dk, dv, kr.stride(0),
               vr.stride(0), rr.stride(0), BR=BR, NH=NH, BDK=BDK, BDV=BDV, FP64=compute_dtype(k, v, raw) == torch.float64)
        ctx.save_for_backward(kr, vr, rr)
        ctx.meta = (k.shape, v.shape, raw.shape, raw.dtype)
        return ko, vo

    @staticmethod
    def backward(ctx, dko, dvo):
        kr, vr, rr = ctx.saved_tensors
        k_shape, v_shape, raw_shape, raw_dtype = ctx.meta
        dk_dim, dv_dim, H = k_shape[-1], v_shape[-1], raw_shape[-1]
        n_rows = rr.shape[0]
        dko = torch.zeros(k_shape, dtype=kr.dtype, device=kr.device) if dko is None else dko
        dvo = torch.zeros(v_shape, dtype=vr.dtype, device=vr.device) if dvo is None else dvo
        gk, gv = _head_rows(dko), _head_rows(dvo)
        dk, dv = empty_grad(kr), empty_grad(vr)     # rows in place where k, v were cut from a tensor
        draw = torch.empty(raw_shape, dtype=raw_dtype, device=rr.device)
        BR, NH, BDK, BDV = _beta_blocks(H, dk_dim, dv_dim, n_rows)
        launch(_beta_bwd, (cdiv(n_rows, BR),), kr, vr, rr, gk, gv, dk, dv, draw, n_rows, H, dk_dim, dv_dim,
               kr.stride(0), vr.stride(0), rr.stride(0), gk.stride(0), gv.stride(0), dk.stride(0), dv.stride(0),
               BR=BR, NH=NH, BDK=BDK, BDV=BDV, FP64=compute_dtype(kr, vr, rr) == torch.float64)
        return dk.view(k_shape), dv.view(v_shape), draw


def beta_scale_triton(k: torch.Tensor, v: torch.Tensor, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.gate.reference.beta_scale_reference` in one launch each way (computed in fp32, fp64 where an
    input is fp64; each output rounded once to its input's dtype)."""
    return _BetaScale.apply(k, v, raw)
