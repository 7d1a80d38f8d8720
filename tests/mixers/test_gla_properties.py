"""The GLA layer equals its documented equations written out as a loop over tokens from the module's own
weights: the q | k | v layout of the input projection, the short convolution, L2-normalised queries and keys,
the beta gate, the forget gate, and the per-head gated RMSNorm read through SiLU of the output gate.

Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training", arXiv:2312.06635.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

from .test_deltaproduct_properties import assert_forward_and_prefill_equal, causal_conv_silu

D = 16


def gla_inputs(m, x):
    """``(q, k, v, g, z)`` of the layer's equations, per head ``(B, T, h, d)`` (``g`` ``(B, T, h)``): the projection
    through the short convolution and SiLU, L2-normalised ``q`` and ``k``, the beta gate on ``k`` and ``v``, the log
    decay and the output gate's input."""
    o_opt, h, d = m.options, m.n_heads, m.head_dim
    B, T, _ = x.shape
    qkv = causal_conv_silu(m.conv, x @ m.in_proj.weight.T)
    q, k, v = (qkv[..., i * h * d:(i + 1) * h * d].reshape(B, T, h, d) for i in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    if o_opt.beta_gate:
        beta = torch.sigmoid(x @ m.beta_proj.weight.T + m.beta_proj.bias)[..., None]
        k, v = beta * k, beta * v
    if o_opt.forget_gate:
        g = -torch.exp(m.gate.A_log) * F.softplus(x @ m.gate.proj.weight.T + m.gate.dt_bias)
    else:
        g = x.new_zeros(B, T, h)
    return q, k, v, g, (x @ m.z_proj.weight.T).reshape(B, T, h, d)


def reference(m, x):
    """``y (B, T, D)`` from the equations of the module docstring, one token at a time."""
    h, d = m.n_heads, m.head_dim
    B, T, _ = x.shape
    q, k, v, g, z = gla_inputs(m, x)
    U = x.new_zeros(B, h, d, d)
    ys = []
    for t in range(T):
        U = torch.exp(g[:, t])[..., None, None] * U + v[:, t, :, :, None] * k[:, t, :, None, :]
        o = (U @ q[:, t, :, :, None])[..., 0] / math.sqrt(d)
        normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
        ys.append((normed * F.silu(z[:, t])).reshape(B, h * d) @ m.out_proj.weight.T)
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize("options", [
    {},
    {"n_heads": 4, "head_dim": None},
    {"beta_gate": False, "conv_size": 2},
    {"forget_gate": False},
])
def test_forward_and_prefill_equal_the_token_loop(options):
    m = build_mixer("gla", D, {"n_heads": 2, "head_dim": 8, "chunk_size": 4, **options}).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))       # no symmetry at init (unit gains, zero biases) hides a term
    assert_forward_and_prefill_equal(m, reference, torch.randn(2, 11, D, dtype=torch.float64))
