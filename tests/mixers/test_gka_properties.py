"""Gated KalmaNet ("Gated KalmaNet", arXiv 2511.21016) against an explicit token loop that forms every ``H_t``
and solves ``(H_t + lambda_t I) x_t = q_t`` with ``torch.linalg.solve``: every backend and solver, with key and
value widths that differ (so that the default ``1 / sqrt(d_k)`` scale and the ``U_t (d_v, d_k)`` layout are
checked), the alpha-connection, ``alpha = None``, ``num_iter = 0`` and an initial state.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gka import gka, gka_step
from tests.kernels.harness import assert_rel_close

A, EPS = 0.02, 1e-6


def inputs(B=2, T=19, H=2, dk=6, dv=4):
    q = F.normalize(torch.randn(B, T, H, dk, dtype=torch.float64), dim=-1)
    beta = torch.rand(B, T, H, 1, dtype=torch.float64) * 0.8 + 0.2
    k = F.normalize(torch.randn(B, T, H, dk, dtype=torch.float64), dim=-1) * beta
    v = torch.randn(B, T, H, dv, dtype=torch.float64) * beta
    g = -torch.rand(B, T, H, dtype=torch.float64) * 0.4
    alpha = torch.rand(B, T, H, dtype=torch.float64)
    return q, k, v, g, alpha


def explicit_loop(q, k, v, g, alpha, *, solve=True, initial_state=None, ridge_a=A, ridge_eps=EPS):
    """The equations of the paper, one token and one head at a time, with a dense linear solve."""
    B, T, Hh, dk = q.shape
    dv = v.shape[-1]
    o = torch.zeros(B, T, Hh, dv, dtype=q.dtype)
    Hs = torch.zeros(B, Hh, dk, dk, dtype=q.dtype) if initial_state is None else initial_state[0].clone()
    Us = torch.zeros(B, Hh, dv, dk, dtype=q.dtype) if initial_state is None else initial_state[1].clone()
    eye = torch.eye(dk, dtype=q.dtype)
    for b in range(B):
        for h in range(Hh):
            Ht, Ut = Hs[b, h], Us[b, h]
            for t in range(T):
                decay = torch.exp(g[b, t, h])
                Ht = decay * Ht + torch.outer(k[b, t, h], k[b, t, h])
                Ut = decay * Ut + torch.outer(v[b, t, h], k[b, t, h])
                qt = q[b, t, h]
                if solve:
                    lam = ridge_a * torch.linalg.matrix_norm(Ht) + ridge_eps
                    x = torch.linalg.solve(Ht + lam * eye, qt)
                    qt = x if alpha is None else qt + alpha[b, t, h] * (x - qt)
                o[b, t, h] = Ut @ qt / dk ** 0.5
            Hs[b, h], Us[b, h] = Ht, Ut
    return o, (Hs, Us)


PATHS = [
    pytest.param(dict(backend="reference", solver="exact"), 1e-10, id="reference-exact"),
    pytest.param(dict(backend="torch", solver="exact", chunk_size=8), 1e-10, id="chunked-exact"),
    pytest.param(dict(backend="torch", num_iter=90, chunk_size=8), 1e-8, id="chunked-chebyshev"),
    pytest.param(dict(backend="reference", num_iter=90), 1e-8, id="reference-chebyshev"),
    pytest.param(dict(backend="torch", solver="cg", num_iter=12, chunk_size=4), 1e-8, id="chunked-cg"),
]


@pytest.mark.parametrize("kw,tol", PATHS)
def test_every_path_solves_the_ridge_system_with_key_and_value_widths_apart(kw, tol):
    q, k, v, g, alpha = inputs()
    o, (Hs, Us) = gka(q, k, v, g, alpha, **kw)
    o_ref, (H_ref, U_ref) = explicit_loop(q, k, v, g, alpha)
    assert Us.shape == (2, 2, 4, 6)
    assert_rel_close(o, o_ref, tol, "output")
    assert_rel_close(Hs, H_ref, 1e-12, "final H")
    assert_rel_close(Us, U_ref, 1e-12, "final U")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_alpha_none_reads_the_solution_and_alpha_mixes_it_with_the_query(backend):
    q, k, v, g, alpha = inputs(B=1, T=11)
    o_none, _ = gka(q, k, v, g, None, backend=backend, solver="exact", chunk_size=4)
    assert_rel_close(o_none, explicit_loop(q, k, v, g, None)[0], 1e-10, "alpha = None")
    # alpha = 1 is the solution, alpha = 0 the query itself (gated linear attention)
    ones, zeros = torch.ones_like(alpha), torch.zeros_like(alpha)
    assert_rel_close(gka(q, k, v, g, ones, backend=backend, solver="exact", chunk_size=4)[0], o_none, 1e-12)
    assert_rel_close(gka(q, k, v, g, zeros, backend=backend, solver="exact", chunk_size=4)[0],
                     explicit_loop(q, k, v, g, None, solve=False)[0], 1e-12, "alpha = 0")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_num_iter_zero_reads_the_query_whatever_alpha(backend):
    q, k, v, g, alpha = inputs(B=1, T=13)
    o, (Hs, Us) = gka(q, k, v, g, alpha, num_iter=0, backend=backend, chunk_size=4)
    o_ref, (H_ref, U_ref) = explicit_loop(q, k, v, g, alpha, solve=False)
    assert_rel_close(o, o_ref, 1e-12, "output")
    assert_rel_close(Us, U_ref, 1e-12, "final U")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_initial_state_and_decode_step_continue_the_loop(backend):
    q, k, v, g, alpha = inputs(B=1, T=9)
    H0 = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    H0 = H0 @ H0.transpose(-1, -2) / 6  # a key covariance: symmetric positive semi-definite
    U0 = torch.randn(1, 2, 4, 6, dtype=torch.float64)
    o_ref, (H_ref, U_ref) = explicit_loop(q, k, v, g, alpha, initial_state=(H0, U0))
    o, (Hs, Us) = gka(q, k, v, g, alpha, solver="exact", backend=backend, chunk_size=4, initial_state=(H0, U0))
    assert_rel_close(o, o_ref, 1e-10, "output")
    assert_rel_close(Hs, H_ref, 1e-12, "final H")
    assert_rel_close(Us, U_ref, 1e-12, "final U")
    state, outs = (H0, U0), []
    for t in range(9):
        o_t, state = gka_step(q[:, t], k[:, t], v[:, t], g[:, t], alpha[:, t], state, solver="exact")
        outs.append(o_t)
    assert_rel_close(torch.stack(outs, 1), o_ref, 1e-10, "decode steps")
    assert_rel_close(state[1], U_ref, 1e-12, "decoded U")


def test_ridge_scales_with_the_frobenius_norm():
    """lambda_t = a ||H_t||_F + eps: a large ridge coefficient pulls the solution towards q / lambda_t."""
    q, k, v, g, alpha = inputs(B=1, T=7)
    o, _ = gka(q, k, v, g, None, ridge_a=3.0, ridge_eps=0.5, solver="exact", backend="torch", chunk_size=4)
    assert_rel_close(o, explicit_loop(q, k, v, g, None, ridge_a=3.0, ridge_eps=0.5)[0], 1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_malformed_arguments_are_refused_by_name(backend):
    q, k, v, g, alpha = inputs(B=1, T=5)
    with pytest.raises(ValueError, match="alpha"):
        gka(q, k, v, g, alpha[..., :1], backend=backend)
    with pytest.raises(ValueError, match="alpha"):
        gka(q, k, v, g, alpha[:, :4], backend=backend)
    with pytest.raises(ValueError, match="num_iter"):
        gka(q, k, v, g, alpha, num_iter=-1, backend=backend)
    with pytest.raises(ValueError, match="U0"):
        gka(q, k, v, g, alpha, backend=backend, initial_state=(torch.zeros(1, 2, 6, 6, dtype=q.dtype),
                                                                torch.zeros(1, 2, 6, 4, dtype=q.dtype)))
    with pytest.raises(ValueError, match="reverse_chebyshev"):
        gka(q, k, v, g, alpha, solver="exact", grad="reverse_chebyshev", backend=backend)

