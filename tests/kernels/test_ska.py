"""SKA kernels: the explicit per-position reference against closed forms (ridge regression via
torch.linalg.solve, eigenvalues of the unwhitened lag operator), the chunked torch path against the
reference at several chunk sizes and odd T, chunk size 1 against the token-by-token recurrence, the
Triton post-Cholesky chain against the torch chain (forward and gradients), the Triton statistics against
explicit sums and the Triton operator against the shared PyTorch operator (gradients too, the jitter and
its fallback included), the whole Triton path against the torch path, no host synchronisation on the GPU
path, and degenerate inputs."""
import contextlib

import pytest
import torch

from kernels.backend import BackendUnavailable, triton_importable
from kernels.common import pow2
from kernels.ska import (
    ska,
    ska_chain,
    ska_chain_torch,
    ska_chunked,
    ska_final_state,
    ska_recurrent,
    ska_reference,
    ska_step,
    whitened_operator,
)
from kernels.ska.operator import chain_operator, solve_operator, top_singular_value
from tests.kernels.harness import assert_rel_close, compare_backends, rel_err

F64 = torch.float64


def rand_inputs(B, T, H, r, P, dtype=F64, masked=False):
    q, k = torch.randn(B, T, H, r, dtype=dtype), torch.randn(B, T, H, r, dtype=dtype)
    v = torch.randn(B, T, H, P, dtype=dtype)
    w = None
    if masked:
        w = (torch.rand(B, T) < 0.7).to(dtype)
        w[:, 0] = 1.0
    return q, k, v, w


def ridge_explicit(q, k, v, w, ridge, visible, scale_set):
    """y_t = C G^{-1} q_t by torch.linalg.solve; ``visible(t)`` = number of tokens in t's statistics,
    ``scale_set(t)`` = number of leading tokens whose (weighted-in) key norms set the scale."""
    B, T, H, r = q.shape
    w = torch.ones(B, T, dtype=q.dtype) if w is None else w
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                m, n = visible(t), scale_set(t)
                norms = [k[b, i, h].norm() for i in range(n) if w[b, i] > 0]
                s = max(max(norms).item() if norms else 0.0, 1e-6)
                G = ridge * torch.eye(r, dtype=q.dtype)
                C = torch.zeros(v.shape[-1], r, dtype=q.dtype)
                for i in range(m):
                    kk = k[b, i, h] / s
                    G = G + w[b, i] * torch.outer(kk, kk)
                    C = C + w[b, i] * torch.outer(v[b, i, h], kk)
                out[b, t, h] = C @ torch.linalg.solve(G, q[b, t, h] / s)
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_power0_is_ridge_regression_prefix(masked):
    q, k, v, w = rand_inputs(2, 13, 2, 5, 3, masked=masked)
    T = q.shape[1]
    expect = ridge_explicit(q, k, v, w, 1e-3, lambda t: T, lambda t: T)
    for fn in (ska_reference, ska_chunked):
        y = fn(q, k, v, w, power=0, mode="prefix", ridge=1e-3)
        assert_rel_close(y, expect, 1e-8, f"{fn.__name__} prefix p=0")


