"""``ssd`` refuses, on every backend, tensors whose shapes disagree with its layout, in one line naming the
tensor (the reference and torch backends broadcast a one-head ``dt``, ``A`` or ``B`` into a different model
than the one asked for, while the Triton backend refused them), and takes the layout the Mamba-2 layer passes
(``B`` and ``C`` of one group, expanded over the heads) as the reference does. An empty sequence gives the
same empty output and state on every backend."""
from __future__ import annotations

import pytest
import torch

from kernels.ska import ska
from kernels.ssd import ssd, ssd_reference
from tests.kernels.harness import needs_triton

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]
Bt, T, H, P, N = 2, 9, 3, 4, 5


def inputs():
    return dict(x=torch.randn(Bt, T, H, P), dt=torch.rand(Bt, T, H) * 0.5, A=-torch.rand(H) - 0.1,
                B=torch.randn(Bt, T, H, N), C=torch.randn(Bt, T, H, N))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,shape", [("dt", (Bt, T, 1)), ("A", (1,)), ("B", (Bt, T, 1, N)), ("C", (Bt, T, H, N + 1)),
                                        ("dt", (Bt, T - 1, H)), ("D", (1,)), ("initial_state", (Bt, H, N, P + 1))])
def test_a_mismatched_tensor_is_named(backend, name, shape):
    args = inputs()
    extra = {}
    if name in ("D", "initial_state"):
        extra[name] = torch.randn(shape)
    else:
        args[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"ssd: {name} "):
        ssd(**args, **extra, chunk_size=4, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_group_expanded_over_the_heads_runs_as_the_reference(backend):
    args = inputs()
    shared = torch.randn(Bt, T, 1, N)
    args["B"] = shared.expand(Bt, T, H, N)
    y, h = ssd(**args, chunk_size=4, backend=backend)
    y_ref, h_ref = ssd_reference(**{k: v.double() for k, v in args.items()})
    assert (y.double() - y_ref).abs().max() <= 1e-4 * y_ref.abs().max()
    assert (h.double() - h_ref).abs().max() <= 1e-4 * h_ref.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_sequence_gives_an_empty_output_and_the_initial_state(backend):
    """T = 0 (the Triton kernels refused it where the reference and torch backends return the empty output):
    every backend returns the empty output and the initial state (zeros without one) unchanged; attention and
    SKA (whose reductions over T failed on every backend) likewise give their empty outputs."""
    from kernels.attention import attention
    args = {k: v[:, :0] if v.dim() > 1 else v for k, v in inputs().items()}
    h0 = torch.randn(Bt, H, N, P)
    y, h = ssd(**args, chunk_size=4, backend=backend)
    assert y.shape == (Bt, 0, H, P) and h.shape == (Bt, H, N, P) and not h.any()
    y, h = ssd(**args, chunk_size=4, backend=backend, initial_state=h0)
    assert y.shape == (Bt, 0, H, P) and torch.equal(h, h0)
    q = torch.randn(Bt, 0, H, 16)
    assert attention(q, q, q, backend=backend).shape == (Bt, 0, H, 16)
    v = torch.randn(Bt, 0, H, P, requires_grad=True)
    out = ska(q, q, v, backend=backend)
    assert out.shape == (Bt, 0, H, P)
    out.sum().backward()
    assert v.grad.shape == v.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 4), (1, 3, 4), (2, 3, 5), (2, 1, 3, 4)])
def test_a_chunk_scan_initial_state_of_another_shape_is_named(backend, shape):
    """``initial`` must have ``a``'s leading dims, then the state's: one without the batch dims, or of another
    state shape, failed on every backend in the middle of the scan (or broadcast)."""
    from kernels.scan import chunk_scan
    a, X = torch.rand(2, 5), torch.randn(2, 5, 3, 4)
    with pytest.raises(ValueError, match=r"chunk_scan: initial .* must be a's leading dims then the state's, \(2, 3, 4\)"):
        chunk_scan(a, X, torch.randn(shape), backend=backend)
