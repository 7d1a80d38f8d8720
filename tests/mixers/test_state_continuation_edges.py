"""Prefill over ``x[:, :a]`` then ``step`` over the rest equals ``forward`` over ``x`` at the split points the
contract's single split (14 of 23) leaves out: ``a = 0`` (decode from the empty prefill's state), ``a = 1``, an odd
split mid-chunk, ``a = T - 1`` and ``a = T`` (nothing to decode; the prefill alone), for a length that is not a
multiple of the chunk size and a batch of three, in fp64 against the fp64 forward."""
import pytest
import torch

from mixers import MIXERS

from .contract import D_MODEL, make, rel

T = 13


@pytest.mark.parametrize("name", MIXERS.names())
def test_prefill_then_step_equals_forward_at_every_edge_split(name):
    m = make(name, torch.float64)
    x = torch.randn(3, T, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
        for a in (0, 1, 5, T - 1, T):
            y_pre, state = m.prefill(x[:, :a])
            assert sum(v.numel() for v in state.values()) == 3 * m.state_size(a), f"{name}: state_size({a})"
            ys = [y_pre]
            for t in range(a, T):
                y_t, state = m.step(x[:, t], state)
                ys.append(y_t[:, None])
            err = rel(torch.cat(ys, 1), y)
            assert err < 1e-9, f"{name}: prefill of {a} then {T - a} steps vs forward: rel err {err:.2e}"
