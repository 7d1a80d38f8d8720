"""Reference causal softmax attention: the explicit T x T formula, fp64-capable.

``o_t = sum_{i<=t} softmax_i(q_t . k_i * scale) v_i`` with layout ``(batch, time, heads, dim)``.
"""
from __future__ import annotations

import torch


def attention_reference(q, k, v, causal: bool = True, scale: float | None = None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        T, S = q.shape[1], k.shape[1]
        # queries are the last T positions of the S keys (decode with a cache has T < S)
        allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)
