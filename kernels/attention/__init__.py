"""Causal multi-head softmax attention, one function with several backends.

- ``reference``: the explicit T x T formula (:mod:`kernels.attention.reference`);
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` (the CPU default, and on CUDA without
  flash-attn: :data:`AUTO_ORDER_CUDA`);
- ``triton``: our flash-style kernel (online softmax, no T x T matrix), forward and backward;
- ``flash_attn``: the flash-attn package, when it imports on CUDA (an outside backend and oracle).

Layout ``(batch, time, heads, dim)``. With ``causal=True`` and fewer queries than keys, the queries
are aligned to the end of the keys (decode against a KV cache).

Grouped-query attention (GQA; Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models
from Multi-Head Checkpoints", arXiv 2305.13245): ``k`` and ``v`` may have ``Hkv`` heads, any divisor of the ``H``
heads of ``q`` (``Hkv = 1`` is multi-query attention). Query head ``h`` attends with key/value head
``h // (H / Hkv)`` on every backend: the reference repeats each key/value head ``H / Hkv`` times, SDPA takes them
natively (``enable_gqa``) where a fused kernel does and repeats them otherwise, the Triton kernel indexes the
shared head (no copy; its backward sums the gradients of the query heads that share it), flash-attn natively.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import package_importable, resolve_backend, triton_fp64_unsupported
from ..common import autocast_dtype, check_layout
from .reference import attention_reference

__all__ = ["BACKENDS", "attention", "attention_reference", "flash_attn_available"]

#: the backends this family implements (``auto`` picks among them); mixers offer these
BACKENDS = ("reference", "torch", "triton", "flash_attn")

#: ``auto`` on CUDA: PyTorch's scaled_dot_product_attention (a FlashAttention kernel inside PyTorch) before
#: our Triton kernel, which took 1.5x its forward+backward time on an H100 (bf16, head dim 128, T = 4K-64K;
#: BENCHMARKS.md, "GPU numbers")
AUTO_ORDER_CUDA = ("flash_attn", "torch", "triton", "reference")


def flash_attn_available() -> bool:
    """True when the flash-attn package imports and a CUDA device exists."""
    return package_importable("flash_attn") and torch.cuda.is_available()


#: why the flash kernels (flash-attn's and our Triton one) refuse a value head dim other than the query's
VALUE_DIM_REFUSAL = "needs v's head dim equal to q's and k's (use backend='torch' for another value head dim)"


def _unsupported(q, k, v) -> dict:
    """Backends ``auto`` passes over for these inputs, with why."""
    out = {}
    if not (q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype and q.shape[-1] <= 256):
        out["flash_attn"] = "needs fp16/bf16 inputs and head dim <= 256"
    if v.shape[-1] != q.shape[-1]:  # the flash kernels hold one head dim for q, k and v
        out["flash_attn"] = out["triton"] = VALUE_DIM_REFUSAL
    if q.dtype == torch.float32 and q.shape[-1] > 128:
        out["triton"] = "fp32 needs head dim <= 128"
    out.update(triton_fp64_unsupported(q))
    return out


#: ``F.scaled_dot_product_attention`` takes ``enable_gqa`` (PyTorch 2.5 and later)
SDPA_HAS_GQA = torch.__version__ >= (2, 5)


def _sdpa_native_gqa(q, masked: bool) -> bool:
    """Whether SDPA gets fewer key/value heads than query heads as they are (``enable_gqa=True``) rather than
    repeated: only where a fused kernel takes them, a CUDA FlashAttention kernel (fp16/bf16, head dim <= 256, no
    explicit mask). Elsewhere SDPA would fall back, silently, to its math kernel and its T x S matrix (the
    memory-efficient and cuDNN kernels refuse the broadcast), which costs more than repeating the heads."""
    return (SDPA_HAS_GQA and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and not masked)


def _sdpa(q, k, v, causal, scale):
    T, S = q.shape[1], k.shape[1]
    masked = causal and T != S
    group = q.shape[2] // max(k.shape[2], 1)
    gqa = {}
    if group > 1:  # grouped-query attention: query head h reads key/value head h // group
        if _sdpa_native_gqa(q, masked):
            gqa = {"enable_gqa": True}
        else:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if masked:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, **gqa)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal and T > 1, scale=scale, **gqa)
    return out.transpose(1, 2)


def attention(q, k, v, causal: bool = True, scale: float | None = None, backend: str = "auto"):
    """Softmax attention over ``q (B, T, H, D)``, ``k (B, S, Hkv, D)``, ``v (B, S, Hkv, E)`` with ``Hkv`` a divisor
    of ``H`` (grouped-query attention when smaller); see the module docstring for backends."""
    # one layout on every backend: the reference and SDPA broadcast a one-batch k / v (and SDPA took a v longer
    # than k) where the Triton kernel refused them; v's head dim may differ from q's and k's. k and v share one
    # head count, which divides q's (the only broadcast of heads: grouped-query attention)
    check_layout("attention", q=(q, "B T H D"), k=(k, "B S Hk D"), v=(v, "B S Hv E"))
    if not q.dtype == k.dtype == v.dtype and autocast_dtype(q.device.type) is None:
        # every backend refused it, the reference in a matmul's words (inside autocast, SDPA and the reference's
        # matmuls cast them to one dtype)
        raise ValueError(f"attention: q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; cast "
                         f"k and v to q's (k.to(q.dtype))")
    H, Hkv = q.shape[2], k.shape[2]
    if v.shape[2] != Hkv or Hkv > H or (H % Hkv if Hkv else H):
        raise ValueError(f"attention: k of shape {tuple(k.shape)} and v of shape {tuple(v.shape)} must have one number "
                         f"of heads Hkv that divides q's H = {H} (grouped-query attention: each key/value head serves "
                         f"H / Hkv query heads)")
    if k.shape[1] == 0 and q.shape[1] > 0:
        # no key to attend to: the explicit formula and SDPA gave zero rows, the Triton kernel refused
        raise ValueError(f"attention: every query needs at least one key, got {q.shape[1]} queries and no keys")
    if causal and q.shape[1] > k.shape[1]:
        # the first queries would precede every key: no backend has a value for them (the explicit formula gave
        # NaN rows, SDPA zero rows, the Triton kernel refused)
        raise ValueError(f"attention: causal attention needs at most as many queries as keys (queries are aligned "
                         f"to the end of the keys), got {q.shape[1]} queries and {k.shape[1]} keys")
    chosen = resolve_backend(backend, q, op="attention", available=BACKENDS, unsupported=_unsupported(q, k, v),
                             order=AUTO_ORDER_CUDA)
    if q.shape[1] == 0 and chosen != "reference":  # no query: SDPA's empty output (the kernels refuse it)
        chosen = "torch"
    if chosen == "flash_attn":
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
    if chosen == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale)
    if chosen == "triton":
        from .triton import attention_triton
        return attention_triton(q, k, v, causal=causal, scale=scale)
    return _sdpa(q, k, v, causal, scale)
