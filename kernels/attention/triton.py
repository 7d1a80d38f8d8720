"""Flash-style causal softmax attention in Triton: forward and backward, no T x T matrix in memory.

Forward (one program per block of queries and per (batch, head)): stream over key blocks keeping the
running row maximum ``m``, the running normaliser ``l`` and the unnormalised output ``acc`` (online
softmax, Milakov & Gimelshein 2018; Dao et al. 2022). Scores are kept in base 2
(``s = q.k * scale * log2(e)``, ``exp2``) and the log-sum-exp ``lse = m + log2(l)`` of every query
row is saved for the backward.

Backward (Dao 2023, FlashAttention-2 split): a preprocess kernel computes
``delta_i = rowsum(dO_i * O_i)``; one kernel per key block accumulates ``dK`` and ``dV`` over the
query blocks that can see it, recomputing ``P = exp2(s - lse)``; one kernel per query block
accumulates ``dQ``. With ``dP = dO V^T`` and ``dS = P * (dP - delta)``:
``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``. Every program owns its output rows,
so there are no atomics. Statistics and accumulators are fp32 for fp32/fp16/bf16 inputs.

Grouped-query attention (GQA; Ainslie et al. 2023, arXiv 2305.13245): ``k`` and ``v`` may have ``Hkv``
heads, a divisor of the ``H`` query heads, with ``G = H / Hkv`` query heads per key/value head. The forward
and the ``dQ`` kernel read key/value head ``h // G`` for query head ``h`` (no repeated copy of K and V); the
``dK dV`` kernel runs one program per block of keys and per (batch, key/value head) and loops over the ``G``
query heads of its group, so the gradient of a shared head is the sum over the query heads that read it,
accumulated in fp32 by the program that owns those rows (still no atomics). ``G = 1`` is the plain kernel.

Layout ``(batch, time, heads, dim)``. ``causal=True`` with fewer queries than keys aligns the queries
to the end of the keys (decode against a KV cache); more queries than keys is rejected.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend import triton_interpreting
from ..common import cdiv, pow2
from ..launch import launch

__all__ = ["attention_triton"]

LOG2E = 1.4426950408889634

#: fp32 inputs use exact fp32 products (input_precision="ieee"); above this head dim every tile config spills
#: tens of KB of registers per thread (python -m zoo.benchmark.compile_check), so the launcher refuses them
FP32_MAX_HEAD_DIM = 128

# The interpreter runs each program serially on the CPU; small blocks keep the tests fast.
_INTERP_BLOCK = 16


def _configs(kind: str, block_d: int, elem_bytes: int):
    """Autotune configs (BLOCK_M, BLOCK_N, warps, stages) of kernel ``kind`` ("fwd" or a backward kernel).

    Tiles shrink as the head dim and element size grow, so that every config fits the shared memory
    of an sm_80 block (163 KB) and the fp32 accumulators stay in registers; ``python -m
    zoo.benchmark.compile_check`` compiles each of them.
    """
    if block_d <= 64:
        table = ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 128, 8, 2))
    elif block_d == 128:
        table = ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)) if elem_bytes == 2 else \
            ((64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 1))
    elif elem_bytes == 2:
        table = ((64, 32, 4, 2), (64, 64, 8, 1), (32, 32, 4, 2))
    else:
        table = ((32, 32, 4, 1), (64, 32, 8, 1), (32, 16, 4, 2))
    if kind != "fwd" and block_d >= 128:  # the backward holds two or three (tile x head dim) fp32 accumulators
        table = tuple((bm, bn, w, s) for bm, bn, w, s in table if bm * bn <= 64 * 32 or elem_bytes == 2)
        table = table or ((32, 32, 4, 1),)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in table]


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sob, sot, soh, sod,
    H, GROUP, TQ, TK, D, qk_scale,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP  # the key/value head this query head reads (GQA; GROUP = 1 without)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < TQ
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = TK - TQ  # query i sees keys j <= i + shift
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M + shift, TK)
    else:
        hi = TK
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < TK
        kt = tl.load(k_base + cols[None, :] * skt + offs_d[:, None] * skd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + shift)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :] * svd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod,
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * TQ + offs_m, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_delta(
    O, DO, DELTA,
    sob, sot, soh, sod, sdb, sdt, sdh, sdd,
    H, TQ, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    msk = (offs_m[:, None] < TQ) & (offs_d[None, :] < D)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod, mask=msk, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd, mask=msk, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * TQ + offs_m, delta, mask=offs_m < TQ)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    s_dkb, s_dkt, s_dkh, s_dkd, s_dvb, s_dvt, s_dvh, s_dvd,
    H, GROUP, TQ, TK, D, qk_scale, scale,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per block of keys and per (batch, key/value head): dV = sum_i P^T dO, dK = scale * sum_i dS^T Q,
    # the sums over the queries of every query head that reads this key/value head (GROUP of them under GQA)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = H // GROUP
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < TK
    d_ok = offs_d < D
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    shift = TK - TQ
    if CAUSAL:
        # queries i with i + shift >= start_n can see this block
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for g in range(0, GROUP):
        h = hk * GROUP + g  # a query head of this key/value head's group
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        stat_base = (b * H + h) * TQ  # LSE and DELTA are (B, H, TQ)
        for start_m in range(lo, TQ, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < TQ
            qt = tl.load(q_base + rows[None, :] * sqt + offs_d[:, None] * sqd,
                         mask=row_ok[None, :] & d_ok[:, None], other=0.0)  # (D, M)
            do = tl.load(do_base + rows[:, None] * sdt + offs_d[None, :] * sdd,
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (M, D)
            lse = tl.load(LSE + stat_base + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + stat_base + rows, mask=row_ok, other=0.0)
            st = tl.dot(k, qt, input_precision=PREC) * qk_scale  # (N, M): scores transposed
            ok = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[:, None] <= rows[None, :] + shift)
            pt = tl.where(ok, tl.exp2(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)  # (N, M)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PREC)
    dk = dk * scale
    tl.store(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dkt + offs_d[None, :] * s_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvt + offs_d[None, :] * s_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    s_dqb, s_dqt, s_dqh, s_dqd,
    H, GROUP, TQ, TK, D, qk_scale, scale,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per block of queries: dQ = scale * sum_j dS K
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP  # the key/value head this query head reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < TQ
    d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :] * sdd, mask=q_mask, other=0.0)
    stat_base = pid_bh.to(tl.int64) * TQ
    lse = tl.load(LSE + stat_base + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat_base + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = TK - TQ
    if CAUSAL:
        hi = tl.minimum((pid_m + 1) * BLOCK_M + shift, TK)
    else:
        hi = TK
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < TK
        kt = tl.load(k_base + cols[None, :] * skt + offs_d[:, None] * skd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # (D, N)
        vt = tl.load(v_base + cols[None, :] * svt + offs_d[:, None] * svd,
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # (D, N)
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale
        ok = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + shift)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC)
    dq = dq * scale
    tl.store(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqt + offs_d[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_mask)


_kernels: dict[tuple, object] = {}


def _kernel(name, block_d, dtype):
    """The jitted kernel, autotuned over :func:`_configs` on CUDA (one fixed config when interpreting)."""
    interp = triton_interpreting()
    key = (name, interp) if interp else (name, block_d, dtype.itemsize)
    if key not in _kernels:
        fn = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}[name]
        if not interp:
            fn = triton.autotune(configs=_configs(name, block_d, dtype.itemsize),
                                 key=["TQ", "TK", "D", "CAUSAL", "PREC"])(fn)
        _kernels[key] = fn
    return _kernels[key]


def _block_kwargs():
    return {"BLOCK_M": _INTERP_BLOCK, "BLOCK_N": _INTERP_BLOCK} if triton_interpreting() else {}


def _launch(name, grid_len_name, batch, args, kwargs):
    kern = _kernel(name, kwargs["BLOCK_D"], args[0].dtype)
    extra = _block_kwargs()

    def grid(meta):
        # programs over query blocks run per query head, over key blocks per key/value head (GQA)
        block, heads = (meta["BLOCK_M"], kwargs["H"]) if grid_len_name == "TQ" else \
            (meta["BLOCK_N"], kwargs["H"] // kwargs["GROUP"])
        return (cdiv(kwargs[grid_len_name], block), heads * batch)

    launch(kern, grid, *args, **kwargs, **extra)


def _group(H, k) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    return H // k.shape[2] if k.shape[2] else 1


def _precision(dtype):
    # fp32 inputs: exact fp32 products (no TF32) so the kernel matches SDPA to ~1e-6
    return "ieee" if dtype == torch.float32 else "tf32"


class _AttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        Bsz, TQ, H, D = q.shape
        TK = k.shape[1]
        o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(Bsz, H, TQ, device=q.device, dtype=torch.float32)
        BLOCK_D = max(16, pow2(D))
        _launch("fwd", "TQ", Bsz,
                (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride()),
                dict(H=H, GROUP=_group(H, k), TQ=TQ, TK=TK, D=D, qk_scale=scale * LOG2E, CAUSAL=causal,
                     PREC=_precision(q.dtype), BLOCK_D=BLOCK_D))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale = ctx.causal, ctx.scale
        Bsz, TQ, H, D = q.shape
        TK = k.shape[1]
        BLOCK_D = max(16, pow2(D))
        do = do.to(q.dtype)
        delta = torch.empty_like(lse)
        bm = 64 if not triton_interpreting() else _INTERP_BLOCK
        launch(_attn_bwd_delta, (cdiv(TQ, bm), Bsz * H),
            o, do, delta, *o.stride(), *do.stride(), H, TQ, D, BLOCK_M=bm, BLOCK_D=BLOCK_D)
        # gradients are dense (B, T, H, D), (B, S, Hkv, D) even when q, k, v are strided views (e.g. of a fused qkv);
        # dK and dV are written once per element, by the program that summed over the query heads of the group
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        common = dict(H=H, GROUP=_group(H, k), TQ=TQ, TK=TK, D=D, qk_scale=scale * LOG2E, scale=scale, CAUSAL=causal,
                      PREC=_precision(q.dtype), BLOCK_D=BLOCK_D)
        strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
        _launch("dkdv", "TK", Bsz, (q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), *dv.stride()), common)
        _launch("dq", "TQ", Bsz, (q, k, v, do, lse, delta, dq, *strides, *dq.stride()), common)
        return dq, dk, dv, None, None


def attention_triton(q, k, v, causal: bool = True, scale: float | None = None):
    """Softmax attention over ``q (B, T, H, D)``, ``k, v (B, S, Hkv, D)`` with the Triton flash kernels; ``Hkv``
    divides ``H`` (grouped-query attention when smaller: query head ``h`` reads key/value head ``h // (H / Hkv)``).

    ``causal=True`` with ``T_q < T_k`` aligns the queries to the last ``T_q`` keys; ``T_q > T_k`` is
    rejected. Inputs fp32, fp16 or bf16 (all three the same dtype); output in that dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention_triton: q, k, v must be (batch, time, heads, dim)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"attention_triton: q, k, v must share one dtype among fp32/fp16/bf16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    Bsz, TQ, H, D = q.shape
    if k.shape[3] == D and v.shape[3] != D:
        raise ValueError(f"attention_triton: v's head dim {v.shape[3]} differs from q's and k's {D}: the kernel holds one "
                         f"head dim for all three; use backend='torch' (or 'reference') for another value head dim")
    if k.shape != v.shape or k.shape[0] != Bsz or k.shape[3] != D or k.shape[2] > H or (H % k.shape[2] if k.shape[2] else H):
        raise ValueError(f"attention_triton: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not match (same batch and head dim; k and v the same shape, with a number of heads "
                         f"that divides q's: grouped-query attention)")
    if causal and TQ > k.shape[1]:
        raise ValueError(f"attention_triton: causal attention needs T_q <= T_k (queries are aligned to the end "
                         f"of the keys), got T_q={TQ}, T_k={k.shape[1]}")
    if D > 256:
        raise ValueError(f"attention_triton: head dim {D} > 256 is not supported; use backend='torch'")
    if D > FP32_MAX_HEAD_DIM and q.dtype == torch.float32:
        raise ValueError(f"attention_triton: fp32 inputs need head dim <= {FP32_MAX_HEAD_DIM}, got {D} (exact fp32 "
                         f"products at that width spill registers); use bf16/fp16 inputs or backend='torch'")
    scale = D ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"attention_triton: scale must be finite, got {scale}")
    if TQ == 0 or k.shape[1] == 0:
        raise ValueError("attention_triton: empty sequence")
    return _AttentionTriton.apply(q, k, v, causal, scale)
