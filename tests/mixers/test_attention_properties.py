"""Attention: a head width RoPE cannot rotate (odd), or a model width the heads do not divide (without an explicit
``head_dim``), is refused when the layer is built, naming the numbers; the KV cache a prefill under autocast
returns is in the layer's dtype, as ``init_state`` lays it out and ``step`` extends it (decode runs with autocast
off: a 16-bit cache would be promoted mid-decode).

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864.
"""
from __future__ import annotations

import pytest
import torch

from mixers import build_mixer
from mixers.options import OptionError


@pytest.mark.parametrize("d_model, opts", [(32, {"n_heads": 4, "head_dim": 5}), (30, {"n_heads": 2}),
                                           (28, {"n_heads": 4, "n_kv_heads": 2})], ids=str)
def test_an_odd_head_width_is_refused_by_name(d_model, opts):
    with pytest.raises((ValueError, OptionError), match="head_dim=(5|15|7) must be even"):
        build_mixer("attention", d_model, opts)


def test_a_model_width_the_heads_do_not_divide_is_refused_without_a_head_dim():
    with pytest.raises((ValueError, OptionError), match="d_model=36 is not divisible by n_heads=8"):
        build_mixer("attention", 36, {"n_heads": 8})  # 36 // 8 = 4 would silently drop 4 features
    assert build_mixer("attention", 36, {"n_heads": 8, "head_dim": 4}).qkv.out_features == 3 * 8 * 4


def test_prefill_under_autocast_keeps_the_cache_in_the_layer_dtype():
    m = build_mixer("attention", 32, {"n_heads": 2, "n_kv_heads": 1}).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, state = m.prefill(x)
        fresh = m.init_state(2, dtype=torch.float32)
        assert state["k"].dtype == state["v"].dtype == fresh["k"].dtype == torch.float32
        assert state["k"].shape == state["v"].shape == (2, 7, 1, 16)
