"""SKA against Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral Koopman Operators" (arXiv
2605.06997), written here in fp64 without the code's Cholesky chain. Per (batch, head, position), over the tokens
the position may see, with keys and queries divided by the key scale s:

    G = sum w_t k_t k_t^T + lambda I,   M = sum w_t w_{t+1} k_{t+1} k_t^T,   C = sum w_t v_t k_t^T
    p = 0:  y = C G^{-1} q, the ridge regression  min_S sum w_t ||S k_t - v_t||^2 + lambda ||S||^2  (by least squares)
    p >= 1: y = C L^{-T} A^p L^{-1} q with A = g A_w, A_w = L^{-1} M L^{-T}, which by the similarity of the whitened
            and unwhitened operators is  y = g^p C G^{-1} (M G^{-1})^p q  (only linear solves; g = clamp(gamma, 1, 1.5))

The key scale is s = max ||k_t|| over the tokens with w_t > 0 (the whole sequence for ``seq_max``, the visible
tokens for ``running_max``), clamped at 1e-6. The whitened operator has spectral norm <= 1, so the normalisation
by max(sigma, 1) leaves it unchanged here; it is checked on its own with sigma > 1. Also: the readout with the
unwhitened operator M G^{-1} between the whitening factors (not similar to A_w) is not what is computed, the layer
equals these equations applied to its own projections and key lifts, the Clebsch-Gordan lift is invariant
(|z|^2) and equivariant (z^2) under per-token rotations, and the initialisations and defaults are the paper's.
"""
from __future__ import annotations

import pytest
import torch

from kernels.ska import ska
from kernels.ska.operator import cholesky_jitter, spectral_normalise
from mixers import build_mixer
from mixers.key_lift import key_lift
from mixers.ska import SKA
from tests.kernels.harness import assert_rel_close, rel_err

F64 = torch.float64


