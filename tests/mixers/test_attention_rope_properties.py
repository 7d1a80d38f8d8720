"""Attention rotates its queries and keys with the RoPE base the options name: the layer, its prefill and its
token-by-token decode equal the fp64 reference layer written from the weights at that base.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.
"""
from __future__ import annotations

import pytest
import torch

from mixers import build_mixer

from .test_attention_gqa import reference_layer

D, HEAD_DIM = 32, 8


@pytest.mark.parametrize("rope_base", [10.0, 500.0, 1e6])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2)])
def test_layer_and_decode_use_the_rope_base(rope_base, n_heads, n_kv_heads):
    m = build_mixer("attention", D, {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": HEAD_DIM,
                                     "rope_base": rope_base}).double().eval()
    x = torch.randn(2, 13, D, dtype=torch.float64)
    with torch.no_grad():
        want = reference_layer(x, m.qkv.weight, m.out.weight, n_heads, n_kv_heads, HEAD_DIM, rope_base)
        decoded, _ = m.forward_recurrent(x)
        torch.testing.assert_close(m(x), want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(m.prefill(x)[0], want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(decoded, want, rtol=1e-9, atol=1e-9)

