"""``kernels.scan.chunk_scan`` (the state pass across chunks, :mod:`kernels.scan`) against the plain loop
``S_c = a_c S_{c-1} + X_c`` differentiated by autograd, in fp32 and fp64, for several state shapes: the
``torch`` backend (the CPU path, a Python loop with its own backward) and the ``triton`` backend (one kernel
forward and one backward, through the interpreter), and ``auto`` following the device plan."""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting
from kernels.scan import chunk_scan
from tests.kernels.harness import compare_backends

needs_triton = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")


def _loop(a, X, S0):
    lead = a.ndim - 1
    extra = X.ndim - a.ndim
    S, starts = S0, []
    for c in range(a.shape[-1]):
        starts.append(S)
        S = a[..., c].reshape(*a.shape[:-1], *([1] * extra)) * S + X.select(lead, c)
    return torch.stack(starts, lead), S


def _inputs(lead, n, state):
    return torch.rand(*lead, n), torch.randn(*lead, n, *state), torch.randn(*lead, *state)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("lead,state", [((2, 3), (4, 5)), ((1, 2), (3,)), ((2,), (2, 2, 2)), ((2,), (600,))])
def test_chunk_scan_matches_loop(backend, lead, state):
    """(600,): a state wider than one Triton block, so the gradient of ``a`` is summed over blocks."""
    a, X, S0 = _inputs(lead, 7, state)

    def fn(a, X, S0):
        return chunk_scan(a, X, S0, backend=backend)

    compare_backends(fn, _loop, [a, X, S0], tol=1e-6, grad_tol=1e-6)
    compare_backends(fn, _loop, [a.double(), X.double(), S0.double()], tol=1e-13, grad_tol=1e-13)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("used", ["starts", "final"])
def test_chunk_scan_with_one_output_used(backend, used):
    """The backward when only the chunk-start states or only the final state carry a gradient."""
    a, X, S0 = _inputs((2, 3), 6, (4,))
    pick = 0 if used == "starts" else 1
    compare_backends(lambda a, X, S0: chunk_scan(a, X, S0, backend=backend)[pick],
                     lambda a, X, S0: _loop(a, X, S0)[pick], [a, X, S0], tol=1e-6, grad_tol=1e-6)


def test_chunk_scan_zero_initial_and_gradcheck():
    a = torch.rand(2, 5, dtype=torch.float64, requires_grad=True)
    X = torch.randn(2, 5, 3, 2, dtype=torch.float64, requires_grad=True)
    starts, fin = chunk_scan(a, X)
    assert torch.equal(starts[:, 0], torch.zeros(2, 3, 2, dtype=torch.float64))
    torch.autograd.gradcheck(lambda a, X: chunk_scan(a, X), (a, X))
    with pytest.raises(ValueError, match="must start with the shape of a"):
        chunk_scan(a, X[:, :4])


@needs_triton
@pytest.mark.parametrize("n", [3, 12])
def test_auto_follows_the_device_plan(n):
    """On the CPU plan ``auto`` is the loop (no kernel); on the GPU plan it is one kernel forward and one
    backward whatever the chunk count, with the loop's values."""
    a, X, S0 = (t.double().requires_grad_() for t in _inputs((2,), n, (3, 4)))
    with counting() as launches:
        starts, fin = chunk_scan(a, X, S0)
        (starts.sum() + fin.sum()).backward()
    assert sum(launches.values()) == 0
    with gpu_path_on_cpu(), counting() as launches:
        got = chunk_scan(a, X, S0)
        (got[0].sum() + got[1].sum()).backward()
    assert dict(launches) == {"scan._scan_fwd": 1, "scan._scan_bwd": 1}
    for g, w in zip(got, (starts, fin)):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)