def visible(t, T, mode, chunk_size):
    return T if mode == "prefix" else (t // chunk_size) * chunk_size


def paper_readout(q, k, v, w, *, mode, chunk_size, normalisation, ridge, power, gamma, gamma_max=1.5,
                  readout="paper"):
    """``y (B, T, H, P)`` by the equations above. ``readout="lstsq"`` (p = 0 only) solves the regression by least
    squares; ``"unwhitened_inside"`` is the wrong readout C L^{-T} (g M G^{-1})^p L^{-1} q."""
    B, T, H, r = k.shape
    P = v.shape[-1]
    y = torch.zeros(B, T, H, P, dtype=F64)
    eye = torch.eye(r, dtype=F64)
    for b in range(B):
        for h in range(H):
            g = min(max(float(gamma[h]), 1.0), gamma_max)
            for t in range(T):
                m = visible(t, T, mode, chunk_size)
                scale_from = range(T) if normalisation == "seq_max" else range(m)
                norms = [float(k[b, i, h].norm()) for i in scale_from if w[b, i] > 0]
                s = max(max(norms, default=0.0), 1e-6)
                kn, vv, ww = k[b, :m, h] / s, v[b, :m, h], w[b, :m]
                G = ridge * eye + torch.einsum("i,ia,ib->ab", ww, kn, kn)
                M = torch.einsum("i,ia,ib->ab", ww[1:] * ww[:-1], kn[1:], kn[:-1])
                C = torch.einsum("i,ip,ia->pa", ww, vv, kn)
                qn = q[b, t, h] / s
                # the whitened operator's norm: singular values of G^{-1/2} M G^{-1/2} (no Cholesky)
                ev, V = torch.linalg.eigh(G)
                Gmh = V @ torch.diag(ev.rsqrt()) @ V.T
                assert torch.linalg.matrix_norm(Gmh @ M @ Gmh, ord=2) <= 1.0
                if readout == "lstsq":
                    assert power == 0
                    X = torch.cat([ww.sqrt()[:, None] * kn, ridge ** 0.5 * eye])
                    Y = torch.cat([ww.sqrt()[:, None] * vv, torch.zeros(r, P, dtype=F64)])
                    y[b, t, h] = torch.linalg.lstsq(X, Y).solution.T @ qn
                elif readout == "unwhitened_inside":
                    Li = torch.linalg.inv(torch.linalg.cholesky(G))
                    Koop = g * torch.linalg.solve(G, M.T).T               # M G^{-1}
                    y[b, t, h] = C @ Li.T @ torch.linalg.matrix_power(Koop, power) @ Li @ qn
                else:
                    z = torch.linalg.solve(G, qn)
                    for _ in range(power):
                        z = torch.linalg.solve(G, g * M @ z)                # G^{-1} (g M G^{-1}) ...
                    y[b, t, h] = C @ z
    return y


def kernel_inputs(B=2, T=11, H=2, r=3, P=2):
    q, k = torch.randn(B, T, H, r, dtype=F64), torch.randn(B, T, H, r, dtype=F64)
    k = k * (torch.rand(B, T, H, 1, dtype=F64) * 2 + 0.2)        # norms spread, so the scale matters
    v = torch.randn(B, T, H, P, dtype=F64)
    w = (torch.rand(B, T, dtype=F64) < 0.7).to(F64)
    w[:, :3] = 1.0
    gamma = torch.tensor([0.7, 1.0 + 0.6 * float(torch.rand(()))], dtype=F64)   # below the clamp, then in or above
    return q, k, v, w, gamma


MODES = [dict(mode="prefix", chunk_size=64, normalisation="seq_max"),
         dict(mode="chunk_causal", chunk_size=3, normalisation="seq_max"),
         dict(mode="chunk_causal", chunk_size=1, normalisation="running_max"),
         dict(mode="chunk_causal", chunk_size=4, normalisation="running_max")]
MODE_IDS = ["-".join(str(v) for v in c.values()) for c in MODES]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", MODES, ids=MODE_IDS)
def test_power_zero_is_the_ridge_regression(case, backend):
    q, k, v, w, gamma = kernel_inputs()
    ridge = 10 ** float(torch.empty(()).uniform_(-3, -1))
    y = ska(q, k, v, w, ridge=ridge, power=0, gamma=gamma, backend=backend, **case)
    assert_rel_close(y, paper_readout(q, k, v, w, ridge=ridge, power=0, gamma=gamma, readout="lstsq", **case),
                     1e-8, "p = 0 vs least squares")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", MODES, ids=MODE_IDS)
def test_power_filter_is_the_lag_operator_not_the_unwhitened_one(case, backend):
    """y = C L^{-T} A^p L^{-1} q equals g^p C G^{-1} (M G^{-1})^p q (statistics over strictly earlier chunks,
    the pair across each chunk boundary included; chunk 0 reads nothing), and differs from the readout that puts
    the unwhitened M G^{-1} between the whitening factors."""
    q, k, v, w, gamma = kernel_inputs()
    power = int(torch.randint(1, 4, ()))
    kw = dict(ridge=1e-2, power=power, gamma=gamma, **case)
    y = ska(q, k, v, w, backend=backend, **kw)
    assert_rel_close(y, paper_readout(q, k, v, w, **kw), 1e-8, f"p = {power}")
    assert rel_err(y, paper_readout(q, k, v, w, readout="unwhitened_inside", **kw)) > 1e-3
    if case["mode"] == "chunk_causal":
        assert y[:, :case["chunk_size"]].abs().max() == 0


def power_iteration(A, steps):
    """``steps`` steps of power iteration on A^T A from the all-ones vector; ||A v|| (one matrix)."""
    v = torch.ones(A.shape[-1], dtype=A.dtype) / A.shape[-1] ** 0.5
    for _ in range(steps):
        v = A.T @ (A @ v)
        v = v / v.norm()
    return float((A @ v).norm())


@pytest.mark.parametrize("top,second", [(4.0, 0.6), (2.0, 1.8), (0.9, 0.6)])
def test_spectral_normalisation_by_six_detached_power_steps(top, second):
    """A <- clamp(gamma, 1, 1.5) A / max(sigma, 1), sigma from 6 power-iteration steps (from the all-ones vector)
    without gradient: exact at a wide spectral gap, the six steps' estimate at a narrow one."""
    r = 4
    U, _ = torch.linalg.qr(torch.randn(r, r, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(r, r, dtype=F64))
    Aw = (U @ torch.diag(torch.tensor([top, second, 0.3, 0.1], dtype=F64)) @ V.T).requires_grad_()
    gamma = torch.tensor(1.0 + 0.8 * float(torch.rand(())), dtype=F64)
    out = spectral_normalise(Aw, gamma, 1.5, 6)
    g = min(float(gamma), 1.5)
    sigma6 = power_iteration(Aw.detach(), 6)
    assert sigma6 <= top * (1 + 1e-12)
    if top / second > 5:      # six steps find the top singular value
        assert sigma6 == pytest.approx(top, rel=1e-6)
    assert_rel_close(out, g * Aw.detach() / max(sigma6, 1.0), 1e-12, "normalised operator")
    W = torch.randn(r, r, dtype=F64)
    (dA,) = torch.autograd.grad((out * W).sum(), Aw)
    assert_rel_close(dA, g * W / max(sigma6, 1.0), 1e-12, "straight-through gradient (sigma detached)")


def paper_lift(u, lift):
    """Clebsch-Gordan lift of the pairs z_i = u_{2i} + i u_{2i+1}: |z_i|^2, then (Re z_i^2, Im z_i^2) for ``cg``."""
    z = torch.complex(u[..., 0::2], u[..., 1::2])
    inv = (z * z.conj()).real
    if lift == "cg_invariant":
        return inv
    z2 = z * z
    return torch.cat([inv, torch.stack([z2.real, z2.imag], -1).flatten(-2)], -1)


def test_key_lift_is_invariant_and_equivariant_under_per_token_rotations():
    """Rotating each pair by its own angle (a rotary phase) leaves |z|^2 unchanged and turns z^2 by twice it."""
    u = torch.randn(5, 3, 6, dtype=F64)
    theta = torch.rand(5, 3, 3, dtype=F64) * 6.3
    z = torch.complex(u[..., 0::2], u[..., 1::2]) * torch.polar(torch.ones_like(theta), theta)
    ur = torch.stack([z.real, z.imag], -1).flatten(-2)
    assert_rel_close(key_lift(ur, "cg_invariant"), key_lift(u, "cg_invariant"), 1e-13, "invariant")
    h, hr = key_lift(u, "cg")[..., 3:], key_lift(ur, "cg")[..., 3:]
    turned = torch.view_as_complex(h.reshape(5, 3, 3, 2).contiguous()) * torch.polar(torch.ones_like(theta), 2 * theta)
    assert_rel_close(hr, torch.view_as_real(turned).flatten(-2), 1e-12, "harmonic rotates by 2 theta")
    for lift in ("cg_invariant", "cg"):
        assert_rel_close(key_lift(u, lift), paper_lift(u, lift), 1e-13, lift)


LAYER_CASES = [dict(key_lift="none", mode="chunk_causal", chunk_size=3),
               dict(key_lift="cg_invariant", mode="prefix"),
               dict(key_lift="cg", mode="chunk_causal", chunk_size=2, normalisation="running_max")]


@pytest.mark.parametrize("opts", LAYER_CASES, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_layer_is_the_equations_on_its_own_projections(opts):
    """out = W_o (eta * concat_h y_t) with q, k = lift(W_q x), lift(W_k x), v = W_v x, the scale from the lifted
    (weighted-in) keys, the per-head gain clamped, the mask keeping tokens out of every statistic."""
    H, r, D, T = 2, 4, 8, 10
    power = int(torch.randint(1, 3, ()))
    m = build_mixer("ska", D, {"n_heads": H, "rank": r, "ridge": 0.02, "power": power, **opts}).double()
    with torch.no_grad():
        m.o_proj.weight.normal_(0.0, D ** -0.5)                  # zero-initialised: give the output a chance to be wrong
        m.gamma.copy_(torch.tensor([0.8, 1.3]))
        m.eta.fill_(float(torch.empty(()).uniform_(-2, 2)))
    x = torch.randn(2, T, D, dtype=F64)
    mask = (torch.rand(2, T) < 0.7).to(F64)
    mask[:, :2] = 1.0
    lift = (lambda u: u) if opts["key_lift"] == "none" else (lambda u: paper_lift(u, opts["key_lift"]))
    o = m.options
    with torch.no_grad():
        q = lift((x @ m.q_proj.weight.T).view(2, T, H, r))
        k = lift((x @ m.k_proj.weight.T).view(2, T, H, r))
        v = (x @ m.v_proj.weight.T).view(2, T, H, m.P)
        y = paper_readout(q, k, v, mask, mode=o.mode, chunk_size=o.chunk_size, normalisation=o.normalisation,
                          ridge=o.ridge, power=power, gamma=m.gamma)
        assert_rel_close(m(x, mask), (m.eta * y.flatten(-2)) @ m.o_proj.weight.T, 1e-8, "layer")


def test_initialisation_and_defaults_are_the_papers():
    """Orthogonal key/query projections, xavier values, zero-initialised output, eta = 1.5, gamma = 1 in [1, 1.5],
    ridge 1e-3, power 2, chunks of 64, 6 power-iteration steps; gamma learns from its initial value (on the clamp's
    lower edge)."""
    o = SKA.Options()
    assert (o.ridge, o.power, o.chunk_size, o.power_iters, o.gamma_max, o.eta_init) == (1e-3, 2, 64, 6, 1.5, 1.5)
    assert (o.mode, o.normalisation) == ("chunk_causal", "seq_max")
    H, r, D = 2, 8, 64
    m = build_mixer("ska", D, {"n_heads": H, "rank": r})
    for w in (m.q_proj.weight, m.k_proj.weight):
        for h in range(H):
            wh = w[h * r:(h + 1) * r].double()
            assert_rel_close(wh @ wh.T, torch.eye(r, dtype=F64), 1e-6, "orthogonal rows")
    bound = (6.0 / (D + H * m.P)) ** 0.5                       # xavier uniform
    assert m.v_proj.weight.abs().max() <= bound and m.v_proj.weight.abs().max() > 0.8 * bound
    assert m.o_proj.weight.abs().max() == 0
    assert m.eta.item() == 1.5 and torch.equal(m.gamma.data, torch.ones(H))
    with torch.no_grad():
        m.o_proj.weight.normal_()
    x = torch.randn(2, 70, D)
    (m(x) * torch.randn(2, 70, D)).sum().backward()
    assert (m.gamma.grad != 0).all(), "gamma gets no gradient at its initial value"


@pytest.mark.parametrize("deficit,jitter", [(0.0, 0.0), (5e-5, 1e-4), (5e-4, 1e-3), (5e-2, 1e-1)])
def test_cholesky_of_the_symmetrised_gram_with_jitter_fallback(deficit, jitter):
    """L = chol(sym(G)); where that fails, chol(sym(G) + 1e-4 10^j I) for the first j = 0..3 that succeeds."""
    r = 5
    Q, _ = torch.linalg.qr(torch.randn(r, r, dtype=F64))
    ev = torch.tensor([-deficit, 0.3, 0.7, 1.1, 2.0], dtype=F64) if deficit else torch.rand(r, dtype=F64) + 0.1
    G = Q @ torch.diag(ev) @ Q.T
    E = torch.randn(r, r, dtype=F64) * 1e-3
    L = cholesky_jitter(G + E - E.T)                        # an antisymmetric error: symmetrising removes it
    assert torch.equal(L, torch.tril(L))
    assert_rel_close(L @ L.T, G + jitter * torch.eye(r, dtype=F64), 1e-12, "L L^T")
