"""The time-first short convolution (several ShortConv modules fused over channel blocks) equals
torch's conv1d on each block (values and gradients of input, weight, bias)."""
import pytest
import torch
import torch.nn.functional as F

import mixers.conv_time_first as ctf
from mixers.conv_time_first import causal_conv_time_first, short_conv_time_first
from mixers.layers import ShortConv


@pytest.mark.parametrize("activation", [True, False])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_matches_short_conv(T, activation, monkeypatch):
    monkeypatch.setattr(ctf, "_BLOCK_ELEMENTS", 64)  # several time blocks even at these sizes
    convs = [ShortConv(c, 4, activation=activation).double() for c in (3, 5)]
    x = torch.randn(2, T, 8, dtype=torch.float64, requires_grad=True)
    params = [p for c in convs for p in (c.conv.weight, c.conv.bias)]
    def conv1d(c, xi):  # the nn.Conv1d these modules hold, in its own channels-first layout
        y = c.conv(xi.transpose(1, 2))[..., :T].transpose(1, 2)
        return F.silu(y) if activation else y
    want = torch.cat([conv1d(convs[0], x[..., :3]), conv1d(convs[1], x[..., 3:])], dim=-1)
    got = short_conv_time_first(convs, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(want)
    g_want = torch.autograd.grad(want, [x, *params], dy)
    g_got = torch.autograd.grad(got, [x, *params], dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_bad_shapes():
    x = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: causal_conv_time_first(x, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: causal_conv_time_first(x, w, None, activation=False), (x, w))
    with pytest.raises(ValueError, match="weight"):
        causal_conv_time_first(x, torch.randn(5, 3, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="expected x"):
        short_conv_time_first(ShortConv(3), x)
