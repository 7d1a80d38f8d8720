"""Tests of the ``delta`` kernel family (gated DeltaProduct / DeltaNet).

- chunked (torch) and Triton (interpreter on CPU) against the token-by-token reference in fp64,
  forward outputs, final state and gradients of every input, n_h in {1, 2, 3}, with and without the
  forget gate, odd T (not a multiple of the chunk), non-power-of-two head dims;
- all backends against flash-linear-attention's ``naive_recurrent_gated_delta_product`` and
  ``naive_recurrent_gated_delta_rule`` (an oracle written by someone else);
- the Householder factor's spectrum (eigenvalues 1 and 1 - beta, negative for beta > 1) and that the
  kernel applies exactly the transition ``prod_j (I - beta_j k_j k_j^T)``;
- the one-token step function, chunk-size invariance, the 5-d input layout.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import triton_importable, triton_interpreting
from kernels.delta import delta_product, delta_product_step, delta_rule, householder_transition
from kernels.delta.reference import delta_product_reference
from tests.kernels.harness import assert_rel_close, compare_backends, rel_err


def make_inputs(B, T, H, K, V, n, gate, dtype=torch.float32, h0=True):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T * n, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T * n, H, V, dtype=dtype)
    beta = 2 * torch.rand(B, T * n, H, dtype=dtype)           # (0, 2): negative eigenvalues allowed
    g = F.logsigmoid(torch.randn(B, T, H, dtype=dtype) + 2) if gate else None
    s0 = torch.randn(B, H, K, V, dtype=dtype) if h0 else None
    return q, k, v, beta, g, s0


def ref_fn(n):
    return lambda q, k, v, b, g, s0: delta_product_reference(q, k, v, b, g, n, initial_state=s0)


needs_triton = pytest.mark.skipif(
    not triton_importable() or not (torch.cuda.is_available() or triton_interpreting()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_chunked_matches_reference(n, gate):
    inputs = make_inputs(2, 37, 2, 12, 10, n, gate)
    fn = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0,
                                                chunk_size=16, backend="torch")
    compare_backends(fn, ref_fn(n), inputs, tol=2e-5, grad_tol=5e-5)


def test_chunked_fp64_is_exact():
    n = 2
    inputs = make_inputs(1, 29, 2, 8, 8, n, True, dtype=torch.float64)
    fn = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0,
                                                chunk_size=8, backend="torch")
    compare_backends(fn, ref_fn(n), inputs, tol=1e-12, grad_tol=1e-11)


@needs_triton
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_triton_matches_reference(n, gate):
    inputs = make_inputs(1, 19, 2, 16, 16, n, gate)
    fn = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0,
                                                chunk_size=16, backend="triton")
    compare_backends(fn, ref_fn(n), inputs, tol=2e-5, grad_tol=5e-5)


@needs_triton
def test_triton_padded_dims_and_v_blocks(monkeypatch):
    """K, V not powers of two (padded inside) and several V blocks per program; no initial state."""
    import kernels.delta.triton as kt

    monkeypatch.setattr(kt, "BLOCK_V_MAX", 16)
    n = 2
    inputs = make_inputs(2, 11, 1, 12, 20, n, True, h0=False)
    fn = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0,
                                                chunk_size=16, backend="triton")
    compare_backends(fn, ref_fn(n), inputs, tol=2e-5, grad_tol=5e-5)


@needs_triton
@pytest.mark.parametrize("B", [1, 2])
def test_triton_reads_column_blocks_of_one_projection_in_place(B, monkeypatch):
    """q, k, v as column blocks of one wide tensor (a layer's fused projections, token stride wider than a token's
    heads): read at their strides, with no copy; the outputs and every gradient equal those of contiguous
    copies, and both match the reference."""
    import kernels.delta.triton as kt
    T, H, D = int(torch.randint(5, 40, ())), 2, 16
    wide = torch.randn(B, T, 3 * H * D + 5)
    blocks = [slice(2 + i * H * D, 2 + (i + 1) * H * D) for i in range(3)]
    wide[..., blocks[1]] = F.normalize(wide[..., blocks[1]].unflatten(-1, (H, D)), dim=-1).flatten(-2)
    q, k, v = (wide[..., b].unflatten(-1, (H, D)) for b in blocks)
    beta, g = torch.rand(B, T, H) * 2, F.logsigmoid(torch.randn(B, T, H) + 2)
    seen, apply = [], kt.ChunkGatedDeltaRuleTriton.apply

    def spy(*args):
        seen.append([a.stride() for a in args[:3]])
        return apply(*args)
    monkeypatch.setattr(kt.ChunkGatedDeltaRuleTriton, "apply", spy)
    runs = []
    for qi, ki, vi in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        leaves = [x.detach().requires_grad_() for x in (qi, ki, vi, beta, g)]
        o, S = kt.chunk_gated_delta_rule_triton(*leaves, chunk_size=16)
        do, dS = torch.randn_like(o, generator=torch.Generator().manual_seed(1)), torch.ones_like(S)
        runs.append([o, S, *torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)])
    assert seen[0] == [q.stride(), k.stride(), v.stride()] != seen[1]   # the blocks reached the kernels as they are
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    o_ref, S_ref = delta_product_reference(q, k, v, beta, g, 1, scale=1.0)   # the kernels take q pre-scaled
    assert rel_err(runs[0][0], o_ref) < 2e-5 and rel_err(runs[0][1], S_ref) < 2e-5


@needs_triton
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_triton_reads_substeps_of_one_projection_in_place(chunk_size, monkeypatch):
    """The delta product's keys and values as ``(B, T, n_h, H, D)`` column blocks of one wide tensor (the n_h
    sub-steps of a token side by side in its row): the kernels read them, and write their gradients, at the token
    and sub-step strides, with no flattening copy; outputs and every gradient equal those of the flattened
    contiguous inputs, and match the reference. Chunk 16 interleaves the queries (8 a chunk), 32 reads them in
    place (16 a chunk)."""
    import kernels.delta.triton as kt
    B, T, H, D, n = 2, int(torch.randint(9, 40, ())), 2, 16, 2
    wide = torch.randn(B, T, (1 + 2 * n) * H * D + 3)
    q = wide[..., 1:1 + H * D].unflatten(-1, (H, D))
    k = F.normalize(wide[..., 1 + H * D:1 + (1 + n) * H * D].unflatten(-1, (n, H, D)), dim=-1)
    v = wide[..., 1 + (1 + n) * H * D:1 + (1 + 2 * n) * H * D].unflatten(-1, (n, H, D))
    beta, g = torch.rand(B, T * n, H) * 2, F.logsigmoid(torch.randn(B, T, H) + 2)
    seen, apply = [], kt.ChunkGatedDeltaRuleTriton.apply

    def spy(*args):
        seen.append([(a.shape, a.stride()) for a in args[1:3]])
        return apply(*args)
    monkeypatch.setattr(kt.ChunkGatedDeltaRuleTriton, "apply", spy)
    do, dS = torch.randn(B, T, H, D), torch.randn(B, H, D, D)
    runs = []
    for ki, vi in ((k, v), (k.flatten(1, 2), v.flatten(1, 2))):
        leaves = [x.detach().requires_grad_() for x in (q, ki, vi, beta, g)]
        o, S = kt.delta_product_triton(*leaves, num_householder=n, chunk_size=chunk_size)
        runs.append([o, S, *(d.reshape(x.shape[0], -1, *x.shape[-2:]) if d.dim() == 5 else d
                             for d, x in zip(torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves), leaves))])
    assert seen[0] == [(k.shape, k.stride()), (v.shape, v.stride())]     # as they are, 5-d and strided
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    o_ref, S_ref = delta_product_reference(q, k, v, beta, g, n)
    assert rel_err(runs[0][0], o_ref) < 2e-5 and rel_err(runs[0][1], S_ref) < 2e-5


@needs_triton
@pytest.mark.parametrize("use", ["output", "state"])
def test_triton_gradients_of_one_output_alone(use):
    """Training uses the output alone, a state-passing caller the final state alone: the unused one's gradient is
    not zero-filled (no launch), and the gradients still match the reference's."""
    n = 1
    q, k, v, beta, g, s0 = make_inputs(1, 21, 2, 16, 16, n, True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, beta, g, s0)]
    exact = [x.detach().double().requires_grad_() for x in (q, k, v, beta, g, s0)]
    o, S = delta_product(*leaves[:4], g=leaves[4], num_householder=n, initial_state=leaves[5], chunk_size=16,
                         backend="triton")
    o_ref, S_ref = ref_fn(n)(*exact)
    picked, picked_ref = (o, o_ref) if use == "output" else (S, S_ref)
    w = torch.randn_like(picked_ref)
    for got, want in zip(torch.autograd.grad((picked * w.float()).sum(), leaves),
                         torch.autograd.grad((picked_ref * w).sum(), exact, allow_unused=True)):
        assert rel_err(got, want) < 5e-5 if want is not None else not got.any()   # q does not reach the state


