"""``kernels.common.chunk_scan`` (the state pass across chunks with its own backward) against the plain
loop ``S_c = a_c S_{c-1} + X_c`` differentiated by autograd, in fp64, for several state shapes."""
from __future__ import annotations

import pytest
import torch

from kernels.common import chunk_scan
from tests.kernels.harness import compare_backends


def _loop(a, X, S0):
    lead = a.ndim - 1
    extra = X.ndim - a.ndim
    S, starts = S0, []
    for c in range(a.shape[-1]):
        starts.append(S)
        S = a[..., c].reshape(*a.shape[:-1], *([1] * extra)) * S + X.select(lead, c)
    return torch.stack(starts, lead), S


@pytest.mark.parametrize("lead,state", [((2, 3), (4, 5)), ((1, 2), (3,)), ((2,), (2, 2, 2))])
def test_chunk_scan_matches_loop(lead, state):
    n = 7
    a = torch.rand(*lead, n)
    X = torch.randn(*lead, n, *state)
    S0 = torch.randn(*lead, *state)
    compare_backends(chunk_scan, _loop, [a, X, S0], tol=1e-6, grad_tol=1e-6)
    compare_backends(chunk_scan, _loop, [a.double(), X.double(), S0.double()], tol=1e-13, grad_tol=1e-13)


def test_chunk_scan_zero_initial_and_gradcheck():
    a = torch.rand(2, 5, dtype=torch.float64, requires_grad=True)
    X = torch.randn(2, 5, 3, 2, dtype=torch.float64, requires_grad=True)
    starts, fin = chunk_scan(a, X)
    assert torch.equal(starts[:, 0], torch.zeros(2, 3, 2, dtype=torch.float64))
    torch.autograd.gradcheck(lambda a, X: chunk_scan(a, X), (a, X))
    with pytest.raises(ValueError, match="must start with the shape of a"):
        chunk_scan(a, X[:, :4])
