"""GLA against Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient Training", arXiv:2312.06635,
in its scalar-gate form with the block of Gated KalmaNet (arXiv:2511.21016), written here in fp64 from the layer's
weights through the parallel (attention-like) form of the recurrence rather than the recurrence itself:
``o_t = sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s / sqrt(d)``, ``G_t = sum_{r<=t} g_r`` (the paper's parallel form
with the per-channel gate matrix reduced to one decay per head), from the inputs of the token loop's reference
(:func:`tests.mixers.test_gla_properties.gla_inputs`: the short convolution and SiLU, L2-normalised queries and
keys, the beta gate on keys and values and the Mamba-2 log decay ``g_t = -exp(A_log) softplus(W_a x_t + dt_bias)``);
the output ``W_o [RMSNorm_head(o) * silu(W_g x)]`` normalised per head and then gated (the paper's
``Swish(x W_r) * Norm(o)``, and flash-linear-attention's GLA layer); and the forget gate's initial decay range.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

from .test_gla_properties import gla_inputs

F64 = torch.float64


def _randomised(d_model, **options):
    m = build_mixer("gla", d_model, {"chunk_size": 4, **options}).to(F64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))   # unit gains and zero biases at init would hide a misplaced term
    return m


def parallel_form(m, x):
    d, T = m.head_dim, x.shape[1]
    q, k, v, g, z = gla_inputs(m, x)
    G = g.cumsum(1)
    decay = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None], float("-inf")).exp()    # (B, t, s, h)
    scores = torch.einsum("bthd,bshd->btsh", q, k) * decay
    o = torch.einsum("btsh,bshd->bthd", scores, v) / math.sqrt(d)
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    return (normed * F.silu(z)).flatten(-2) @ m.out_proj.weight.T


@pytest.mark.parametrize("d_model, options", [
    (16, {"n_heads": 2, "head_dim": 8}),
    (12, {"n_heads": 3, "head_dim": None}),
    (8, {"n_heads": 2, "head_dim": 6, "beta_gate": False, "conv_size": 3}),
    (8, {"n_heads": 2, "head_dim": 4, "forget_gate": False}),
])
def test_layer_equals_the_parallel_form(d_model, options):
    m = _randomised(d_model, **options)
    x = torch.randn(2, int(torch.randint(5, 14, ())), d_model, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(m(x), parallel_form(m, x), rtol=1e-9, atol=1e-9)


def test_forget_gate_starts_in_the_mamba2_range():
    """At zero input the per-step decay is ``exp(-A dt)`` with ``A`` in [1, 16] and ``dt = softplus(dt_bias)`` in
    [1e-3, 1e-1], log-uniform (half of 2048 heads below the geometric midpoint 1e-2, half of the A below 8.5,
    give or take 0.1: over nine standard deviations)."""
    m = build_mixer("gla", 8, {"n_heads": 2048, "head_dim": 1})
    A = m.gate.A_log.detach().double().exp()
    dt = F.softplus(m.gate.dt_bias.detach().double())
    assert A.min() >= 1 - 1e-5 and A.max() <= 16 * (1 + 1e-5)
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    assert abs((dt < 1e-2).double().mean().item() - 0.5) < 0.1 and abs((A < 8.5).double().mean().item() - 0.5) < 0.1
    assert A.min() < 1.5 and A.max() > 15.5 and dt.min() < 1.5e-3 and dt.max() > 0.07
    with torch.no_grad():
        g = m.gate.log_decay(torch.zeros(1, 2048, dtype=torch.float32))
    decay = g.double().exp()
    assert decay.min() >= math.exp(-16 * 0.1) * (1 - 1e-5) and decay.max() <= math.exp(-1e-3) * (1 + 1e-6)
    assert torch.allclose(g.double(), -A * dt, rtol=1e-5, atol=0)
