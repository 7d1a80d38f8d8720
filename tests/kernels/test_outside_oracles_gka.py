"""Gated KalmaNet (``kernels.gka.gka``; "Gated KalmaNet", arXiv:2511.21016) against flash-linear-attention's MesaNet
and simple-GLA functions (oracles nobody here wrote), values and gradients, on every backend and solver that
runs here (Triton through the interpreter on a CPU).

fla 0.6.0's ``naive_mesa_net_exact(q, k, v, g, lamb, beta, h_kk_init, h_kv_init)`` (MesaNet; von Oswald et al.,
"MesaNet: Sequence Modeling by Locally Optimal Test-Time Training", arXiv:2506.05233), read from its source:
``H_t = e^{g_t} H_{t-1} + beta_t k_t k_t^T``, ``S_t = e^{g_t} S_{t-1} + beta_t k_t v_t^T`` (``(K, V)``, our
``U^T``), ``o_t = S_t^T (H_t + diag(lamb))^{-1} q_t`` by ``torch.linalg.solve``, no scale, time-first, in fp32;
it needs ``d_v = d_k``. That is GKA with ``ridge_a = 0`` (``lambda_t = ridge_eps``, a constant: the oracle has no
ridge that follows ``||H_t||_F``), ``alpha`` None, ``scale = 1`` and ``k, v`` scaled by ``sqrt(beta)``. With
``alpha``, ``o_t = alpha_t U_t x_t + (1 - alpha_t) U_t q_t``: the second term is fla's
``naive_recurrent_simple_gla`` on the same keys and values. ``num_iter = 0`` is gated linear attention, fla's
simple GLA alone.

Tolerances (relative Frobenius error), fp32 against the oracles in fp32, T 21 with chunks of 16, ``ridge_eps``
0.3 (condition number at most ``1 + ||H||_F / 0.3``, about 30 here, so 60 Chebyshev or 40 CG iterations reach fp32
rounding): measured 8e-8..6.5e-7 for outputs, both final states and the gradients of q, k, v, g, beta (alpha) and
both initial states, for the exact solve, Chebyshev with implicit gradients and CG; tolerance 1e-5. Chebyshev
with ``grad="reverse_chebyshev"`` runs the iteration backwards, which amplifies fp32 rounding by about
``rho_c^{-r}`` (kernels.gka.chebyshev; in fp64 it matches autograd through the unrolled iteration and reaches
the exact gradient to 1e-10 here): measured up to 5e-5 on the gradient of ``H_0`` over twelve draws; tolerance
2e-4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gka import gka
from tests.kernels.harness import compare_backends, needs_triton_on_cpu

#: (backend, solver, grad, num_iter) that reach the exact solution; the Triton one runs once (without alpha), as
#: the interpreter takes seconds
SOLVES = [("reference", "exact", "implicit", 1), ("torch", "exact", "implicit", 1),
          ("reference", "chebyshev", "implicit", 60), ("torch", "chebyshev", "implicit", 60),
          ("torch", "chebyshev", "reverse_chebyshev", 60), ("torch", "cg", "implicit", 40)]
CASES = [(*c, a) for c in SOLVES for a in (False, True)] + [
    pytest.param("triton", "chebyshev", "implicit", 60, False, marks=needs_triton_on_cpu)]
TOL = 1e-5
TOL_REVERSE = 2e-4
RIDGE = 0.3


def _inputs(B, T, H, d):
    """Unit queries and keys, a decay in (-0.3, 0], beta in (0.2, 1), a positive semi-definite ``H_0``."""
    q, k = (F.normalize(torch.randn(B, T, H, d), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, d)
    g = -torch.rand(B, T, H) * 0.3
    beta = torch.rand(B, T, H) * 0.8 + 0.2
    W = torch.randn(B, H, d, d) / d ** 0.5
    return [q, k, v, g, beta, W @ W.transpose(-1, -2), torch.randn(B, H, d, d)]


def _ours(backend, solver, grad, num_iter):
    def run(q, k, v, g, beta, H0, U0, *alpha):
        s = beta.sqrt().unsqueeze(-1)
        o, (H, U) = gka(q, k * s, v * s, g, alpha[0] if alpha else None, ridge_a=0.0, ridge_eps=RIDGE,
                        num_iter=num_iter, solver=solver, grad=grad, scale=1.0, chunk_size=16, initial_state=(H0, U0),
                        backend=backend)
        return o, H, U
    return run


@pytest.mark.parametrize("backend,solver,grad,num_iter,with_alpha", CASES)
def test_gka_matches_fla_naive_mesa_net_exact(backend, solver, grad, num_iter, with_alpha):
    """Output, ``H_T``, ``U_T`` and the gradients of q, k, v, g, beta, both initial states (and alpha); B 2, T 21
    (not a multiple of the chunk)."""
    mesa = pytest.importorskip("fla.ops.mesa_net.naive")
    simple = pytest.importorskip("fla.ops.simple_gla.naive")
    ins = _inputs(2, 21, 2, 16)
    if with_alpha:
        ins.append(torch.rand(2, 21, 2))

    def oracle(q, k, v, g, beta, H0, U0, *alpha):
        o, H, S = mesa.naive_mesa_net_exact(q, k, v, g, torch.full(q.shape[2:], RIDGE), beta, h_kk_init=H0,
                                            h_kv_init=U0.transpose(-1, -2))
        if alpha:
            s = beta.sqrt().unsqueeze(-1)
            o_lin, _ = simple.naive_recurrent_simple_gla(q, k * s, v * s, g, scale=1.0,
                                                         initial_state=U0.transpose(-1, -2))
            o = alpha[0].unsqueeze(-1) * o + (1 - alpha[0].unsqueeze(-1)) * o_lin
        return o, H, S.transpose(-1, -2)

    compare_backends(_ours(backend, solver, grad, num_iter), oracle, ins, tol=TOL, ref_dtype=torch.float32,
                     grad_tol=TOL_REVERSE if grad == "reverse_chebyshev" else TOL)


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=needs_triton_on_cpu)])
def test_gka_without_iterations_matches_fla_naive_simple_gla(backend):
    """``num_iter = 0`` skips the solve: gated linear attention from ``U_0`` (``H`` still accumulates, checked
    against MesaNet's ``h_kk``), with the default scale ``d ** -0.5`` (the existing comparison: forward only, no
    state, torch only)."""
    mesa = pytest.importorskip("fla.ops.mesa_net.naive")
    simple = pytest.importorskip("fla.ops.simple_gla.naive")
    q, k, v, g, _, H0, U0 = _inputs(2, 19, 2, 16)
    v = v[..., :8]        # d_v != d_k: the oracle for H does not read v's width
    U0 = U0[:, :, :8]

    def ours(q, k, v, g, H0, U0):
        o, (H, U) = gka(q, k, v, g, None, num_iter=0, chunk_size=16, initial_state=(H0, U0), backend=backend)
        return o, H, U

    def oracle(q, k, v, g, H0, U0):
        o, S = simple.naive_recurrent_simple_gla(q, k, v, g, initial_state=U0.transpose(-1, -2))
        _, H, _ = mesa.naive_mesa_net_exact(q, k, k, g, torch.ones(q.shape[2:]), torch.ones(g.shape), h_kk_init=H0)
        return o, H, S.transpose(-1, -2)

    compare_backends(ours, oracle, [q, k, v, g, H0, U0], tol=TOL, ref_dtype=torch.float32)
