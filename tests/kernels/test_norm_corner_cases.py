"""The L2 normalisation of half-precision rows at the ends of fp16's range, on every backend that runs here: a
zero row stays zero (``eps`` does not round to zero) and a row whose norm exceeds fp16's largest value still
comes out a unit vector, both against ``x / max(||x||, eps)`` computed in fp64, values and gradients."""
import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.norm import l2_normalize
from tests.kernels.harness import DEVICE, assert_rel_close

BACKENDS = ["reference", "auto"] + (["triton"] if triton_usable_for(torch.empty(0, device=DEVICE)) else [])


def _rows():
    """fp16 rows: ordinary, zero, and large entries (each below fp16's largest, their norm above it)."""
    x = torch.randn(4, 8, device=DEVICE)
    x[1] = 0
    x[2] = torch.empty(8, device=DEVICE).uniform_(2e4, 3e4) * torch.randn(8, device=DEVICE).sign()
    return x.half()


def _closed_form(x, eps=1e-12):
    x = x.double()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_zero_and_large_rows(backend):
    x = _rows().requires_grad_()
    y = l2_normalize(x, backend=backend)
    assert y.dtype == torch.float16
    assert_rel_close(y, _closed_form(x.detach()), 2e-3, "output")
    assert not y[1].any()
    dy = torch.randn(y.shape, device=DEVICE).half()
    dy[1] = 0  # the zero row's gradient, dy / eps, would lie beyond fp16's range
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    (dx_ref,) = torch.autograd.grad(_closed_form(x64), x64, dy.double())
    assert dx.dtype == torch.float16
    assert_rel_close(dx, dx_ref, 1e-2, "gradient")
