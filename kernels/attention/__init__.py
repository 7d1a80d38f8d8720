"""Causal multi-head softmax attention, one function with several backends.

- ``reference``: the explicit T x T formula (:mod:`kernels.attention.reference`);
- ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` (the CPU default, and on CUDA without
  flash-attn: :data:`AUTO_ORDER_CUDA`);
- ``triton``: our flash-style kernel (online softmax, no T x T matrix), forward and backward;
- ``flash_attn``: the flash-attn package, when it imports on CUDA (an outside backend and oracle).

Layout ``(batch, time, heads, dim)``. With ``causal=True`` and fewer queries than keys, the queries
are aligned to the end of the keys (decode against a KV cache).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import package_importable, resolve_backend
from ..common import check_layout
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


def _unsupported(q, k, v) -> dict:
    """Backends ``auto`` passes over for these inputs, with why."""
    out = {}
    if not (q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype and q.shape[-1] <= 256):
        out["flash_attn"] = "needs fp16/bf16 inputs and head dim <= 256"
    if q.dtype == torch.float32 and q.shape[-1] > 128:
        out["triton"] = "fp32 needs head dim <= 128"
    return out


def _sdpa(q, k, v, causal, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    T, S = q.shape[1], k.shape[1]
    if causal and T != S:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal and T > 1, scale=scale)
    return out.transpose(1, 2)


def attention(q, k, v, causal: bool = True, scale: float | None = None, backend: str = "auto"):
    """Softmax attention over ``(B, T, H, D)`` tensors; see the module docstring for backends."""
    # one layout on every backend: the reference and SDPA broadcast a one-head or one-batch k / v (and SDPA took
    # a v longer than k) where the Triton kernel refused them; v's head dim may differ from q's and k's
    check_layout("attention", q=(q, "B T H D"), k=(k, "B S H D"), v=(v, "B S H E"))
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
