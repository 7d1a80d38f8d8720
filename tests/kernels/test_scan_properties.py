"""kernels.scan.chunk_scan at its edges, against the recurrence ``S_c = a_c S_{c-1} + X_c`` written out here:
no chunks (the final state is the initial one, and so is its gradient), decays in another dtype than the
contributions (the final state keeps ``promote_types(X.dtype, fp32)`` on every backend), and an initial state of
the wrong shape refused with the shape it must have."""
from __future__ import annotations

import pytest
import torch

from kernels.common import state_dtype
from kernels.scan import chunk_scan
from tests.kernels.harness import needs_triton

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]


def _loop(a, X, S0):
    S, starts = S0, []
    for c in range(a.shape[-1]):
        starts.append(S)
        S = a[..., c, None] * S + X[..., c, :]
    return starts, S


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_chunks_hands_the_initial_state_and_its_gradient_straight_through(backend):
    lead, D = (2, int(torch.randint(1, 4, ()))), int(torch.randint(1, 6, ()))
    a = torch.rand(*lead, 0, dtype=torch.float64, requires_grad=True)
    X = torch.randn(*lead, 0, D, dtype=torch.float64, requires_grad=True)
    S0 = torch.randn(*lead, D, dtype=torch.float64, requires_grad=True)
    starts, final = chunk_scan(a, X, S0, backend=backend)
    assert starts.shape == (*lead, 0, D)
    torch.testing.assert_close(final, S0, rtol=0, atol=0)
    d_final = torch.randn_like(final)
    (g_S0,) = torch.autograd.grad(final, S0, d_final)
    torch.testing.assert_close(g_S0, d_final, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decays_in_fp64_leave_the_final_state_in_the_dtype_of_the_contributions(backend):
    n, D = int(torch.randint(1, 6, ())), int(torch.randint(1, 6, ()))
    a = torch.rand(2, n, dtype=torch.float64)
    X, S0 = torch.randn(2, n, D), torch.randn(2, D)
    starts, final = chunk_scan(a, X, S0, backend=backend)
    want_starts, want_final = _loop(a, X.double(), S0.double())
    assert starts.dtype == X.dtype and final.dtype == state_dtype(X) == torch.float32
    torch.testing.assert_close(final, want_final.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(starts, torch.stack(want_starts, 1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_initial_state_of_the_wrong_shape_is_refused_with_the_shape_it_needs(backend):
    n, D = int(torch.randint(1, 6, ())), int(torch.randint(2, 6, ()))
    a, X = torch.rand(2, n), torch.randn(2, n, D)
    with pytest.raises(ValueError, match=rf"initial \(2, {D + 1}\) must be .*\(2, {D}\)"):
        chunk_scan(a, X, torch.randn(2, D + 1), backend=backend)
    with pytest.raises(ValueError, match="must start with the shape of a"):
        chunk_scan(a, X[:, :, None].expand(2, n, 3, D)[:1], backend=backend)
