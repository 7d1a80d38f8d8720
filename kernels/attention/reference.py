"""Reference causal softmax attention: the explicit T x T formula, fp64-capable.

``o_t = sum_{i<=t} softmax_i(q_t . k_i * scale) v_i`` with layout ``(batch, time, heads, dim)``.

Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): ``k`` and ``v`` may have ``Hkv`` heads, a
divisor of the ``H`` heads of ``q``; query head ``h`` reads key/value head ``h // (H / Hkv)``, as if each key/value
head were repeated ``H / Hkv`` times in place (``repeat_interleave``, the convention of SDPA's ``enable_gqa`` and
of flash-attn).
"""
from __future__ import annotations

import torch


def attention_reference(q, k, v, causal: bool = True, scale: float | None = None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // max(k.shape[2], 1)
    if group > 1:  # grouped-query attention: each key/value head serves `group` consecutive query heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        T, S = q.shape[1], k.shape[1]
        # queries are the last T positions of the S keys (decode with a cache has T < S)
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)