@pytest.mark.parametrize("normalisation", ["seq_max", "running_max"])
def test_power0_is_ridge_regression_causal(normalisation):
    q, k, v, w = rand_inputs(1, 11, 2, 4, 3, masked=True)
    T = q.shape[1]
    scale_set = (lambda t: T) if normalisation == "seq_max" else (lambda t: t)
    expect = ridge_explicit(q, k, v, w, 1e-2, lambda t: t, scale_set)
    kw = dict(power=0, ridge=1e-2, normalisation=normalisation)
    assert_rel_close(ska_reference(q, k, v, w, mode="recurrent", **kw), expect, 1e-8, "reference recurrent")
    assert_rel_close(ska_chunked(q, k, v, w, mode="chunk_causal", chunk_size=1, **kw), expect, 1e-8, "chunked cs=1")
    assert_rel_close(ska_recurrent(q, k, v, w, **kw), expect, 1e-8, "token recurrence")
    # chunk 3: position t sees the 3*(t//3) tokens of the earlier chunks
    scale3 = (lambda t: T) if normalisation == "seq_max" else (lambda t: 3 * (t // 3))
    expect3 = ridge_explicit(q, k, v, w, 1e-2, lambda t: 3 * (t // 3), scale3)
    assert_rel_close(ska_chunked(q, k, v, w, mode="chunk_causal", chunk_size=3, **kw), expect3, 1e-8, "chunked cs=3")


def _sorted_eigs(A):
    e = torch.linalg.eigvals(A).numpy()
    order = sorted(range(len(e)), key=lambda i: (round(e[i].real, 6), e[i].imag))
    return torch.from_numpy(e[order])


def test_whitened_operator_is_similar_to_lag_operator():
    r = 7
    for _ in range(3):
        K = torch.randn(20, r, dtype=F64)
        G = K.T @ K / 20 + 1e-3 * torch.eye(r, dtype=F64)
        M = K[1:].T @ K[:-1] / 20 + 0.3 * torch.randn(r, r, dtype=F64)
        L, A_w = whitened_operator(G, M)
        assert torch.allclose(L @ L.T, G, atol=1e-12)
        Linv = torch.linalg.inv(L)
        assert_rel_close(A_w, Linv @ M @ Linv.T, 1e-10, "A_w = L^-1 M L^-T")
        ew = _sorted_eigs(A_w)
        for other in (torch.linalg.solve(G, M), M @ torch.linalg.inv(G)):
            eo = _sorted_eigs(other)
            assert (ew - eo).abs().max().item() < 1e-8 * max(1.0, eo.abs().max().item())
        # the pitfall (M G^{-1} used in whitened coordinates) is a different operator
        wrong = Linv @ (M @ torch.linalg.inv(G)) @ Linv.T
        assert (torch.linalg.eigvals(wrong).abs().max() - ew.abs().max()).abs() > 1e-6


def test_spectral_normalisation_and_gamma_clamp():
    r = 6
    U, _ = torch.linalg.qr(torch.randn(r, r, dtype=F64))
    top = torch.ones(r, dtype=F64) + 0.5 * torch.randn(r, dtype=F64)
    V, _ = torch.linalg.qr(torch.cat([top[:, None], torch.randn(r, r - 1, dtype=F64)], 1))
    S = torch.tensor([10.0, 1.0, 0.8, 0.5, 0.2, 0.1], dtype=F64) * (1 + torch.rand(1, dtype=F64))
    A = U @ torch.diag(S) @ V.T
    est = top_singular_value(A, 6)
    assert abs(est.item() - S[0].item()) < 1e-6 * S[0].item()
    # gamma is clamped to [1, gamma_max]
    q, k, v, _ = rand_inputs(1, 21, 2, 4, 3)
    base = dict(mode="chunk_causal", chunk_size=5, gamma_max=1.5)
    y_hi = ska_chunked(q, k, v, gamma=3.0, **base)
    assert_rel_close(y_hi, ska_chunked(q, k, v, gamma=1.5, **base), 1e-14, "gamma above max")
    y_one = ska_chunked(q, k, v, gamma=1.0, **base)
    assert_rel_close(ska_chunked(q, k, v, gamma=0.2, **base), y_one, 1e-14, "gamma < 1")
    assert rel_err(y_hi, y_one) > 1e-3   # gamma matters when p > 0
    g = torch.tensor([1.0, 1.5], dtype=F64)                                   # per-head gamma
    y = ska_chunked(q, k, v, gamma=g, **base)
    assert_rel_close(y[:, :, 1], y_hi[:, :, 1], 1e-14, "per-head gamma")


@pytest.mark.parametrize("normalisation", ["seq_max", "running_max"])
@pytest.mark.parametrize("T", [37, 100])
def test_chunked_matches_reference(T, normalisation):
    q, k, v, w = rand_inputs(2, T, 2, 4, 3, masked=True)
    gamma = torch.tensor([1.0, 1.3], dtype=F64)
    for cs in (1, 3, 16, 64):
        for ww in ((None, w) if T < 64 else (w,)):
            kw = dict(mode="chunk_causal", chunk_size=cs, normalisation=normalisation, gamma=gamma)
            y = ska_chunked(q, k, v, ww, **kw)
            assert_rel_close(y, ska_reference(q, k, v, ww, **kw), 1e-9, f"cs={cs} masked={ww is not None}")
    kw = dict(mode="prefix", normalisation=normalisation, gamma=gamma, power=3)
    assert_rel_close(ska_chunked(q, k, v, w, **kw), ska_reference(q, k, v, w, **kw), 1e-9, "prefix")


def test_chunked_gradients_match_reference():
    q, k, v, w = rand_inputs(1, 19, 2, 3, 2, masked=True)
    gamma = torch.tensor([1.1, 1.2], dtype=F64)
    cases = (("chunk_causal", 4, "running_max"), ("chunk_causal", 1, "seq_max"), ("prefix", 1, "seq_max"))
    for mode, cs, norm in cases:
        kw = dict(mode=mode, chunk_size=cs, normalisation=norm, ridge=1e-2)
        compare_backends(lambda q, k, v, g: ska_chunked(q, k, v, w, gamma=g, **kw),
                         lambda q, k, v, g: ska_reference(q, k, v, w, gamma=g, **kw),
                         [q, k, v, gamma], tol=1e-9)
    # the fp32 path against the fp64 reference (well-conditioned ridge)
    kw = dict(mode="chunk_causal", chunk_size=4, normalisation="running_max", ridge=0.1)
    compare_backends(lambda q, k, v: ska_chunked(q, k, v, w.float(), **kw),
                     lambda q, k, v: ska_reference(q, k, v, w, **kw),
                     [q.float(), k.float(), v.float()], tol=1e-4, grad_tol=1e-3)


@pytest.mark.parametrize("normalisation", ["seq_max", "running_max"])
def test_chunk_size_one_equals_recurrence(normalisation):
    q, k, v, w = rand_inputs(2, 29, 2, 4, 3, masked=True)
    kw = dict(normalisation=normalisation, gamma=1.2)
    par = ska_chunked(q, k, v, w, mode="chunk_causal", chunk_size=1, **kw)
    rec = ska_recurrent(q, k, v, w, **kw)
    assert_rel_close(rec, par, 1e-11, "fp64")
    assert_rel_close(ska_reference(q, k, v, w, mode="recurrent", **kw), par, 1e-11, "reference recurrent")
    # fp32, well-conditioned ridge (with ridge 1e-3 the positions whose Gram is barely above lambda I
    # amplify fp32 rounding to ~1e-5)
    qf, kf, vf, wf = (x.float() for x in (q, k, v, w))
    par32 = ska_chunked(qf, kf, vf, wf, mode="chunk_causal", chunk_size=1, ridge=0.1, **kw)
    assert_rel_close(ska_recurrent(qf, kf, vf, wf, ridge=0.1, **kw), par32, 1e-5, "fp32")


def test_final_state_then_steps_continue_the_sequence():
    q, k, v, w = rand_inputs(2, 24, 2, 4, 3, masked=True)
    T0 = 15
    full = ska_chunked(q, k, v, w, mode="chunk_causal", chunk_size=1, normalisation="running_max")
    state = ska_final_state(k[:, :T0], v[:, :T0], w[:, :T0])
    ys = []
    for t in range(T0, q.shape[1]):
        y, state = ska_step(q[:, t], k[:, t], v[:, t], state, w[:, t], normalisation="running_max")
        ys.append(y)
    assert_rel_close(torch.stack(ys, 1), full[:, T0:], 1e-11, "prefill state + steps")
    # prefix mode: a frozen operator (no update) equals the prefix forward with the rest masked out
    wz = torch.cat([w[:, :T0], torch.zeros_like(w[:, T0:])], 1)
    ref = ska_chunked(q, k, v, wz, mode="prefix")
    state = ska_final_state(k[:, :T0], v[:, :T0], w[:, :T0])
    ys = [ska_step(q[:, t], k[:, t], v[:, t], state, update=False)[0] for t in range(T0, q.shape[1])]
    assert_rel_close(torch.stack(ys, 1), ref[:, T0:], 1e-11, "prefix decode")


def test_mask_excludes_tokens():
    q, k, v, w = rand_inputs(1, 17, 1, 4, 3, masked=True)
    w[0, 5] = 0.0
    k2, v2 = k.clone(), v.clone()
    k2[0, 5] = 50.0 * torch.randn(4, dtype=F64)
    v2[0, 5] = torch.randn(3, dtype=F64)
    for mode in ("prefix", "chunk_causal"):
        a = ska_chunked(q, k, v, w, mode=mode, chunk_size=4)
        b = ska_chunked(q, k2, v2, w, mode=mode, chunk_size=4)
        assert_rel_close(b, a, 1e-12, f"{mode}: masked-out token leaked")
        assert rel_err(ska_chunked(q, k2, v2, None, mode=mode, chunk_size=4), a) > 1e-3


def test_chunk_causal_is_causal():
    q, k, v, w = rand_inputs(1, 30, 2, 4, 3)
    for cs, norm in ((7, "running_max"), (1, "running_max")):
        a = ska_chunked(q, k, v, mode="chunk_causal", chunk_size=cs, normalisation=norm)
        k2, v2, q2 = k.clone(), v.clone(), q.clone()
        t0 = 17
        k2[:, t0:] += torch.randn_like(k2[:, t0:]) * 3
        v2[:, t0:] += torch.randn_like(v2[:, t0:])
        q2[:, t0:] += torch.randn_like(q2[:, t0:])
        b = ska_chunked(q2, k2, v2, mode="chunk_causal", chunk_size=cs, normalisation=norm)
        assert torch.equal(a[:, :t0], b[:, :t0])
        assert a[:, : min(cs, 30)].abs().max() == 0          # chunk 0 reads nothing


# --- Triton chain --------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("B,T,H,r,P,cs,p", [(1, 37, 2, 16, 16, 16, 2), (2, 20, 1, 5, 7, 3, 1),
                                             (1, 33, 1, 16, 16, 64, 0), (1, 64, 2, 16, 16, 64, 3)])
def test_triton_chain_matches_torch(B, T, H, r, P, cs, p):
    N = -(-T // cs)
    Linv = torch.randn(B, N, H, r, r).tril()
    A = torch.randn(B, N, H, r, r) * 0.3
    C = torch.randn(B, N, H, P, r)
    q = torch.randn(B, T, H, r)
    # p = 0 reads no A: both sides add 0 * A so that A gets a (zero) gradient to compare
    compare_backends(lambda L, A_, C_, q_: ska_chain(L, A_, C_, q_, p, cs, backend="triton") + 0 * A_.sum(),
                     lambda L, A_, C_, q_: ska_chain_torch(L, A_, C_, q_, p, cs) + 0 * A_.sum(),
                     [Linv, A, C, q], tol=1e-5)


@needs_triton
def test_triton_chain_with_the_smallest_tiles(monkeypatch):
    """Tiles of 16 tokens and 16 value dims: a chunk spans two token tiles and the value dim two value
    tiles (the backward's dQ sums over value tiles, its dW over token tiles); nothing may depend on them."""
    import kernels.ska.triton as kt
    assert kt._tiles(128, 64, 256) == (64, 64, 64)             # no tile above 64 x 64
    monkeypatch.setattr(kt, "_tiles", lambda chunk_size, R, P: (16, pow2(R, 16), 16))
    B, T, H, r, P, cs, p = 1, 50, 1, 16, 20, 32, 2
    N = -(-T // cs)
    mats = [torch.randn(B, N, H, r, r).tril(), torch.randn(B, N, H, r, r) * 0.3, torch.randn(B, N, H, P, r)]
    compare_backends(lambda *a: ska_chain(*a, p, cs, backend="triton"),
                     lambda L, A_, C_, q_: ska_chain_torch(L, A_, C_, q_, p, cs),
                     [*mats, torch.randn(B, T, H, r)], tol=1e-5)


E2E_CASES = [("chunk_causal", 4, "running_max", True, 2, 21), ("chunk_causal", 1, "seq_max", False, 3, 9),
             ("prefix", 1, "seq_max", True, 0, 21), ("chunk_causal", 7, "seq_max", True, 1, 21),
             ("prefix", 1, "running_max", False, 2, 21)]


@needs_triton
@pytest.mark.parametrize("mode,cs,norm,masked,p,T", E2E_CASES, ids=lambda x: str(x))
def test_triton_backend_end_to_end(mode, cs, norm, masked, p, T):
    """The whole Triton path (statistics, operator, readout) against the torch path in fp64, gradients of
    q, k, v and gamma included (gamma = 1 sits on the clamp's lower bound, which passes the gradient).
    fp32 against fp64 at ridge 0.1: measured ~1e-6, tolerances 1e-4 (output) and 1e-3 (gradients)."""
    q, k, v, w = rand_inputs(1, T, 2, 4, 5, dtype=torch.float32, masked=masked)
    gamma = torch.tensor([1.0, 1.3])
    kw = dict(mode=mode, chunk_size=cs, ridge=0.1, normalisation=norm, power=p)
    # power 0 reads no A, so gamma gets no gradient on either path: both add 0 * gamma to compare a zero
    compare_backends(lambda q, k, v, g: ska(q, k, v, w, gamma=g, backend="triton", **kw) + 0 * g.sum(),
                     lambda q, k, v, g: ska(q, k, v, None if w is None else w.double(), gamma=g, backend="torch", **kw)
                     + 0 * g.sum(),
                     [q, k, v, gamma], tol=1e-4, grad_tol=1e-3)
    with pytest.raises(BackendUnavailable):
        ska(q, k, v, mode="recurrent", backend="triton")


def _explicit_statistics(k, v, w, chunk_size, prefix):
    """Flat ``[G, M, C]`` of every operator from its visible tokens (the spec's sets: chunks before, or all)."""
    from kernels.ska.triton import flat_statistics
    B, T, H, r = k.shape
    w = torch.ones(B, T, dtype=k.dtype) if w is None else w
    wk = w[:, :, None, None] * k
    out = []
    for n in range(1 if prefix else -(-T // chunk_size)):
        m = T if prefix else n * chunk_size
        G = torch.einsum("bthi,bthj->bhij", wk[:, :m], k[:, :m])
        M = torch.einsum("bthi,bthj->bhij", wk[:, 1:m], wk[:, :max(m - 1, 0)])   # pairs with both tokens seen
        C = torch.einsum("bt,bthp,bthj->bhpj", w[:, :m], v[:, :m], k[:, :m])
        out.append(flat_statistics(G, M, C))
    return torch.stack(out, 1)


@needs_triton
@pytest.mark.parametrize("mode,cs,masked,T", [("chunk_causal", 32, True, 70), ("prefix", 64, False, 70),
                                              ("chunk_causal", 1, True, 20), ("chunk_causal", 16, False, 37)])
def test_triton_statistics_match_explicit_sums(monkeypatch, mode, cs, masked, T):
    """The statistics kernels against explicit sums over each operator's visible tokens, forward and backward,
    with tiles of 16 tokens and 16 value dims (a chunk of 32 spans two token tiles, P = 20 two value tiles).
    fp32 sums of at most T products: measured <= 1e-7 relative, tolerance 1e-6."""
    import kernels.ska.triton as kt
    monkeypatch.setattr(kt, "_stats_tiles", lambda chunk_size, R, P: (16, pow2(R, 16), 16, 4))
    ska_statistics_triton = kt.ska_statistics_triton
    _, k, v, w = rand_inputs(1, T, 2, 5, 20, dtype=torch.float32, masked=masked)
    compare_backends(lambda k, v: ska_statistics_triton(k, v, w, chunk_size=cs, mode=mode),
                     lambda k, v: _explicit_statistics(k, v, None if w is None else w.double(), cs, mode == "prefix"),
                     [k, v], tol=1e-6)


def _random_statistics(B, N, H, r, P, negative=()):
    """Raw statistics from 3 r random keys per matrix (``G`` a Gram matrix, ``M`` a lag-one sum) and a key
    scale near the largest key; ``negative``: (head, eigenvalue) pairs that make ``G / s^2 + ridge I``
    indefinite with that smallest eigenvalue (s = 1 there)."""
    from kernels.ska.triton import flat_statistics
    K = torch.randn(B, N, H, 3 * r, r, dtype=F64)
    G = K.mT @ K
    M = K[..., 1:, :].mT @ K[..., :-1, :]
    C = torch.randn(B, N, H, P, r, dtype=F64)
    s = K.norm(dim=-1).amax(-1) * (0.5 + torch.rand(B, N, H, dtype=F64))
    for h, low in negative:
        Q, _ = torch.linalg.qr(torch.randn(r, r, dtype=F64))
        eig = torch.cat([torch.tensor([low], dtype=F64), 1 + torch.rand(r - 1, dtype=F64)])
        G[:, :, h] = Q @ torch.diag(eig - 1e-3) @ Q.T      # ridge 1e-3 added back by the operator
        s[:, :, h] = 1.0
    return flat_statistics(G, M, C), s


def _operator_reference(S, s, gamma, r, P, power, **kw):
    """``W = (C / s) L^{-T} A^p L^{-1} / s`` by the shared PyTorch operator (what the torch path computes)."""
    from kernels.ska.triton import split_statistics
    G, M, C = split_statistics(S, r, P)
    Linv, A, Cn = solve_operator(G, M, C, s, gamma=gamma, **kw)
    return chain_operator(Linv, A, Cn / s[..., None, None], power)


@needs_triton
@pytest.mark.parametrize("r,P,p", [(5, 20, 2), (16, 7, 0), (6, 3, 3)])
def test_triton_operator_matches_solve_operator(monkeypatch, r, P, p):
    """The operator kernels against solve_operator + chain_operator in fp64, gradients of the statistics, the
    key scale and gamma (1: the clamp's bound, passes; 1.3: inside; 2: above gamma_max, no gradient); value
    tiles of 16 (P = 20 spans two). Keys with a ridge of 0.05 keep G's condition number below ~1e3, so fp32
    errors stay below ~1e3 x 6e-8; measured <= 4e-6, tolerance 1e-4."""
    import kernels.ska.triton as kt
    monkeypatch.setattr(kt, "_operator_tiles", lambda R, P: (pow2(R, 16), 16, 4))
    ska_operator_triton = kt.ska_operator_triton
    S, s = _random_statistics(1, 2, 3, r, P)
    gamma = torch.tensor([1.0, 1.3, 2.0], dtype=F64)
    kw = dict(ridge=0.05, gamma_max=1.5, power_iters=6)
    # power 0 reads no A, so gamma gets no gradient on either side: both add 0 * gamma to compare a zero
    compare_backends(lambda S, s, g: ska_operator_triton(S, s, g, rank=r, value_dim=P, power=p, **kw) + 0 * g.sum(),
                     lambda S, s, g: _operator_reference(S, s, g, r, P, p, **kw) + 0 * g.sum(),
                     [S.float(), s.float(), gamma.float()], tol=1e-4)


@needs_triton
def test_triton_operator_jitter_and_fallback():
    """Indefinite Grams take the jitter the torch path takes (head 1: smallest eigenvalue -0.05, which only the
    largest jitter 0.1 fixes) or the square roots of the clamped diagonal (head 2: -1, nothing helps), and their
    gradients follow the same branch (the fallback's only through the diagonal). Head 0 needs nothing. A wrong
    jitter would move the smallest eigenvalue of the factored matrix by 2x or more; fp32 against fp64 on
    these (condition number ~50): measured ~1e-6, tolerance 1e-4."""
    from kernels.ska.triton import ska_operator_triton
    r, P, p = 6, 5, 2
    S, s = _random_statistics(1, 1, 3, r, P, negative=((1, -0.05), (2, -1.0)))
    kw = dict(ridge=1e-3, gamma_max=1.5, power_iters=6)
    compare_backends(lambda S, s: ska_operator_triton(S, s, 1.2, rank=r, value_dim=P, power=p, **kw),
                     lambda S, s: _operator_reference(S, s, 1.2, r, P, p, **kw),
                     [S.float(), s.float()], tol=1e-4)


@needs_triton
def test_triton_above_the_kernels_rank_runs_the_torch_operator(monkeypatch):
    """Above MAX_RANK the statistics and the operator run in PyTorch (same function), the readout in Triton."""
    import kernels.ska.triton as kt
    from kernels.launch import counting
    monkeypatch.setattr(kt, "MAX_RANK", 4)
    q, k, v, w = rand_inputs(1, 12, 1, 5, 3, dtype=torch.float32, masked=True)
    kw = dict(mode="chunk_causal", chunk_size=4, ridge=0.1)
    with counting() as kernels:
        compare_backends(lambda q, k, v: ska(q, k, v, w, backend="triton", **kw),
                         lambda q, k, v: ska(q, k, v, w.double(), backend="torch", **kw), [q, k, v], tol=1e-4,
                         grad_tol=1e-3)
    assert set(kernels) == {"ska._ska_apply_kernel", "ska._ska_apply_bwd_kernel"}


@needs_triton
def test_gpu_path_reads_nothing_back_to_the_host():
    """No ``.item()``, ``bool(tensor)`` or ``.tolist()`` on the GPU path (each waits for the device): the whole
    Triton op forward and backward, and the torch backend's jittered Cholesky on the GPU plan, which must
    also give the CPU plan's factor and gradient bit for bit (here with matrices that need each branch)."""
    from kernels.device import gpu_path_on_cpu
    from kernels.ska.operator import cholesky_jitter
    from tests.mixers.launches import count_launches
    q, k, v, w = rand_inputs(1, 9, 1, 4, 3, dtype=torch.float32, masked=True)
    q.requires_grad_(True)
    with gpu_path_on_cpu():
        _, ops = count_launches(lambda: ska(q, k, v, w, chunk_size=4, ridge=0.1).sum().backward())
    assert "triton:ska._ska_operator_kernel" in ops and "aten::_local_scalar_dense" not in ops
    G = torch.eye(4).repeat(4, 1, 1) + 0.01 * torch.randn(4, 4, 4).tril(-1)
    G[1, 2, 2], G[2, 0, 0], G[3] = -5e-5, -0.05, -torch.eye(4)        # jitter 1e-4, jitter 0.1, nothing helps
    up = torch.randn(4, 4, 4)
    factors = []
    for gpu in (False, True):
        Gg = G.clone().requires_grad_(True)

        def factor(Gg=Gg):
            L = cholesky_jitter(Gg)
            L.backward(up)
            factors.append((L.detach(), Gg.grad))

        with gpu_path_on_cpu() if gpu else contextlib.nullcontext():
            ops = count_launches(factor)[1]
        assert ("aten::_local_scalar_dense" in ops) != gpu                # the CPU plan may branch on the host
    assert torch.equal(factors[0][0], factors[1][0]) and torch.equal(factors[0][1], factors[1][1])


# --- degenerate inputs ---------------------------------------------------------------------------

def _finite_fwd_bwd(q, k, v, w=None, **kw):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    y = ska_chunked(q, k, v, w, **kw)
    assert torch.isfinite(y).all(), f"non-finite output {kw}"
    (y * torch.randn_like(y)).sum().backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(x.grad).all(), f"non-finite grad of {name} {kw}"
    return y


CONFIGS = [dict(mode="prefix"), dict(mode="chunk_causal", chunk_size=4),
           dict(mode="chunk_causal", chunk_size=1, normalisation="running_max"),
           dict(mode="chunk_causal", chunk_size=3, normalisation="running_max", power=0)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(x) for x in c.values()))
def test_degenerate_inputs_are_finite(cfg):
    B, T, H, r, P = 2, 23, 2, 4, 3
    q, k, v, _ = rand_inputs(B, T, H, r, P, dtype=torch.float32)
    y = _finite_fwd_bwd(q, torch.zeros_like(k), v, **cfg)                     # all-zero keys
    assert y.abs().max() == 0
    rep = k[:, :1].expand(B, T, H, r).contiguous()                            # identical keys, rank-1 G
    y = _finite_fwd_bwd(q, rep, v, **cfg)
    expect = ska_reference(q.double(), rep.double(), v.double(), **cfg)
    assert rel_err(y, expect) < 1e-2     # fp32 vs fp64 on a rank-1 Gram: ~1e-3 observed
    _finite_fwd_bwd(q[:, :1], k[:, :1], v[:, :1], **cfg)                     # a single token
    _finite_fwd_bwd(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), **cfg)
    _finite_fwd_bwd(q, k, v, torch.zeros(B, T), **cfg)                        # everything masked out


def test_long_sequence_is_finite():
    q, k, v, _ = rand_inputs(1, 4096, 1, 4, 4, dtype=torch.float32)
    for cfg in (dict(mode="chunk_causal", chunk_size=64, normalisation="running_max"), dict(mode="prefix")):
        _finite_fwd_bwd(q, k, v, **cfg)
    rep = k[:, :1].expand_as(k).contiguous()
    _finite_fwd_bwd(q, rep, v, mode="chunk_causal", chunk_size=64)


def test_cholesky_jitter_fallback():
    from kernels.ska.operator import cholesky_jitter
    G = torch.eye(4).repeat(3, 1, 1)
    G[1, 2, 2] = -5e-5          # fixed by jitter 1e-4
    G[2, 0, 0] = -0.05          # fixed by jitter 1e-1
    G.requires_grad_(True)
    L = cholesky_jitter(G)
    expect = torch.linalg.cholesky(G.detach() + torch.tensor([0.0, 1e-4, 1e-1])[:, None, None] * torch.eye(4))
    assert torch.allclose(L, expect)
    (L * torch.randn_like(L)).sum().backward()
    assert torch.isfinite(G.grad).all()
    bad = -torch.eye(3, dtype=F64)[None]            # nothing helps: finite diagonal fallback
    assert torch.isfinite(cholesky_jitter(bad)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("r,P,cs", [(32, 64, 64), (16, 48, 1), (64, 128, 128)])
def test_triton_on_cuda(r, P, cs):
    B, T, H = 2, 1000, 4
    q, k, v = (torch.randn(B, T, H, d, device="cuda") for d in (r, r, P))
    w = (torch.rand(B, T, device="cuda") < 0.8).float()
    kw = dict(mode="chunk_causal", chunk_size=cs, normalisation="running_max", ridge=0.05, gamma=1.3)
    compare_backends(lambda q, k, v: ska(q, k, v, w, backend="triton", **kw),
                     lambda q, k, v: ska(q, k, v, w.double(), backend="torch", **kw),
                     [q, k, v], tol=1e-3, grad_tol=1e-2)
    # the chain alone, real sizes, p = 3
    N = -(-T // cs)
    Linv = torch.randn(B, N, H, r, r, device="cuda").tril() / r ** 0.5
    A = torch.randn(B, N, H, r, r, device="cuda") / r ** 0.5
    C = torch.randn(B, N, H, P, r, device="cuda")
    compare_backends(lambda *a: ska_chain(*a, 3, cs, backend="triton"),
                     lambda *a: ska_chain_torch(*a, 3, cs), [Linv, A, C, q], tol=1e-5)
    yb = ska(q.bfloat16(), k.bfloat16(), v.bfloat16(), w, backend="triton", **kw)
    assert yb.dtype == torch.bfloat16 and torch.isfinite(yb).all()
    assert rel_err(yb.float(), ska(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), w,
                                   backend="torch", **kw)) < 2e-2
