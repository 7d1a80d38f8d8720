"""SKA (Spectral Koopman Attention; Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with Spectral
Koopman Operators", arXiv 2605.06997) as a whole layer against its equations written out here in fp64, position
by position with explicit sums, inverses and the power iteration:

    G = sum w_t k_t k_t^T / s^2 + lambda I,  M = sum w_t w_{t+1} k_{t+1} k_t^T / s^2,  C = sum w_t v_t k_t^T / s
    L = chol(G),  A_w = L^{-1} M L^{-T},  A = clamp(gamma_h, 1, gamma_max) A_w / max(sigma(A_w), 1)
    y_t = C L^{-T} A^p L^{-1} q_t / s,    out = W_o (eta * concat_h y_t)

with the options the other checks leave at their defaults (``gamma_max``, ``eta_init``, a per-head gain on both
sides of its clamp), the test-time ``power`` knob, and the decode state a masked prefill leaves behind."""
from __future__ import annotations

import pytest
import torch

from kernels.ska.operator import whitened_operator
from mixers import build_mixer
from tests.kernels.harness import assert_rel_close

F64 = torch.float64


def _make(d_model=16, **opts):
    m = build_mixer("ska", d_model, {"n_heads": 2, "rank": 3, **opts}).double()
    with torch.no_grad():   # W_o is zero-initialised: give it values so that the output can be wrong
        m.o_proj.weight.normal_(0.0, d_model ** -0.5)
    return m


def _sigma(A, iters):
    """The spec's estimate of the top singular value: ``iters`` steps of power iteration on A^T A from the
    all-ones vector, then ||A v||."""
    v = torch.ones(A.shape[-1], dtype=A.dtype)
    v = v / v.norm()
    for _ in range(iters):
        v = A.T @ (A @ v)
        v = v / v.norm().clamp_min(1e-30)      # A = 0 (nothing visible yet): v = 0, sigma = 0
    return (A @ v).norm()