def _backends():
    out = ["reference", "torch"]
    if triton_importable() and (torch.cuda.is_available() or triton_interpreting()):
        out.append("triton")
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_against_fla_naive_delta_product(n, gate):
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    q, k, v, beta, g, s0 = make_inputs(2, 23, 2, 16, 16, n, gate)
    scale = 0.3
    o_fla, s_fla = naive.naive_recurrent_gated_delta_product(
        q, k, v, g, beta, scale, initial_state=s0.clone(), output_final_state=True, num_householder=n)
    for backend in _backends():
        o, s = delta_product(q, k, v, beta, g=g, num_householder=n, scale=scale, initial_state=s0, chunk_size=16,
                             backend=backend)
        assert_rel_close(o, o_fla, 2e-5, f"{backend} output vs fla")
        assert_rel_close(s, s_fla, 2e-5, f"{backend} state vs fla")


@pytest.mark.parametrize("gate", [False, True])
def test_against_fla_naive_gated_delta_rule(gate):
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, beta, g, s0 = make_inputs(2, 29, 2, 16, 8, 1, gate)
    g_fla = g if gate else torch.zeros(2, 29, 2)
    o_fla, s_fla = naive.naive_recurrent_gated_delta_rule(
        q, k, v, beta, g_fla, initial_state=s0.clone(), output_final_state=True)
    for backend in _backends():
        o, s = delta_rule(q, k, v, beta, g=g, initial_state=s0, chunk_size=16, backend=backend)
        assert_rel_close(o, o_fla, 2e-5, f"{backend} output vs fla")
        assert_rel_close(s, s_fla, 2e-5, f"{backend} state vs fla")


