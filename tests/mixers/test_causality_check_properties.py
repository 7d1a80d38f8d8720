"""The contract's causality check (``contract.check_causal``) judges the change of earlier outputs relative to
their own scale: a look-ahead leak of relative size 1e-6 fails it at every output scale, and a change of
rounding size (a few dozen eps) passes it at every output scale, including ones where a fixed absolute
tolerance would be blind (tiny outputs) or stricter than rounding (large outputs)."""
import pytest
import torch

from . import contract
from .example_mixer import CumulativeMean

SCALES = (1e-6, 1e-3, 1.0, 1e3, 1e6)


def scaled_mixer(scale: float, leak: float, reach: str):
    """The contributing guide's cumulative mean with its output multiplied by ``scale`` and, at relative size
    ``leak``, an output that reads a later token: ``reach`` is "next" (every position reads its successor's
    output) or "last" (the first position reads the last position's output)."""

    class Scaled(CumulativeMean):
        name = f"scaled_{reach}_{scale:g}_{leak:g}"

        def prefill(self, x, mask=None):
            y, state = super().prefill(x)
            y = y * scale
            later = torch.zeros_like(y)
            if reach == "next":
                later[:, :-1] = y[:, 1:]
            else:
                later[:, 0] = y[:, -1]
            return y + leak * later, state

    return Scaled


@pytest.mark.parametrize("reach", ["next", "last"])
@pytest.mark.parametrize("scale", SCALES)
def test_a_small_leak_fails_at_every_scale(registered, scale, reach):
    name = registered(scaled_mixer(scale, 1e-6, reach))
    with pytest.raises(AssertionError, match="changed by"):
        contract.check_causal(name)


@pytest.mark.parametrize("scale", SCALES)
def test_a_causal_mixer_passes_at_every_scale(registered, scale):
    contract.check_causal(registered(scaled_mixer(scale, 0.0, "next")))


@pytest.mark.parametrize("scale", SCALES)
def test_a_rounding_size_change_passes_at_every_scale(registered, scale):
    """A change of 16 eps relative (what a reordered sum may leave) is not taken for a leak."""
    leak = 16 * torch.finfo(torch.float64).eps
    contract.check_causal(registered(scaled_mixer(scale, leak, "last")))


def test_the_bound_follows_the_outputs_scale():
    past = torch.randn(2, 5, 3, dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    for scale in SCALES:
        bound = contract.causal_bound(past * scale, past * scale)
        assert bound == pytest.approx(contract.CAUSAL_EPS_MULTIPLE * eps * scale * past.abs().max().item())
