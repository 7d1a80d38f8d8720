"""The fp32 chunked paths against an fp64 computation of the same function, at saturated gates and long lengths.

A chunk's decay from step ``s`` to step ``t`` is ``G_t - G_s`` (``G`` the cumulative log decay in the chunk).
Formed as the difference of the two cumulative sums, it kept only the digits of ``G``'s rounding: a weak step
(-0.02) after a strong one (-30) in the same chunk, ``G`` ~ -1000, came out to 6e-5 absolute, 100-200x the fp32
rounding of the token recurrence; and its gradient, a difference of O(1) sums whose true value is ``e^{-50}``-
sized at a saturated gate, was rounding noise (relative error 1, in fp64 as in fp32): Mamba-2's and Gated
DeltaNet's ``A_log`` gradients were off by 3e-4..2e-2 on inputs with a few outliers. The oracle is the
``reference`` backend (a token loop) in fp64; tolerances are a few times the fp32 rounding that the fp32 token
loop itself shows on the same inputs (~1e-7).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.delta import delta_rule
from kernels.gla import gla
from kernels.ssd import ssd
from mixers import build_mixer
from tests.kernels.harness import assert_rel_close, rel_err
from tests.mixers.contract import unzero

# fp32 rounding through a 64-step chunk and a few chunks' states: the fp32 token loop reaches 1e-7..3e-7 here
FP32_TOL = 2e-6


def _mixed_decays(shape):
    """Log decays where a random third of the steps are strong (-20..-40) and the rest weak (-0..-0.05): every
    chunk of 64 holds weak segments after strong steps."""
    strong = torch.rand(shape) < 1 / 3
    return torch.where(strong, -20 - 20 * torch.rand(shape), -0.05 * torch.rand(shape))


def _saturated_decays(shape):
    """Log decays of a saturated forget gate, -40..-60 (``e^g`` ~ 1e-22): the state forgets at every step."""
    return -40 - 20 * torch.rand(shape)


def _gla(q, k, v, g, backend):
    return gla(q, k, v, g, chunk_size=64, backend=backend)[0]


def _gla_shared_head(q, k, v, g, backend):
    return gla(q[:, :, :1], k[:, :, :1], v, g, chunk_size=64, backend=backend)[0]


def _delta(q, k, v, g, backend):
    beta = torch.sigmoid(v[..., 0]).to(q.dtype) * 2                       # beta over (0, 2): negative eigenvalues
    return delta_rule(q, F.normalize(k, dim=-1), v, beta, g=g, chunk_size=64, backend=backend)[0]


def _ssd(q, k, v, g, backend):
    A = -torch.ones(g.shape[-1], dtype=g.dtype)                          # dt A = g: the decays as step sizes
    return ssd(v, -g, A, k, q, chunk_size=64, backend=backend)[0]


OPS = {"gla": _gla, "gla_shared_head": _gla_shared_head, "delta_rule": _delta, "ssd": _ssd}


def _value_and_grads(op, inputs, backend, dtype, w):
    xs = [x.to(dtype).detach().requires_grad_() for x in inputs]
    y = op(*xs, backend)
    grads = torch.autograd.grad((y.double() * w).sum(), xs)
    return [y.detach()] + list(grads)


def _check_against_fp64(op, decays, T=256, H=2, d=16):
    q, k, v = torch.randn(1, T, H, d), torch.randn(1, T, H, d), torch.randn(1, T, H, d)
    inputs = (q, k, v, decays((1, T, H)))
    w = torch.randn(1, T, H, d, dtype=torch.float64)
    expected = _value_and_grads(op, inputs, "reference", torch.float64, w)
    actual = _value_and_grads(op, inputs, "torch", torch.float32, w)
    for name, a, e in zip(("output", "dq", "dk", "dv", "dg"), actual, expected):
        assert_rel_close(a, e, FP32_TOL, name)


@pytest.mark.parametrize("op", OPS)
def test_a_weak_decay_after_a_strong_one_in_the_chunk_keeps_fp32_accuracy(op):
    """Before: 1.4e-5 (gla, delta_rule) relative error in the output and every gradient, against 1e-7 for the
    fp32 token loop on the same inputs."""
    _check_against_fp64(OPS[op], _mixed_decays)


@pytest.mark.parametrize("op", ["gla", "gla_shared_head", "delta_rule"])
def test_the_gradient_of_a_saturated_gate_is_its_own_and_not_rounding_noise(op):
    """At log decays of -50 the decay's true gradient is ~1e-21; the chunked paths returned ~1e-43 or noise
    (relative error 1.0, the same in fp64) while the output was right. (SSD's decays reach its inputs through
    ``dt``, whose gradient the value path ``dt x`` dominates: the Mamba-2 layer test below checks ``A_log``.)"""
    _check_against_fp64(OPS[op], _saturated_decays)


@pytest.mark.parametrize("name", ["mamba2", "gated_deltanet"])
def test_decay_parameter_gradients_of_a_layer_on_inputs_with_outliers(name):
    """A whole layer on inputs where 32 tokens are 1000x the others (their gates saturate), its chunked fp32 path
    against the fp64 reference: the gradients of the decay's parameters ``A_log`` and ``dt_bias`` were 1e-4..2e-2
    off. These sums cancel, so fp32 itself costs up to ~1.6e-4 on some draws (the fp32 token loop's error, median
    ~1e-6): the chunked path is held to ``2 x`` that error ``+ 6e-5`` (measured over 200 draws each: at most
    ``2 x + 4e-6`` for Mamba-2, ``2 x + 3e-5`` for Gated DeltaNet)."""
    T, d = 512, 32
    layer = unzero(build_mixer(name, d, {"backend": "torch"}))
    x = torch.randn(1, T, d)
    x[0, torch.randint(0, T, (32,))] *= 1000
    w = torch.randn(1, T, d, dtype=torch.float64)
    grads = {}
    for backend, dtype in (("torch", torch.float32), ("reference", torch.float32), ("reference", torch.float64)):
        module = build_mixer(name, d, {"backend": backend})
        module.load_state_dict(layer.state_dict())
        module = module.to(dtype)
        (module(x.to(dtype)).double() * w).sum().backward()
        grads[backend, dtype] = dict(module.named_parameters())
    for param in ("gate.A_log", "gate.dt_bias"):
        truth = grads["reference", torch.float64][param].grad
        token_loop_error = rel_err(grads["reference", torch.float32][param].grad, truth)
        assert token_loop_error < 1e-3, f"{name} {param}: the fp32 token loop itself is {token_loop_error:.1e} off"
        assert_rel_close(grads["torch", torch.float32][param].grad, truth, 2 * token_loop_error + 6e-5, f"{name} {param}")