def test_householder_spectrum():
    K = 8
    k = F.normalize(torch.randn(64, 1, K, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(64, 1, dtype=torch.float64)
    A = householder_transition(k, beta)
    ev = torch.linalg.eigvalsh(A)                                   # symmetric: real, ascending
    assert (ev >= -1 - 1e-12).all() and (ev <= 1 + 1e-12).all()
    expected = torch.cat([(1 - beta), torch.ones(64, K - 1, dtype=torch.float64)], dim=1).sort(dim=1).values
    torch.testing.assert_close(ev, expected, rtol=0, atol=1e-12)
    assert ((ev[:, 0] < 0) == (beta[:, 0] > 1)).all()               # negative eigenvalue iff beta > 1
    # products of n_h factors: spectral norm <= 1 (Prop. 1 of DeltaProduct), eigenvalues in the unit disk
    kn = F.normalize(torch.randn(64, 3, K, dtype=torch.float64), dim=-1)
    P = householder_transition(kn, 2 * torch.rand(64, 3, dtype=torch.float64))
    assert (torch.linalg.matrix_norm(P, ord=2) <= 1 + 1e-12).all()
    assert (torch.linalg.eigvals(P).abs() <= 1 + 1e-12).all()


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_kernel_applies_householder_transition(backend):
    """With v = 0 and no gate one token maps S0 to prod_j (I - beta_j k_j k_j^T) S0 exactly."""
    n, K, V = 3, 8, 5
    q, k, v, beta, _, s0 = make_inputs(1, 1, 1, K, V, n, False, dtype=torch.float64)
    _, s = delta_product(q, k, torch.zeros_like(v), beta, num_householder=n, initial_state=s0, backend=backend)
    A = householder_transition(k[0, :, 0], beta[0, :, 0])          # (K, K)
    torch.testing.assert_close(s[0, 0], A @ s0[0, 0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 3])
def test_step_matches_reference(n):
    q, k, v, beta, g, s0 = make_inputs(2, 9, 2, 8, 6, n, True)
    o_ref, s_ref = delta_product_reference(q, k, v, beta, g, n, initial_state=s0)
    kk, vv, bb = (x.view(2, 9, n, *x.shape[2:]) for x in (k, v, beta))
    s, outs = s0, []
    for t in range(9):
        o, s = delta_product_step(q[:, t], kk[:, t], vv[:, t], bb[:, t], g[:, t], s)
        outs.append(o)
    assert_rel_close(torch.stack(outs, 1), o_ref, 1e-6, "step outputs")
    assert_rel_close(s, s_ref, 1e-6, "step state")


def test_chunk_size_invariance_and_5d_layout():
    n = 2
    q, k, v, beta, g, s0 = make_inputs(1, 21, 2, 8, 8, n, True, dtype=torch.float64)
    o8, s8 = delta_product(q, k, v, beta, g=g, num_householder=n, initial_state=s0, chunk_size=8, backend="torch")
    o64, s64 = delta_product(q, k, v, beta, g=g, num_householder=n, initial_state=s0, chunk_size=64, backend="torch")
    assert rel_err(o8, o64) < 1e-12 and rel_err(s8, s64) < 1e-12
    k5, v5, b5 = k.view(1, 21, n, 2, 8), v.view(1, 21, n, 2, 8), beta.view(1, 21, n, 2)
    o5, _ = delta_product(q, k5, v5, b5, g=g, num_householder=n, initial_state=s0, chunk_size=8, backend="torch")
    assert rel_err(o5, o8) < 1e-14
    with pytest.raises(ValueError, match="T\\*n_h"):
        delta_product(q, k[:, :-1], v, beta, g=g, num_householder=n, backend="torch")


def test_beta_zero_is_pure_decay():
    q, k, v, beta, g, s0 = make_inputs(1, 6, 1, 8, 4, 2, True, dtype=torch.float64)
    _, s = delta_product(q, k, v, torch.zeros_like(beta), g=g, num_householder=2, initial_state=s0, backend="torch")
    torch.testing.assert_close(s, s0 * g.sum(1).exp()[..., None, None], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_triton_gpu_bf16(n):
    """Real sizes on CUDA: bf16 inputs into the Triton kernels vs the chunked torch path on the same
    (bf16-rounded) values in fp32; forward and gradients."""
    dev = "cuda"
    q, k, v, beta, g, s0 = (x.to(dev) if x is not None else None for x in make_inputs(2, 1000, 4, 128, 128, n, True))
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    fn = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0, backend="triton")
    ref = lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0, backend="torch")
    compare_backends(fn, ref, [q, k, v, beta, g, s0], tol=1e-2, grad_tol=2e-2, ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_parity_needs_negative_eigenvalues(backend):
    """beta = 2 x_t with a fixed key reflects the state on every 1-bit: sign(o_t) = (-1)^parity_t.
    With beta in [0, 1] the same entry is prod (1 - beta_t) >= 0, so parity cannot flip its sign."""
    T = 40
    bits = torch.randint(0, 2, (1, T)).double()
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    q = e1.expand(1, T, 1, 2)
    k = e1.expand(1, T, 1, 2)
    v = torch.zeros(1, T, 1, 2, dtype=torch.float64)
    s0 = torch.eye(2, dtype=torch.float64).expand(1, 1, 2, 2)
    o, _ = delta_product(q, k, v, 2 * bits[..., None], scale=1.0, initial_state=s0, backend=backend)
    parity = bits.cumsum(1) % 2
    torch.testing.assert_close(o[0, :, 0, 0], 1 - 2 * parity[0], rtol=0, atol=1e-12)
    o01, _ = delta_product(q, k, v, torch.rand(1, T, 1, dtype=torch.float64), scale=1.0,
                           initial_state=s0, backend=backend)
    assert (o01[0, :, 0, 0] >= -1e-12).all()       # (rounding of the chunked form around 0)


def transpositions(p):
    """Transpositions (a, b) whose application in list order gives the permutation p (<= n-1 of them)."""
    n = len(p)
    c = list(p)
    sigmas = []
    for i in range(n):
        if c[i] != i:
            a, b = i, c[i]
            sigmas.append((a, b))
            c = [b if x == a else a if x == b else x for x in c]     # c <- (a b) o c
    return sigmas[::-1]                                               # p = s_1 o ... o s_k: apply s_k first


@pytest.mark.parametrize("group, n_h", [("s3", 2), ("s5", 4)])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_n_minus_1_householders_track_symmetric_group(group, n_h, backend):
    """A word over S_n fed as n_h = n - 1 reflections per token (k = (e_a - e_b)/sqrt 2, beta = 2; padding
    steps beta = 0) drives S0 = I to the permutation matrix of the running product that
    ``zoo.tasks.state_tracking`` labels (DeltaProduct's S_n claim, with the task's multiplication order)."""
    from zoo.tasks import state_tracking as st

    n = int(group[1:])
    B, T = 4, 12
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, y = st.word_problem(B, T, g, group=group)
    elems = st.group_elements(group)
    k = torch.zeros(B, T, n_h, 1, n, dtype=torch.float64)
    k[..., 0] = 1.0
    beta = torch.zeros(B, T, n_h, 1, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sig = transpositions(elems[x[b, t]])
            assert len(sig) <= n - 1
            for j, (a, c) in enumerate(sig):
                k[b, t, j, 0] = 0.0
                k[b, t, j, 0, a], k[b, t, j, 0, c] = 2 ** -0.5, -(2 ** -0.5)
                beta[b, t, j, 0] = 2.0
    q = torch.randn(B, T, 1, n, dtype=torch.float64)
    v = torch.zeros(B, T, n_h, 1, n, dtype=torch.float64)
    s0 = torch.eye(n, dtype=torch.float64).expand(B, 1, n, n)
    _, S = delta_product(q, k, v, beta, num_householder=n_h, initial_state=s0, chunk_size=8, backend=backend)
    for b in range(B):
        p = elems[y[b, -1]]
        M = torch.zeros(n, n, dtype=torch.float64)
        M[list(p), list(range(n))] = 1.0                              # M e_i = e_{p(i)}
        torch.testing.assert_close(S[b, 0], M, rtol=0, atol=1e-10)