def _explicit(m, x, mask=None):
    """The layer's output by the module docstring's equations, one position, batch row and head at a time."""
    o = m.options
    B, T, _ = x.shape
    H, r, P = o.n_heads, o.rank, m.P
    q = (x @ m.q_proj.weight.T).view(B, T, H, r)
    k = (x @ m.k_proj.weight.T).view(B, T, H, r)
    v = (x @ m.v_proj.weight.T).view(B, T, H, P)
    w = torch.ones(B, T, dtype=F64) if mask is None else mask.to(F64)
    y = torch.zeros(B, T, H, P, dtype=F64)
    for b in range(B):
        for h in range(H):
            g = m.gamma[h].clamp(1.0, o.gamma_max)
            for t in range(T):
                n = T if o.mode == "prefix" else (t // o.chunk_size) * o.chunk_size     # the visible tokens
                scale_set = range(T) if o.normalisation == "seq_max" else range(n)
                s = max([k[b, i, h].norm() for i in scale_set if w[b, i] > 0], default=torch.tensor(0.0))
                s = max(float(s), 1e-6)
                G = o.ridge * torch.eye(r, dtype=F64)
                M = torch.zeros(r, r, dtype=F64)
                C = torch.zeros(P, r, dtype=F64)
                for i in range(n):
                    G = G + w[b, i] * torch.outer(k[b, i, h], k[b, i, h]) / s ** 2
                    C = C + w[b, i] * torch.outer(v[b, i, h], k[b, i, h]) / s
                    if i + 1 < n:
                        M = M + w[b, i] * w[b, i + 1] * torch.outer(k[b, i + 1, h], k[b, i, h]) / s ** 2
                Li = torch.linalg.inv(torch.linalg.cholesky(G))
                A_w = Li @ M @ Li.T
                A = g * A_w / max(float(_sigma(A_w, o.power_iters)), 1.0)
                z = Li @ q[b, t, h] / s
                for _ in range(m.knob("power")):
                    z = A @ z
                y[b, t, h] = C @ Li.T @ z
    return (m.eta * y.flatten(-2)) @ m.o_proj.weight.T


CASES = [dict(mode="chunk_causal", chunk_size=3, normalisation="running_max"),
         dict(mode="chunk_causal", chunk_size=1, normalisation="seq_max"),
         dict(mode="chunk_causal", chunk_size=4, normalisation="seq_max"),
         dict(mode="prefix", normalisation="running_max"),
         dict(mode="prefix", normalisation="seq_max")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_output_follows_the_equations_with_every_gain(case):
    """A gain clamped from below (0.6 -> 1), one clamped from above (2.5 -> gamma_max 1.2), a learned eta other
    than its init and of the other sign, ridge 0.05, a power drawn from 1..3 and a 0/1 mask (its tokens enter no
    statistic and no scale; every position is read)."""
    power = int(torch.randint(1, 4, ()))
    m = _make(ridge=0.05, gamma_max=1.2, power=power, eta_init=0.8, **case)
    assert m.eta.item() == pytest.approx(0.8, rel=1e-7)       # created in fp32
    with torch.no_grad():
        m.gamma.copy_(torch.tensor([0.6, 2.5]))
        m.eta.fill_(-0.7)
    x = torch.randn(2, 11, 16, dtype=F64)
    mask = (torch.rand(2, 11) < 0.6).to(F64)
    mask[:, :2] = 1.0
    mask[0, 5] = 0.0
    x[0, 5] *= 4                                        # a masked-out key, the largest: it must not set the scale
    with torch.no_grad():
        assert_rel_close(m(x, mask), _explicit(m, x, mask), 1e-9, f"ska {case}")


def test_gamma_max_bounds_the_gain():
    """gamma above gamma_max reads as gamma_max: the layer with gains (3, 3) and gamma_max 1.3 is the layer with
    gains (1.3, 1.3), and differs from gamma_max 1.5 (the default) when the power filter is on."""
    m = _make(chunk_size=2, normalisation="running_max", gamma_max=1.3, ridge=0.05)
    x = torch.randn(2, 12, 16, dtype=F64)
    with torch.no_grad():
        m.gamma.fill_(3.0)
        y = m(x)
        m.gamma.fill_(1.3)
        assert torch.equal(m(x), y)
        default = _make(chunk_size=2, normalisation="running_max", ridge=0.05)
        default.load_state_dict(m.state_dict())
        default.gamma.fill_(3.0)
        assert_rel_close(default(x), _explicit(default, x), 1e-9, "gamma_max 1.5")
        assert (default(x) - y).abs().max() > 1e-6 * y.abs().max()


def test_eta_init_is_the_output_scale():
    """eta starts at eta_init (and reset_parameters puts it back); the output is linear in it."""
    m = _make(chunk_size=2, eta_init=0.3, ridge=0.05)
    assert m.eta.item() == pytest.approx(0.3, rel=1e-7)       # created in fp32
    x = torch.randn(1, 9, 16, dtype=F64)
    with torch.no_grad():
        m.eta.fill_(0.25)
        y = m(x)
        m.eta.fill_(0.75)
        assert_rel_close(m(x), 3 * y, 1e-12, "eta scales the output")
        m.reset_parameters()
    assert m.eta.item() == pytest.approx(0.3, rel=1e-7)


def test_power_is_a_test_time_knob():
    """In evaluation a power override changes forward, prefill and step alike, to the layer built with that
    power (and to the equations); in training the option holds."""
    m = _make(chunk_size=1, normalisation="running_max", power=2, ridge=0.05).eval()
    with torch.no_grad():
        m.gamma.fill_(1.4)
    x = torch.randn(2, 10, 16, dtype=F64)
    for p in (0, 3):
        other = _make(chunk_size=1, normalisation="running_max", power=p, ridge=0.05).eval()
        other.load_state_dict(m.state_dict())
        previous = m.set_test_time({"power": p})
        with torch.no_grad():
            want = other(x)
            assert_rel_close(m(x), want, 1e-12, f"forward, power {p}")
            assert_rel_close(m(x), _explicit(m, x), 1e-9, f"equations, power {p}")
            y0, state = m.prefill(x[:, :6])
            ys = [y0] + [None] * 4
            for t in range(6, 10):
                y_t, state = m.step(x[:, t], state)
                ys[t - 5] = y_t[:, None]
            assert_rel_close(torch.cat(ys, 1), want, 1e-9, f"prefill + step, power {p}")
            m.train()
            base = _make(chunk_size=1, normalisation="running_max", power=2, ridge=0.05)
            base.load_state_dict(m.state_dict())
            assert torch.equal(m(x), base(x)), "in training the option holds"
            m.eval()
        m.set_test_time(previous)


@pytest.mark.parametrize("mode", ["chunk_causal", "prefix"])
def test_decoding_after_a_prefill_whose_last_token_is_masked_out(mode):
    """A masked-out token is in no lag-one pair: after a prefill ending in one, the first decoded token pairs with
    nothing (chunk_causal), and a prefix decode reads the prefill's operator. Both against the equations with the
    decoded tokens weighted in (chunk_causal, chunk_size 1) or out (prefix)."""
    T0, T = 7, 11
    m = _make(mode=mode, chunk_size=1, normalisation="running_max", ridge=0.05)
    with torch.no_grad():
        m.gamma.fill_(1.3)
    x = torch.randn(2, T, 16, dtype=F64)
    x[:, T0 - 1] *= 4                                 # the masked-out key is the largest: it must not set the scale
    mask = torch.ones(2, T0, dtype=F64)
    mask[:, T0 - 1] = 0.0
    mask[1, 2] = 0.0
    with torch.no_grad():
        y, state = m.prefill(x[:, :T0], mask)
        ys = [y]
        for t in range(T0, T):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
    after = torch.full((2, T - T0), 1.0 if mode == "chunk_causal" else 0.0, dtype=F64)
    with torch.no_grad():
        want = _explicit(m, x, torch.cat([mask, after], 1))
    assert_rel_close(torch.cat(ys, 1)[:, T0:], want[:, T0:], 1e-9, f"{mode} decode after a masked token")


def test_the_whitened_lag_operator_has_spectral_norm_at_most_one():
    """sigma(L^{-1} M L^{-T}) <= 1 for any keys and 0/1 weights (Cauchy-Schwarz: u^T M v <= sqrt(u^T G u v^T G v)
    with G >= the Gram of either token of every pair), so max(sigma, 1) = 1 and the layer's output does not
    depend on power_iters; the gain alone sets A's spectral norm, which then stays <= gamma_max."""
    r, T = 4, 9
    k = torch.randn(T, r, dtype=F64) * torch.rand(T, 1, dtype=F64) * 3
    w = (torch.rand(T, dtype=F64) < 0.7).to(F64)
    G = torch.einsum("t,ti,tj->ij", w, k, k) + 1e-3 * torch.eye(r, dtype=F64)
    M = torch.einsum("t,ti,tj->ij", w[1:] * w[:-1], k[1:], k[:-1])
    _, A_w = whitened_operator(G, M)
    assert torch.linalg.matrix_norm(A_w, ord=2) <= 1 + 1e-12
    x = torch.randn(2, 10, 16, dtype=F64)
    one = _make(chunk_size=3, ridge=1e-3, power=3, power_iters=1)
    many = _make(chunk_size=3, ridge=1e-3, power=3, power_iters=20)
    with torch.no_grad():
        one.gamma.fill_(1.5)
        many.load_state_dict(one.state_dict())
        assert torch.equal(one(x), many(x))


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_prefix_decoding_never_differs(chunk_size):
    """decode_differs names only chunk_causal with chunks above one token: prefix mode decodes as its forward
    reads (the prefill's operator, the generated tokens outside the mask), whatever its chunk_size."""
    m = _make(mode="prefix", chunk_size=chunk_size, ridge=0.05)
    assert m.decode_differs() is None
    assert (_make(chunk_size=chunk_size).decode_differs() is None) == (chunk_size == 1)
    x = torch.randn(2, 9, 16, dtype=F64)
    with torch.no_grad():
        y, state = m.prefill(x[:, :6])
        ys = [y]
        for t in range(6, 9):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
        want = m(x, torch.cat([torch.ones(2, 6), torch.zeros(2, 3)], 1).to(F64))
    assert_rel_close(torch.cat(ys, 1), want, 1e-9, "prefix decode")
