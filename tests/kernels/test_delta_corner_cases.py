"""The delta product's final state follows the one rule of every state-carrying op
(:func:`kernels.common.state_dtype`): fp32 for fp32 inputs on every backend, also when the initial state handed
in is fp64, while the gradient of that initial state keeps its own dtype. Values and gradients against the
recurrence written out here ("DeltaProduct", arXiv:2502.10297)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.backend import triton_usable_for
from kernels.delta import delta_product
from tests.kernels.harness import DEVICE, assert_rel_close

BACKENDS = ["reference", "torch"] + (["triton"] if triton_usable_for(torch.empty(0, device=DEVICE)) else [])


def _explicit(q, k, v, beta, g, S, n):
    """Token by token in fp64: ``S <- e^g S``, then ``n`` steps ``S <- S + b k (v - S^T k)^T``; ``o = S^T q / sqrt(K)``."""
    q, k, v, beta, g, S = (t.double() for t in (q, k, v, beta, g, S))
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        for j in range(n):
            kj, vj, bj = k[:, t * n + j], v[:, t * n + j], beta[:, t * n + j]
            resid = vj - torch.einsum("bhkv,bhk->bhv", S, kj)
            S = S + bj[..., None, None] * kj[..., :, None] * resid[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * q.shape[-1] ** -0.5)
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2])
def test_fp64_initial_state_with_fp32_inputs_gives_an_fp32_state(backend, n):
    B, T, H, K, V = 2, 5, 2, 8, 4
    q = torch.randn(B, T, H, K, device=DEVICE)
    k = F.normalize(torch.randn(B, T * n, H, K, device=DEVICE), dim=-1)
    v = torch.randn(B, T * n, H, V, device=DEVICE)
    beta = torch.rand(B, T * n, H, device=DEVICE)
    g = -torch.rand(B, T, H, device=DEVICE)
    S0 = torch.randn(B, H, K, V, device=DEVICE, dtype=torch.float64, requires_grad=True)
    o, S = delta_product(q, k, v, beta, g=g, num_householder=n, initial_state=S0, chunk_size=16, backend=backend)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    o_ref, S_ref = _explicit(q, k, v, beta, g, S0, n)
    assert_rel_close(o, o_ref, 1e-5, "output")
    assert_rel_close(S, S_ref, 1e-5, "final state")
    dS = torch.randn(S.shape, device=DEVICE, dtype=torch.float64)
    (grad,) = torch.autograd.grad((S.double() * dS).sum(), S0)
    (grad_ref,) = torch.autograd.grad((S_ref * dS).sum(), S0)
    assert grad.dtype == torch.float64
    assert_rel_close(grad, grad_ref, 1e-5, "gradient of the initial state")
