"""The DeltaProduct layer (and its DeltaNet / Gated DeltaNet presets) equals its documented equations written
out as a loop over tokens from the module's own weights, for each option that changes the equations:
Householder steps per token, the beta range (0, 2) of negative eigenvalues or (0, 1), the forget gate, the short
convolution and the output norm's eps.

Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder Products",
arXiv:2502.10297; Yang et al. 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv:2412.06464.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

D, H, K = 16, 2, 8


def assert_forward_and_prefill_equal(m, reference, x):
    """``m(x)`` and ``m.prefill(x)``'s output equal ``reference(m, x)`` (a token loop in fp64) within 1e-9."""
    with torch.no_grad():
        want = reference(m, x)
        got, got_prefill = m(x), m.prefill(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_prefill, want, rtol=1e-9, atol=1e-9)


def causal_conv_silu(conv, x):
    """``SiLU(b + sum_j w_j x_{t - (k-1) + j})`` token by token, zeros before the first token."""
    w, b = conv.conv.weight[:, 0], conv.conv.bias                     # (C, k), (C,)
    k = w.shape[1]
    padded = torch.cat([x.new_zeros(x.shape[0], k - 1, x.shape[2]), x], dim=1)
    return torch.stack([F.silu(b + (padded[:, t:t + k].transpose(1, 2) * w).sum(-1))
                        for t in range(x.shape[1])], dim=1)


def reference(m, x):
    """``y (B, T, D)`` from the equations of the module docstring, one token at a time."""
    o_opt, n = m.options, m.n_h
    q, k, v = x @ m.q_proj.weight.T, x @ m.k_proj.weight.T, x @ m.v_proj.weight.T
    if o_opt.use_short_conv:
        q, k, v = causal_conv_silu(m.q_conv, q), causal_conv_silu(m.k_conv, k), causal_conv_silu(m.v_conv, v)
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    B, T, _ = x.shape
    q = q.reshape(B, T, H, K)
    k, v = k.reshape(B, T, n, H, K), v.reshape(B, T, n, H, K)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = (2.0 if o_opt.allow_neg_eigval else 1.0) * torch.sigmoid(x @ m.b_proj.weight.T).reshape(B, T, n, H)
    z = (x @ m.z_proj.weight.T).reshape(B, T, H, K)
    S = x.new_zeros(B, H, K, K)
    eye = torch.eye(K, dtype=x.dtype)
    ys = []
    for t in range(T):
        if m.gate is not None:
            raw = x[:, t] @ m.gate.proj.weight.T + m.gate.dt_bias
            S = S * torch.exp(-torch.exp(m.gate.A_log) * F.softplus(raw))[:, :, None, None]
        for j in range(n):
            kk, vv, bb = k[:, t, j], v[:, t, j], beta[:, t, j, :, None, None]
            householder = eye - bb * kk[..., :, None] * kk[..., None, :]
            S = householder @ S + bb * kk[..., :, None] * vv[..., None, :]
        o = (S.transpose(-1, -2) @ q[:, t, ..., None])[..., 0] / math.sqrt(K)   # (B, H, K)
        normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + o_opt.norm_eps) * m.norm.weight
        ys.append((normed * F.silu(z[:, t])).reshape(B, H * K) @ m.o_proj.weight.T)
    return torch.stack(ys, dim=1)


def randomised(name, **options):
    m = build_mixer(name, D, {"n_heads": H, "head_dim": K, "chunk_size": 4, **options}).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))       # no symmetry at init (unit gains, zero biases) hides a term
    return m


CASES = [
    ("deltaproduct", {}),
    ("deltaproduct", {"allow_neg_eigval": False}),
    ("deltaproduct", {"num_householder": 3, "use_short_conv": False}),
    ("deltaproduct", {"use_forget_gate": False, "norm_eps": 0.3, "conv_size": 2}),
    ("deltanet", {}),
    ("gated_deltanet", {"allow_neg_eigval": False, "norm_eps": 1.0}),
]


@pytest.mark.parametrize("name, options", CASES)
def test_forward_and_prefill_equal_the_token_loop(name, options):
    m = randomised(name, **options)
    assert_forward_and_prefill_equal(m, reference, torch.randn(2, 11, D, dtype=torch.float64))


@pytest.mark.parametrize("allow_neg_eigval, low, high", [(True, 0.0, 2.0), (False, 0.0, 1.0)])
def test_a_householder_factor_has_eigenvalue_one_minus_beta(allow_neg_eigval, low, high):
    """With beta in (0, 2) a factor I - beta k k^T can reverse the key direction (eigenvalue in (-1, 1)); with
    beta in (0, 1) it cannot. Large pre-activations push beta to the ends of its range."""
    m = randomised("deltanet", allow_neg_eigval=allow_neg_eigval, use_short_conv=False)
    b = torch.tensor([-40.0, 0.0, 40.0], dtype=torch.float64)[:, None].expand(3, H)
    beta = m._beta(b)[:, 0]
    torch.testing.assert_close(beta[:, 0], torch.tensor([low, (low + high) / 2, high], dtype=torch.float64),
                               rtol=0, atol=1e-12)
