"""The state mixers of mixers.mlp against their formulas written out here with independent tools.

- ``koopman_mlp`` (Echo, arXiv 2605.06997, section 3.3): each pair of lifted coordinates is one complex number
  multiplied by ``min(|lambda|, 1) e^{i theta}``; here through ``torch.view_as_complex`` and ``torch.polar``,
  with eigenvalues drawn both inside and outside the unit circle (the clamp must hold the outside ones at 1).
- Its lifted width is ``mult * d_model`` rounded up to ``multiple_of`` and then to even (pairs need it).
- ``swiglu``: ``W_2 (SiLU(W_1 x) * W_3 x)`` from the two halves of ``w_in``, hidden width rounded up.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixers import build_state_mixer


def _draw_koopman(layer_norm: bool):
    d = int(torch.randint(3, 9, ()))
    sm = build_state_mixer("koopman_mlp", d, {"mult": 1.5, "multiple_of": 4, "layer_norm": layer_norm}).double()
    pairs = sm.theta.numel()
    with torch.no_grad():
        outside = torch.arange(pairs) % 2 == 0                              # half the eigenvalues have |lambda| > 1
        size = torch.rand(pairs, dtype=torch.float64) + 0.05
        sm.log_modulus.copy_(torch.where(outside, size, -size))
        sm.theta.copy_(torch.rand(pairs, dtype=torch.float64) * 2 * math.pi - math.pi)
        if layer_norm:
            sm.norm.weight.copy_(torch.randn(d, dtype=torch.float64))
            sm.norm.bias.copy_(torch.randn(d, dtype=torch.float64))
    return sm, d


def _koopman_by_complex_numbers(sm, x, layer_norm: bool):
    if layer_norm:
        x = F.layer_norm(x, (x.shape[-1],), sm.norm.weight, sm.norm.bias, eps=sm.norm.eps)
    h = F.silu(x @ sm.lift.weight.T + sm.lift.bias)
    z = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2).contiguous())
    modulus = torch.exp(sm.log_modulus).clamp(max=1.0)
    rotated = z * torch.polar(modulus, sm.theta)
    return torch.view_as_real(rotated).flatten(-2) @ sm.readout.weight.T


def test_koopman_mlp_is_a_complex_rotation_scale_with_the_modulus_held_at_one():
    for layer_norm in (True, False):
        sm, d = _draw_koopman(layer_norm)
        x = torch.randn(2, int(torch.randint(1, 6, ())), d, dtype=torch.float64)
        torch.testing.assert_close(sm(x), _koopman_by_complex_numbers(sm, x, layer_norm), rtol=1e-10, atol=1e-10)


def test_koopman_mlp_eigenvalues_outside_the_circle_get_no_gradient_through_their_modulus():
    sm, d = _draw_koopman(True)
    sm(torch.randn(2, 3, d, dtype=torch.float64)).square().sum().backward()
    outside = sm.log_modulus.detach() > 0
    assert torch.equal(sm.log_modulus.grad[outside], torch.zeros_like(sm.log_modulus.grad[outside]))
    assert (sm.log_modulus.grad[~outside] != 0).all()


def test_koopman_mlp_lifted_width_is_rounded_up_to_the_multiple_and_then_to_even():
    for _ in range(5):
        d, mult = int(torch.randint(1, 20, ())), float(torch.rand(()) * 3 + 0.1)
        multiple_of = int(torch.randint(1, 10, ()))
        sm = build_state_mixer("koopman_mlp", d, {"mult": mult, "multiple_of": multiple_of})
        want = math.ceil(mult * d / multiple_of) * multiple_of
        want += want % 2
        assert sm.lift.out_features == sm.readout.in_features == want == 2 * sm.theta.numel(), (d, mult, multiple_of)


def test_swiglu_is_w2_of_silu_w1x_times_w3x_with_its_hidden_width_rounded_up():
    d, mult, multiple_of = int(torch.randint(2, 12, ())), float(torch.rand(()) * 3 + 0.5), int(torch.randint(1, 9, ()))
    sm = build_state_mixer("swiglu", d, {"mult": mult, "multiple_of": multiple_of}).double()
    hidden = math.ceil(mult * d / multiple_of) * multiple_of
    assert sm.w_in.out_features == 2 * hidden and sm.w_out.in_features == hidden
    W1, W3 = sm.w_in.weight[:hidden], sm.w_in.weight[hidden:]
    x = torch.randn(3, int(torch.randint(1, 5, ())), d, dtype=torch.float64)
    want = (F.silu(x @ W1.T) * (x @ W3.T)) @ sm.w_out.weight.T
    torch.testing.assert_close(sm(x), want, rtol=1e-10, atol=1e-10)
