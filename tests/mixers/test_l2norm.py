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
