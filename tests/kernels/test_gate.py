"""The log-decay gate's Triton kernels (:mod:`kernels.gate`, the GPU path) against the PyTorch formula
``-exp(A_log) softplus(raw + dt_bias)``, values and gradients of all three inputs in fp32 and fp64 through
the interpreter, including steps far in both tails of the softplus and a strided projection block."""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.gate import log_decay, log_decay_reference
from kernels.launch import counting
from tests.kernels.harness import assert_rel_close, cancellation

pytestmark = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_log_decay_matches_formula(dtype, tol):
    """Pre-activations from -19 to 15 (torch's softplus switches to the identity above 20, where the two
    differ by exp(-20) relative); a column block of a wider matrix read in place. d A_log and d dt_bias sum
    one term per token, which can cancel (one fp32 draw missed 1e-6 by 4 %): their tolerance is scaled by
    how much the terms cancel on the draw."""
    H = 5
    wide = torch.randn(3, 40, 3 * H, dtype=dtype) * 4
    wide[0, 0, H:2 * H] = torch.linspace(-15, 15, H, dtype=dtype)
    raw = wide[..., H:2 * H]
    A_log, dt_bias = torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype) - 4
    dg = torch.randn(3, 40, H, dtype=dtype)
    outs = []
    for fn in (lambda *a: log_decay(*a, backend="triton"), log_decay_reference):
        xs = [t.detach().requires_grad_() for t in (raw, A_log, dt_bias)]
        with counting() as launches:
            g = fn(*xs)
            grads = torch.autograd.grad(g, xs, dg)
        outs.append(([g.detach(), *grads], sum(launches.values())))
    (got, n_launches), (want, _) = outs
    assert n_launches == 2
    exact = [t.detach().double() for t in (raw, A_log, dt_bias)]
    for i, (name, a, b) in enumerate(zip(("g", "d raw", "d A_log", "d dt_bias"), got, want)):
        spread = cancellation(log_decay_reference, exact, i - 1, tuple(raw.shape), dg.double()) if i >= 2 else 1.0
        assert_rel_close(a, b, tol * spread, name)


def test_small_steps_keep_their_digits():
    """softplus(u) for u around -17 (steps dt ~ 4e-8): the relative error stays at rounding, where
    log(1 + exp(u)) in fp32 would return 0."""
    raw = torch.linspace(-18, -16, 7).unsqueeze(-1)
    got = log_decay(raw, torch.zeros(1), torch.zeros(1), backend="triton")
    want = log_decay_reference(raw.double(), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert_rel_close(got, want, 1e-6, "small steps")


def test_bad_shapes():
    with pytest.raises(ValueError, match="share H"):
        log_decay(torch.randn(2, 3), torch.randn(4), torch.randn(4))
