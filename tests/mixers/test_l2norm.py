"""l2_normalize equals F.normalize(dim=-1) in values and gradients, including rows clamped by eps."""
import torch
import torch.nn.functional as F

from mixers.l2norm import l2_normalize


def test_matches_f_normalize_values_and_grads():
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    x[0, 1] *= 1e-9                       # below eps: the clamped branch
    x[2, 3] = 0.0
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    want = F.normalize(x, dim=-1, eps=1e-6)
    got = l2_normalize(x, eps=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(want, x, dy)[0],
                               rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(lambda t: l2_normalize(t, 1e-6), (torch.randn(4, 6, dtype=torch.float64,
                                                                               requires_grad=True),))


def test_fp16_zero_and_large_rows_are_normalised_in_fp32():
    # in fp16 the default eps (1e-12) rounds to 0 and a row of entries near 1e3 has a norm beyond 65504
    x = torch.randn(4, 16).half()
    x[1] = 0.0
    x[2] = x[2].float().sign().mul(1e3 + 100 * torch.rand(16)).half()
    x.requires_grad_(True)
    dy = torch.randn(4, 16).half()
    x64 = x.detach().double().requires_grad_(True)
    want = F.normalize(x64, dim=-1, eps=1e-12)
    got = l2_normalize(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=1e-3)
    (gx,) = torch.autograd.grad(got, x, dy)
    (gw,) = torch.autograd.grad(want, x64, dy.double())
    rows = [0, 2, 3]    # (the zero row's gradient is dy / eps, 1e12 dy: beyond fp16 in any computation)
    assert gx.dtype == torch.float16 and torch.isfinite(gx[rows]).all()
    torch.testing.assert_close(gx[rows].double(), gw[rows], rtol=5e-3, atol=1e-5)
