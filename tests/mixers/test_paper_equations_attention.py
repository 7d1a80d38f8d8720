"""Attention against Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv:2104.09864, and
Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
arXiv:2305.13245, written here in fp64 from the layer's weights: the projection read as ``H d`` query, ``Hkv d`` key
and ``Hkv d`` value features; each query and key row at position ``p`` rotated pair by pair with explicit 2 x 2
rotations in the rotate-half pairing (coordinates ``i`` and ``i + d/2`` turned by ``p base^(-2i/d)``, base 10000 by
default); scores scaled by ``1/sqrt(d_head)`` (not ``1/sqrt(d_model / H)``: some cases set ``head_dim``); query head
``h`` reading key/value head ``h // (H / Hkv)`` (so key/value head ``j`` serves query heads ``j g .. j g + g - 1``);
the causal mask. The same output through SDPA on explicitly repeated key/value heads, prefill-then-decode against the
whole-sequence reference (rotations at offset positions), and RoFormer's relative-position property of the rotation.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer
from mixers.attention import Attention

F64 = torch.float64


def rotate(x, positions, base):
    """``x (B, T, H, d)`` with the pair ``(x_i, x_{i + d/2})`` at position ``p`` turned by ``p base^(-2i/d)``."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        theta = positions.to(F64) * base ** (-2.0 * i / d)
        c, s = theta.cos()[None, :, None], theta.sin()[None, :, None]
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i], out[..., i + d // 2] = c * a - s * b, s * a + c * b
    return out


def paper_qkv(m, x):
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    qkv = x @ m.qkv.weight.T
    q, k, v = qkv.split([H * d, Hkv * d, Hkv * d], dim=-1)
    pos = torch.arange(x.shape[1])
    base = m.options.rope_base
    return rotate(q.unflatten(-1, (H, d)), pos, base), rotate(k.unflatten(-1, (Hkv, d)), pos, base), \
        v.unflatten(-1, (Hkv, d))


def paper_layer(m, x):
    """Head by head: query head ``h`` against key/value head ``h // (H / Hkv)``, causal softmax, then ``W_out``."""
    q, k, v = paper_qkv(m, x)
    H, Hkv, d = m.n_heads, m.n_kv_heads, m.head_dim
    T = x.shape[1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h in range(H):
        j = h // (H // Hkv)
        scores = q[:, :, h] @ k[:, :, j].transpose(1, 2) / math.sqrt(d)
        heads.append(torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v[:, :, j])
    return torch.stack(heads, 2).flatten(2) @ m.out.weight.T


def sdpa_layer(m, x):
    """SDPA on key/value heads repeated so that head ``j`` fills query slots ``j g .. j g + g - 1``."""
    q, k, v = paper_qkv(m, x)
    g = m.n_heads // m.n_kv_heads
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=1 / math.sqrt(m.head_dim))
    return o.transpose(1, 2).flatten(2) @ m.out.weight.T


# (d_model, n_heads, n_kv_heads, head_dim, rope_base): head_dim unset, larger and smaller than d_model / n_heads
CASES = [(16, 4, None, None, 10000.0), (16, 4, 2, None, 10000.0), (12, 4, 1, 6, 10000.0), (8, 6, 3, 4, 300.0),
         (8, 2, 2, 10, 10000.0)]


def _layer(d_model, n_heads, n_kv_heads, head_dim, rope_base, backend):
    opts = {"n_heads": n_heads, "head_dim": head_dim, "rope_base": rope_base, "backend": backend}
    if n_kv_heads is not None:
        opts["n_kv_heads"] = n_kv_heads
    return build_mixer("attention", d_model, opts).to(F64).eval()


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("d_model, n_heads, n_kv_heads, head_dim, rope_base", CASES)
def test_layer_equals_rotated_scaled_grouped_causal_softmax(backend, d_model, n_heads, n_kv_heads, head_dim, rope_base):
    m = _layer(d_model, n_heads, n_kv_heads, head_dim, rope_base, backend)
    x = 2 * torch.randn(2, int(torch.randint(4, 12, ())), d_model, dtype=F64)   # positions past 2 pi / theta_1
    with torch.no_grad():
        want = paper_layer(m, x)
        torch.testing.assert_close(sdpa_layer(m, x), want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(m(x), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d_model, n_heads, n_kv_heads, head_dim, rope_base", CASES[1:4])
def test_prefill_then_decode_equals_the_whole_sequence(d_model, n_heads, n_kv_heads, head_dim, rope_base):
    """The decode step rotates its query and key at the cache length: positions ``T0, T0 + 1, ..``."""
    m = _layer(d_model, n_heads, n_kv_heads, head_dim, rope_base, "torch")
    T = int(torch.randint(6, 12, ()))
    T0 = int(torch.randint(1, T - 1, ()))
    x = torch.randn(2, T, d_model, dtype=F64)
    with torch.no_grad():
        want = paper_layer(m, x)
        y0, state = m.prefill(x[:, :T0])
        ys = [y0]
        for t in range(T0, T):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), want, rtol=1e-10, atol=1e-10)


def test_rotation_starts_at_position_zero_and_scores_depend_on_the_offset_only():
    """RoFormer: ``<R_m q, R_n k> = <q, R_{n-m} k>``, on the layer's own rotated queries and keys; the layer's output
    cannot see a shift of every position, the rotated keys themselves can."""
    m = _layer(8, 1, None, 8, 10000.0, "torch")
    x = torch.randn(1, 9, 8, dtype=F64)
    with torch.no_grad():
        q, k, _ = m._qkv(x, 0)
        q0, k0, _ = m._qkv(x, 7)                      # the same rows at positions 7 .. 15
        _, kr, _ = paper_qkv(m, x)
    scores = torch.einsum("bthd,bshd->ts", q, k)
    torch.testing.assert_close(torch.einsum("bthd,bshd->ts", q0, k0), scores, rtol=1e-10, atol=1e-10)
    assert torch.allclose(k, kr, rtol=1e-12, atol=1e-12)


def test_defaults():
    o = Attention.Options()
    assert o.rope_base == 10000.0 and o.n_kv_heads is None
    m = build_mixer("attention", 16, {"n_heads": 4})
    assert m.head_dim == 4 and m.n_kv_heads == 4 and m.qkv.bias is None and m.out.bias is None
