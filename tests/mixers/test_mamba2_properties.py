"""The Mamba-2 layer equals its documented equations written out as a loop over tokens from the module's own
weights, for several inner widths (``expand``), head dimensions and state sizes, and its decode state has the
size the documented formula gives.

Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State
Space Duality", arXiv:2405.21060.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

from .test_deltaproduct_properties import causal_conv_silu

D = 16


def reference(m, u, expand, d_state, headdim):
    """``out (B, T, D)``: ``[z, x, B, C] = W_in u``, ``x, B, C <- SiLU(conv(x, B, C))``,
    ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t + D x_t``, ``out = W_out (RMSNorm(y) silu(z))``
    (the default ``norm_before_gate``)."""
    inner, n_heads = expand * D, expand * D // headdim
    Bsz, T, _ = u.shape
    proj = u @ m.in_proj.weight.T
    z, xBC = proj[..., :inner], causal_conv_silu(m.conv, proj[..., inner:])
    x = xBC[..., :inner].reshape(Bsz, T, n_heads, headdim)
    Bm, Cm = xBC[..., inner:inner + d_state], xBC[..., inner + d_state:]
    dt = F.softplus(u @ m.gate.proj.weight.T + m.gate.dt_bias)                # (B, T, H)
    A = -torch.exp(m.gate.A_log)
    h = u.new_zeros(Bsz, n_heads, d_state, headdim)
    ys = []
    for t in range(T):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h \
            + dt[:, t, :, None, None] * Bm[:, t, None, :, None] * x[:, t, :, None, :]
        y = torch.einsum("bn,bhnp->bhp", Cm[:, t], h) + m.D[:, None] * x[:, t]
        y = y.reshape(Bsz, inner)
        normed = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
        ys.append((normed * F.silu(z[:, t])) @ m.out_proj.weight.T)
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize("expand, d_state, headdim", [(2, 8, 16), (1, 4, 8), (3, 8, 12)])
def test_forward_and_prefill_equal_the_token_loop(expand, d_state, headdim):
    m = build_mixer("mamba2", D, {"expand": expand, "d_state": d_state, "headdim": headdim,
                                  "chunk_size": 4}).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))       # no symmetry at init (unit gains, unit skip) hides a term
    u = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        want = reference(m, u, expand, d_state, headdim)
        got, got_prefill = m(u), m.prefill(u)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_prefill, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("expand, d_state, headdim, d_conv", [(2, 8, 16, 4), (3, 4, 8, 2), (1, 16, 4, 3)])
def test_state_size_is_the_documented_formula(expand, d_state, headdim, d_conv):
    """``n_heads * d_state * headdim + (expand d_model + 2 d_state) (d_conv - 1)``, n_heads = expand d_model / headdim."""
    m = build_mixer("mamba2", D, {"expand": expand, "d_state": d_state, "headdim": headdim, "d_conv": d_conv})
    n_heads = expand * D // headdim
    want = n_heads * d_state * headdim + (expand * D + 2 * d_state) * (d_conv - 1)
    assert m.state_size(7) == want
    _, state = m.prefill(torch.randn(3, 7, D))
    assert sum(t[0].numel() for t in state.values()) == want
