"""The short convolution at the ends of the length range: an empty sequence gives an empty output and zero
gradients on every backend (as the mixers' time-first path does), and sequences shorter than the filter match an
explicit sum over the taps computed here."""
import pytest
import torch
import torch.nn.functional as F

from kernels.backend import triton_usable_for
from kernels.shortconv import causal_conv
from tests.kernels.harness import DEVICE, assert_rel_close

BACKENDS = ["reference", "auto"] + (["triton"] if triton_usable_for(torch.empty(0, device=DEVICE)) else [])


def _explicit(x, w, b, activation):
    """``y_t = b + sum_j w_j x_{t-(k-1)+j}`` with zeros before the sequence, as a loop over taps, in fp64."""
    x, w = x.double(), w.double()
    k = w.shape[1]
    y = torch.zeros_like(x) if b is None else b.double().expand_as(x).clone()
    for j in range(k):
        shift = k - 1 - j
        if shift < x.shape[1]:
            y[:, shift:] += w[:, j] * x[:, :x.shape[1] - shift]
    return F.silu(y) if activation else y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_empty_sequence_gives_an_empty_output_and_zero_gradients(backend, bias):
    x = torch.randn(2, 0, 5, device=DEVICE, requires_grad=True)
    w = torch.randn(5, 3, device=DEVICE, requires_grad=True)
    b = torch.randn(5, device=DEVICE, requires_grad=True) if bias else None
    y = causal_conv(x, w, b, backend=backend)
    assert y.shape == (2, 0, 5) and y.dtype == x.dtype
    inputs = [x, w] + ([b] if bias else [])
    for t, g in zip(inputs, torch.autograd.grad(y.sum(), inputs, allow_unused=True)):
        assert g is None or (g.shape == t.shape and not g.any())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 2, 4])
def test_sequences_up_to_the_filter_length_match_an_explicit_sum(backend, T):
    x, w, b = torch.randn(3, T, 6, device=DEVICE), torch.randn(6, 4, device=DEVICE), torch.randn(6, device=DEVICE)
    for activation in (True, False):
        assert_rel_close(causal_conv(x, w, b, activation, backend=backend), _explicit(x, w, b, activation).float(),
                         1e-5, f"T={T}")
