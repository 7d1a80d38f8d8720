"""The delta family against token loops of its recurrences written here in fp64, forward and gradients:

- ``delta_rule``, the (Gated) DeltaNet entry point (Yang et al., "Gated Delta Networks", arXiv:2412.06464), passes
  every argument on to the delta product: an explicit ``scale``, the forget gate and the initial state, on every
  backend;
- the Triton kernels with head dims split into several blocks (their loops over blocks of ``K`` and ``V``; at the
  other tests' head dims of 16 each loop runs once), for DeltaNet and DeltaProduct (Siems et al., "DeltaProduct",
  arXiv:2502.10297).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.delta import delta_rule
from tests.kernels.harness import assert_rel_close, needs_triton

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]


def delta_product_token_loop(q, k, v, beta, g, scale, S, n=1):
    """Per token ``t``: ``S <- e^{g_t} S``; for each of its ``n`` sub-steps ``j`` (rows ``t n + j`` of ``k``, ``v``,
    ``beta``) ``S <- S + beta_j k_j (v_j - S^T k_j)^T``; then ``o_t = scale S^T q_t``."""
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        for s in range(t * n, t * n + n):
            resid = v[:, s] - torch.einsum("bhkv,bhk->bhv", S, k[:, s])
            S = S + beta[:, s, :, None, None] * k[:, s, :, :, None] * resid[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def draw(B, T, H, K, V, n=1):
    """``q, k (unit rows), v, beta in (0, 2), g (log gate), S0`` for ``T`` tokens of ``n`` sub-steps."""
    return [torch.randn(B, T, H, K), F.normalize(torch.randn(B, T * n, H, K), dim=-1), torch.randn(B, T * n, H, V),
            2 * torch.rand(B, T * n, H), F.logsigmoid(torch.randn(B, T, H) + 2), torch.randn(B, H, K, V)]


def check_against_loop(run, inputs, scale, n=1, tol=2e-5, grad_tol=1e-4):
    """``run(q, k, v, beta, g, S0) -> (o, S)`` and its gradients in every input against the fp64 token loop."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    exact = [t.double().requires_grad_(True) for t in inputs]
    o, S = run(*leaves)
    o_ref, S_ref = delta_product_token_loop(*exact[:5], scale, exact[5], n)
    assert_rel_close(o, o_ref, tol, "output")
    assert_rel_close(S, S_ref, tol, "final state")
    do, dS = torch.randn_like(o_ref), torch.randn_like(S_ref)
    grads = torch.autograd.grad((o * do.float()).sum() + (S * dS.to(S.dtype)).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (S_ref * dS).sum(), exact)
    for name, got, want in zip(("dq", "dk", "dv", "dbeta", "dg", "dS0"), grads, grads_ref):
        assert_rel_close(got, want, grad_tol, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_rule_takes_an_explicit_scale(backend):
    scale = float(torch.rand(()) * 2 + 0.5)                # away from the default K ** -0.5 = 0.25

    def run(q, k, v, beta, g, S0):
        return delta_rule(q, k, v, beta, g=g, scale=scale, initial_state=S0, chunk_size=16, backend=backend)

    check_against_loop(run, draw(2, int(torch.randint(5, 30, ())), 2, 16, 8), scale)


@needs_triton
@pytest.mark.parametrize("n", [1, 2])
def test_triton_head_dims_in_several_blocks(n, monkeypatch):
    """K = 32 and V = 24 (padded to 32) in blocks of 16: every loop over head-dim blocks of the seven kernels runs
    twice. Chunks of 32 positions: with n = 2 the kernels read the 16 queries of a chunk in place."""
    import kernels.delta.triton as kt

    monkeypatch.setattr(kt, "BLOCK_V_MAX", 16)
    plan = kt.kernel_plan(32, 32, 32, False)
    assert (plan.bk, plan.bv, plan.bv_state) == (16, 16, 16) and kt.query_stride(n, 32) == n
    K = 32

    def run(q, k, v, beta, g, S0):
        return kt.delta_product_triton(q, k, v, beta, g, n, initial_state=S0, chunk_size=32)

    check_against_loop(run, draw(1, int(torch.randint(17, 40, ())) // n, 2, K, 24, n), K ** -0.5, n)
