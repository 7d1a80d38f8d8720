"""Shared layers: the causal short convolution (hand-written backward) against ``conv1d`` and its
own decode step; the fused projection of the GPU plan against the modules called one by one."""
import pytest
import torch
import torch.nn.functional as F

from kernels.device import gpu_path_on_cpu
from mixers.layers import ShortConv, project


def _conv1d_reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), conv.conv.weight, conv.conv.bias, padding=conv.kernel_size - 1,
                 groups=conv.channels)[..., :T].transpose(1, 2)
    return F.silu(y) if conv.activation else y


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 29])
@pytest.mark.parametrize("activation", [True, False])
def test_short_conv_matches_conv1d_with_gradients(k, T, activation):
    conv = ShortConv(5, k, activation=activation).double()
    with torch.no_grad():
        conv.conv.bias.normal_()
    # a strided input, as produced by splitting a projection
    x = torch.randn(2, T, 9, dtype=torch.float64)[..., 2:7].requires_grad_()
    g = torch.randn(2, T, 5, dtype=torch.float64)
    params = (x, conv.conv.weight, conv.conv.bias)
    y = conv(x)
    got = torch.autograd.grad((y * g).sum(), params)
    y_ref = _conv1d_reference(conv, x)
    want = torch.autograd.grad((y_ref * g).sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_short_conv_forward_equals_decode_steps():
    conv = ShortConv(6, 4).double()
    x = torch.randn(3, 11, 6, dtype=torch.float64)
    state = conv.init_state(3, dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        y_t, state = conv.step(x[:, t], state)
        ys.append(y_t)
    torch.testing.assert_close(conv(x), torch.stack(ys, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, conv.final_state(x), rtol=0, atol=0)


def test_short_conv_rejects_wrong_shape():
    with pytest.raises(ValueError, match="batch, time, 6"):
        ShortConv(6, 4)(torch.randn(2, 5, 7))


@pytest.mark.parametrize("widths", [(24, 5, 7), (16, 8, 8), (3,)])
def test_project_fused_equals_modules_with_aligned_rows(widths):
    """On the GPU plan one matmul, its row padded to a multiple of 16 outputs: every part equals its module's
    output (and its gradients the separate modules'), and the token stride of every part read in place (a
    bias-free one; a bias is added into a new tensor) divides by 16."""
    d = 11
    group = [torch.nn.Linear(d, widths[0] - 1, bias=False, dtype=torch.float64),
             torch.nn.Linear(d, 1, bias=False, dtype=torch.float64)]
    modules = [group] + [torch.nn.Linear(d, w, bias=i % 2 == 1, dtype=torch.float64) for i, w in enumerate(widths[1:])]
    x = torch.randn(2, 7, d, dtype=torch.float64, requires_grad=True)
    with gpu_path_on_cpu():
        parts = project(x, modules)
    want = [torch.cat([m(x) for m in group], -1)] + [m(x) for m in modules[1:]]
    params = [x] + [p for m in group + modules[1:] for p in m.parameters()]
    gs = [torch.randn_like(w) for w in want]
    got_grads = torch.autograd.grad(sum((p * g).sum() for p, g in zip(parts, gs)), params)
    want_grads = torch.autograd.grad(sum((w * g).sum() for w, g in zip(want, gs)), params)
    for p, w, m in zip(parts, want, modules):
        torch.testing.assert_close(p, w, rtol=1e-12, atol=1e-12)
        if len(widths) > 1 and getattr(m, "bias", None) is None:
            assert p.stride(1) % 16 == 0, f"token stride {p.stride(1)} of a part of widths {widths}"
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
