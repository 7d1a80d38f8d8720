"""Mamba-2 SSD: the chunked torch path and the Triton kernels against the token recurrence (forward,
final state, gradients of x, dt, A, B, C and the initial state), chunk-size invariance, and two
outside oracles: flash-linear-attention's naive simple-GLA recurrence and mamba-ssm's
``ssd_minimal_discrete`` (when installed).

On a CPU the Triton kernels run through the interpreter (tests/conftest.py), so sizes are tiny; the
gpu-marked test runs at real size in bf16.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import BackendUnavailable, triton_usable_for
from kernels.ssd import ssd, ssd_chunked, ssd_reference, ssd_step
from tests.kernels.harness import DEVICE, assert_rel_close, compare_backends, needs_triton, rel_err, ssd_reference_any_A


def _inputs(b, T, H, P, N, init=False, dtype=torch.float32, device=DEVICE, strong_decay=False):
    x = torch.randn(b, T, H, P, dtype=dtype, device=device)
    dt = F.softplus(torch.randn(b, T, H, dtype=dtype, device=device) - 1.0)
    A = -(torch.rand(H, dtype=dtype, device=device) * 2 + 0.5)
    if strong_decay:
        dt, A = dt + 1.0, A * 8  # a chunk's cumulative log-decay reaches hundreds
    B = torch.randn(b, T, H, N, dtype=dtype, device=device)
    C = torch.randn(b, T, H, N, dtype=dtype, device=device)
    out = [x, dt, A, B, C]
    if init:
        out.append(torch.randn(b, H, N, P, dtype=dtype, device=device))
    return out


def _with_state(fn, chunk_size=None):
    kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    return lambda x, dt, A, B, C, h0: fn(x, dt, A, B, C, initial_state=h0, **kw)


def _no_state(fn, chunk_size=None):
    kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    return lambda x, dt, A, B, C: fn(x, dt, A, B, C, **kw)


def _assert_dA_close(gA, gA_ref, g_dt_ref, dt, tol, what="dA"):
    """dA_h = sum_t dt_t dL/da_t is a signed sum over every token, so its relative error grows as the
    terms cancel (fp32: up to ~3e-5 where every other gradient stays below 1e-6). Bound its absolute
    error by the size of those terms instead, ~ ||dL/d dt|| * ||dt|| (as for strong decay below)."""
    scale = (g_dt_ref.double().norm() * dt.double().norm()).item()
    err = (gA.double() - gA_ref.double()).abs().max().item()
    assert torch.isfinite(gA).all() and err <= tol * scale, f"{what}: abs error {err:.2e} > {tol:.0e} * {scale:.2e}"


def _compare(fn, ref, ins, init, **tols):
    """compare_backends, except that dA is checked against the size of its terms (see _assert_dA_close)
    in fp32, and with T=1 and no initial state the gradient of A is exactly zero (the decay multiplies a
    zero state), so a relative error is meaningless: A is then held fixed and its gradient checked to be
    ~0 in absolute terms."""
    if ins[0].dtype == torch.float32 and (init or ins[0].shape[1] > 1):
        A = ins[2]
        rest = ins[:2] + ins[3:]
        compare_backends(lambda *r: fn(*r[:2], A, *r[2:]), lambda *r: ref(*r[:2], A.double(), *r[2:]), rest, **tols)
        xs = [t.detach().clone().requires_grad_() for t in ins]
        rs = [t.detach().double().requires_grad_() for t in ins]
        outs, refs = fn(*xs), ref(*rs)
        ups = [torch.randn_like(r) for r in refs]
        torch.autograd.backward(list(outs), [u.float() for u in ups])
        torch.autograd.backward(list(refs), ups)
        _assert_dA_close(xs[2].grad, rs[2].grad, rs[1].grad, ins[1], 5e-6)
        return
    if init or ins[0].shape[1] > 1:
        compare_backends(fn, ref, ins, **tols)
        return
    x, dt, A, B, C = ins
    compare_backends(lambda x, dt, B, C: fn(x, dt, A, B, C), lambda x, dt, B, C: ref(x, dt, A.double(), B, C),
                     [x, dt, B, C], **tols)
    A = A.clone().requires_grad_()
    y, fin = fn(x, dt, A, B, C)
    (gA,) = torch.autograd.grad((y * torch.randn_like(y)).sum() + fin.sum(), A)
    assert gA.abs().max() < 1e-6 * (1 + y.abs().max())


def _compare_strong_decay(fn, ins):
    """Strong decay (per-step log-decay ~ -10..-40): everything to 3e-5 relative, except dA, whose true value
    is a tiny difference of O(1) terms (rowsum - colsum of the decayed scores, and a_t - a_s of cumsums in
    the hundreds), so fp32 can only get it to an absolute error ~ eps * the size of those terms."""
    x, dt, A, B, C, h0 = ins
    compare_backends(lambda x, dt, B, C, h0: fn(x, dt, A, B, C, initial_state=h0),
                     lambda x, dt, B, C, h0: ssd_reference(x, dt, A.double(), B, C, initial_state=h0),
                     [x, dt, B, C, h0], tol=1e-5, grad_tol=3e-5)
    xs = [t.clone().requires_grad_() for t in ins]
    rs = [t.double().requires_grad_() for t in ins]
    y, fin = fn(*xs[:5], initial_state=xs[5])
    y_r, fin_r = ssd_reference(*rs[:5], initial_state=rs[5])
    gy, gf = torch.randn_like(y_r), torch.randn_like(fin_r)
    torch.autograd.backward([y, fin], [gy.float(), gf.float()])
    torch.autograd.backward([y_r, fin_r], [gy, gf])
    scale = (rs[1].grad.norm() * dt.double().norm()).item()
    err = (xs[2].grad.double() - rs[2].grad).abs().max().item()
    assert torch.isfinite(xs[2].grad).all() and err <= 5e-6 * scale, f"dA abs error {err:.2e} > 5e-6 * {scale:.2e}"


def _triton():
    from kernels.ssd.triton import ssd_triton
    return ssd_triton


# --------------------------------------------------------------------------- chunked torch path
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("init", [False, True])
def test_chunked_matches_reference_fp64(T, init):
    wrap = _with_state if init else _no_state
    _compare(wrap(ssd_chunked, 16), wrap(ssd_reference), _inputs(2, T, 2, 16, 16, init, torch.float64, "cpu"), init,
             tol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_chunked_one_group_of_B_C_shared_by_the_heads(dtype, tol):
    """Mamba-2's single group: B and C expanded over the heads (a stride-0 head axis) take the shared
    path (C B^T once per chunk, head-summed gradients); outputs and the gradients of the one group."""
    x, dt, A, B, C, h0 = _inputs(2, 45, 3, 8, 16, True, dtype, "cpu")
    B, C = B[:, :, :1], C[:, :, :1]

    def grouped(fn, **kw):
        return lambda x, dt, A, B, C, h0: fn(x, dt, A, B.expand(-1, -1, 3, -1), C.expand(-1, -1, 3, -1),
                                              initial_state=h0, **kw)

    compare_backends(grouped(ssd_chunked, chunk_size=16), grouped(ssd_reference), [x, dt, A, B, C, h0],
                     tol=tol, grad_tol=5 * tol)


@pytest.mark.parametrize("shared", [False, True])
def test_chunked_in_segments_matches_reference(monkeypatch, shared):
    """A sequence longer than the segment length runs segment by segment with the state carried over
    (``kernels.common.SEGMENT``, set here to 2 chunks; T = 83 leaves a ragged last segment): outputs,
    final state and every gradient equal the token recurrence, per-head and shared-group B, C alike."""
    import kernels.common

    monkeypatch.setattr(kernels.common, "SEGMENT", 16)
    x, dt, A, B, C, h0 = _inputs(2, 83, 3, 8, 16, True, torch.float64, "cpu")
    if shared:
        B, C = B[:, :, :1], C[:, :, :1]

    def run(fn, **kw):
        def call(x, dt, A, B, C, h0):
            if shared:
                B, C = B.expand(-1, -1, 3, -1), C.expand(-1, -1, 3, -1)
            return fn(x, dt, A, B, C, initial_state=h0, **kw)
        return call

    compare_backends(run(ssd_chunked, chunk_size=8), run(ssd_reference), [x, dt, A, B, C, h0], tol=1e-10,
                     grad_tol=1e-9)


def test_chunked_fp32_vs_fp64_reference_strong_decay():
    _compare_strong_decay(lambda *a, **k: ssd_chunked(*a, chunk_size=64, **k),
                          _inputs(1, 50, 2, 8, 8, True, device="cpu", strong_decay=True))


# --------------------------------------------------------------------------- Triton kernels
@needs_triton
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("init", [False, True])
def test_triton_matches_reference(T, init):
    wrap = _with_state if init else _no_state
    _compare(wrap(_triton(), 16), wrap(ssd_reference), _inputs(2 if init else 1, T, 2, 16, 16, init), init,
             tol=1e-5, grad_tol=3e-5)


@needs_triton
def test_triton_odd_state_and_head_dims_strong_decay():
    # N=12, P=20 are padded to blocks of 16/32; chunk 64 > T with a decay strong enough to underflow exp(a_t)
    _compare_strong_decay(lambda *a, **k: _triton()(*a, chunk_size=64, **k),
                          _inputs(1, 45, 2, 20, 12, True, strong_decay=True))


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
def test_triton_one_group_of_B_C_read_in_place(dtype, tol):
    """Mamba-2's single group: B and C expanded over the heads (a head stride of 0, as the mixer passes
    them) are read in place by the kernels; outputs and the gradients of the one group (the per-head
    dB, dC summed by autograd) against the fp64 token recurrence, with 2 column blocks at fp32 (P 20)."""
    x, dt, A, B, C, h0 = (t.to(dtype) for t in _inputs(2, 45, 3, 20, 16, True))
    B, C = B[:, :, :1], C[:, :, :1]

    def grouped(fn, **kw):
        return lambda x, dt, B, C, h0: fn(x, dt, A.double() if fn is ssd_reference else A, B.expand(-1, -1, 3, -1),
                                          C.expand(-1, -1, 3, -1), initial_state=h0, **kw)

    compare_backends(grouped(_triton(), chunk_size=16), grouped(ssd_reference), [x, dt, B, C, h0], tol=tol,
                     grad_tol=3 * tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_largest_state_and_head_dims(dtype):
    """d_state = head dim = 128 (TRITON_MAX_DIM, mamba-ssm's default d_state): the columns of x are split over
    programs (8 blocks of 16 with fp32 inputs, 2 of 64 with fp16 ones), whose shares of dB, dC, ddt and dA
    are summed; every output and gradient against the fp64 token recurrence. fp16: the tolerances of
    tests/kernels/test_low_precision.py (inputs rounded to fp16 first, so the error is the kernels'), dA's scaled
    by how much its terms cancel (see :func:`tests.kernels.harness.cancellation`)."""
    from kernels.ssd import TRITON_MAX_DIM
    from kernels.ssd.triton import column_block

    assert TRITON_MAX_DIM == 128 and column_block(128, dtype != torch.float32) == (64 if dtype == torch.float16 else 16)
    ins = [t.to(dtype) for t in _inputs(1, 37, 1, 128, 128, init=True)]
    if dtype == torch.float32:
        _compare(_with_state(_triton(), 16), _with_state(ssd_reference), ins, True, tol=1e-5, grad_tol=3e-5)
    else:
        # dA sums 37 * 128 * 128 signed terms: its tolerance is scaled by how much they cancel
        compare_backends(_with_state(_triton(), 16), _with_state(ssd_reference_any_A), ins, tol=5e-3, grad_tol=1e-2,
                         shared={2: tuple(ins[1].shape)})


@needs_triton
def test_triton_only_final_state_used():
    """A loss on the final state alone: the backward must run with dy = 0."""
    x, dt, A, B, C = (t.requires_grad_() for t in _inputs(1, 23, 2, 16, 16))
    _, fin = _triton()(x, dt, A, B, C, chunk_size=16)
    *g, gC = torch.autograd.grad(fin.square().sum(), (x, dt, A, B, C))
    rs = [t.detach().double().requires_grad_() for t in (x, dt, A, B)]
    _, fin_r = ssd_reference(*rs[:4], C.detach().double())
    g_r = torch.autograd.grad(fin_r.square().sum(), rs)
    for a, e in zip(g[:2] + g[3:], g_r[:2] + g_r[3:]):  # x, dt, B
        assert_rel_close(a, e, 3e-5, "grad from final state")
    # dA_h = sum_r dt_r dL/da_r is a sum over tokens whose terms can cancel, so its relative error is
    # unbounded; bound the error by the size of the terms instead. With h_T = sum_s w_s u_s,
    # w_s = exp(sum_{r>s} a_r), u_s = dt_s B_s x_s^T and G = dL/dh_T = 2 h_T:
    # dL/da_r = sum_{s<r} w_s <G, u_s>. The kernels do not form these prefix sums: per chunk they add whole-chunk
    # sums of w_s <G, u_s> and subtract suffix sums, and G is itself the fp32 h_T, rounded relative to
    # sum_s w_s |u_s| (elementwise). So the rounding of every dA_r is relative to
    # S = sum_s w_s <|G|, |u_s|> with |G| <= 2 sum_s w_s |u_s|, and that of dA to sum_r dt_r S. Measured the
    # error is at most 0.5 u of that scale (u = 2^-24; 400 draws); 1e-6 is 17 u. The scale of the signed prefix
    # sums used before, sum_r dt_r |dL/da_r|, can be 1e4 times smaller than what the kernels add up (where dA
    # itself is 1e4 times smaller than its terms), and its 1e-4 bound failed on 7 of 608 draws.
    xd, dtd, Ad, Bd = (t.detach().double() for t in (x, dt, A, B))
    a = dtd * Ad                                                         # (b, T, H)
    w = (a.flip(1).cumsum(1).flip(1) - a).exp()                          # exp(sum_{r>s} a_r)
    u = dtd[..., None, None] * Bd[..., None] * xd[..., None, :]          # (b, T, H, N, P)
    inner = torch.einsum("bthnp,bhnp->bth", u, 2 * fin_r.detach()) * w   # w_s <G, u_s>
    dLda = inner.cumsum(1) - inner                                       # sum over s < r
    wu = w[..., None, None] * u.abs()                                    # w_s |u_s|
    summed = torch.einsum("bthnp,bhnp->bh", wu, 2 * wu.sum(1))          # S, with |G| at its bound
    terms = (dtd.sum(1) * summed).sum(0)                                 # (H,)
    err = (g[2].double() - g_r[2]).abs()
    assert (err <= 1e-6 * terms).all(), f"dA error {err.tolist()} vs term scale {terms.tolist()}"
    assert_rel_close(g_r[2], (dtd * dLda).sum((0, 1)), 1e-9, "dA decomposition")  # dL/da_r as written above
    assert torch.count_nonzero(gC) == 0  # the final state does not depend on C


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_chunk_size_invariance(backend):
    fn = ssd_chunked if backend == "torch" else _triton()
    ins = [t.requires_grad_() for t in _inputs(1, 37, 2, 16, 16, init=True)]
    outs, grads = [], []
    for L in (1, 8, 64):
        y, fin = fn(*ins[:5], chunk_size=L, initial_state=ins[5])
        outs.append((y, fin))
        grads.append(torch.autograd.grad((y.sum() + fin.sum()), ins))
    for (y, fin), g in zip(outs[1:], grads[1:]):
        assert_rel_close(y, outs[0][0], 1e-5, "y vs chunk 1")
        assert_rel_close(fin, outs[0][1], 1e-5, "final vs chunk 1")
        for i, (a, e) in enumerate(zip(g, grads[0])):
            if i == 2:
                _assert_dA_close(a, e, grads[0][1], ins[1], 5e-6, "dA vs chunk 1")
            else:
                assert_rel_close(a, e, 3e-5, "grad vs chunk 1")


def test_step_matches_reference():
    x, dt, A, B, C, h0 = _inputs(2, 5, 2, 4, 3, True, torch.float64, "cpu")
    y_ref, h_ref = ssd_reference(x, dt, A, B, C, initial_state=h0)
    h = h0
    for t in range(5):
        y_t, h = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h)
        assert_rel_close(y_t, y_ref[:, t], 1e-12, f"step {t}")
    assert_rel_close(h, h_ref, 1e-12, "final state")


@pytest.mark.parametrize("backend", ["auto", "reference", "torch", "triton"])
def test_dispatcher_every_backend(backend):
    ins = _inputs(1, 19, 2, 16, 16, True)
    y_ref, h_ref = ssd_reference(*(t.double() for t in ins[:5]), initial_state=ins[5].double())
    if backend == "triton" and not triton_usable_for(ins[0]):
        with pytest.raises(BackendUnavailable):
            ssd(*ins[:5], chunk_size=16, initial_state=ins[5], backend=backend)
        return
    y, h = ssd(*ins[:5], chunk_size=16, initial_state=ins[5], backend=backend)
    assert y.dtype == ins[0].dtype and h.dtype == ins[0].dtype
    assert_rel_close(y, y_ref, 1e-5, backend)
    assert_rel_close(h, h_ref, 1e-5, backend)


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
def test_the_skip_d_adds_d_x_and_takes_its_gradient(backend):
    """``ssd(..., D=D)`` is ``ssd(...) + D x`` (Mamba-2's skip; the Triton backend adds it inside its output kernel
    and forms dx's and dD's shares in its backward), gradients included: against the fp64 recurrence."""
    ins = _inputs(2, int(torch.randint(5, 40, ())), 2, 16, 16, True)
    skip = torch.randn(2)
    leaves = [t.detach().clone().requires_grad_(True) for t in (*ins, skip)]
    y, h = ssd(*leaves[:5], chunk_size=16, initial_state=leaves[5], backend=backend, D=leaves[6])
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * dy).sum() + (h * dh).sum(), leaves)
    exact = [t.detach().double().requires_grad_(True) for t in leaves]
    y_ref, h_ref = ssd_reference(*exact[:5], initial_state=exact[5])
    y_ref = y_ref + exact[6][:, None] * exact[0]
    grads_ref = torch.autograd.grad((y_ref * dy.double()).sum() + (h_ref * dh.double()).sum(), exact)
    assert_rel_close(y, y_ref, 1e-5, "y")
    for name, g, g_ref in zip(("dx", "ddt", "dA", "dB", "dC", "dh0", "dD"), grads, grads_ref):
        assert_rel_close(g, g_ref, 1e-4, name)


@needs_triton
def test_triton_gradients_of_the_final_state_alone():
    """A state-passing caller differentiates the final state alone: the unused output's gradient is not
    zero-filled, and the gradients match the fp64 recurrence's."""
    ins = _inputs(2, int(torch.randint(5, 40, ())), 2, 16, 16, True)
    leaves = [t.detach().clone().requires_grad_(True) for t in ins]
    _, h = ssd(*leaves[:5], chunk_size=16, initial_state=leaves[5], backend="triton")
    exact = [t.detach().double().requires_grad_(True) for t in ins]
    _, h_ref = ssd_reference(*exact[:5], initial_state=exact[5])
    w = torch.randn_like(h_ref)
    grads_ref = torch.autograd.grad((h_ref * w).sum(), exact, allow_unused=True)
    for name, g, g_ref in zip(("dx", "ddt", "dA", "dB", "dC", "dh0"), torch.autograd.grad((h * w.float()).sum(), leaves),
                              grads_ref):
        if g_ref is None:                     # C reaches only the outputs
            assert not g.any(), name
        else:
            assert_rel_close(g, g_ref, 1e-4, name)


@needs_triton
def test_triton_rejects_bad_shapes():
    x, dt, A, B, C = _inputs(1, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="do not match"):
        _triton()(x, dt[:, :4], A, B, C)
    with pytest.raises(ValueError, match="chunk_size"):
        _triton()(x, dt, A, B, C, chunk_size=0)


# --------------------------------------------------------------------------- outside oracles
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_matches_fla_naive_simple_gla(backend):
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    x, dt, A, B, C, h0 = _inputs(2, 37, 2, 16, 16, True)
    fn = ssd_chunked if backend == "torch" else _triton()
    y, fin = fn(x, dt, A, B, C, chunk_size=16, initial_state=h0)
    # SSD is simple GLA with q = C, k = B, v = dt * x, log-decay g = dt * A and no 1/sqrt(d) scale
    o, s = naive.naive_recurrent_simple_gla(C, B, x * dt[..., None], dt * A, scale=1.0, initial_state=h0.clone(),
                                            output_final_state=True)
    # fla's naive recurrence runs in fp32 token by token, so it is itself accurate to ~1e-6 only
    assert_rel_close(y, o, 1e-5, "y vs fla")
    assert_rel_close(fin, s, 1e-5, "final state vs fla")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_matches_mamba_ssm_minimal(backend):
    minimal = pytest.importorskip("mamba_ssm.modules.ssd_minimal")
    x, dt, A, B, C = _inputs(1, 32, 2, 16, 16)
    # ssd_minimal_discrete sums its einsums over the group axis, so it is only right for one group:
    # B and C shared by the heads
    B, C = B[:, :, :1], C[:, :, :1]
    fn = ssd_chunked if backend == "torch" else _triton()
    y, fin = fn(x, dt, A, B.expand(-1, -1, 2, -1), C.expand(-1, -1, 2, -1), chunk_size=16)
    # ssd_minimal_discrete(X, A, B, C, block_len) takes X = dt * x and the per-step log-decay dt * A
    y_m, fin_m = minimal.ssd_minimal_discrete(x * dt[..., None], dt * A, B, C, 16)
    assert_rel_close(y, y_m, 1e-5, "y vs mamba-ssm minimal")
    # mamba-ssm's final state is (b, groups, h, p, n); ours is (b, h, n, p)
    assert_rel_close(fin, fin_m[:, 0].transpose(-1, -2), 1e-5, "final state vs mamba-ssm minimal")


# --------------------------------------------------------------------------- GPU, real size
@pytest.mark.gpu
@pytest.mark.parametrize("P,N", [(64, 64), (64, 128), (128, 128)])
def test_gpu_bf16_real_size(P, N):
    """bf16 at real sizes, up to mamba-ssm's default d_state 128 and head dim 128 (column blocks)."""
    from kernels.ssd.triton import ssd_triton

    b, T, H = 2, 2048, 8
    ins = _inputs(b, T, H, P, N, True, device="cuda")
    ins32 = [t.requires_grad_() for t in ins]
    lo = [t.detach().bfloat16().requires_grad_() if i != 2 else t.detach().clone().requires_grad_()
          for i, t in enumerate(ins)]  # A (per-head rate) stays fp32, as in a mixer
    y_ref, h_ref = ssd_chunked(*ins32[:5], chunk_size=64, initial_state=ins32[5])
    y, h = ssd_triton(*lo[:5], chunk_size=64, initial_state=lo[5])
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) < 2e-2 and rel_err(h, h_ref) < 2e-2
    gy, gh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    torch.autograd.backward([y_ref, h_ref], [gy, gh])
    torch.autograd.backward([y, h], [gy.bfloat16(), gh.bfloat16()])
    for i, (a, e) in enumerate(zip(lo, ins32)):
        assert rel_err(a.grad, e.grad) < 5e-2, f"grad {i}"
    # fp32 Triton at real size must be as tight as on the interpreter
    y32, h32 = ssd_triton(*(t.detach() for t in ins[:5]), chunk_size=64, initial_state=ins[5].detach())
    assert rel_err(y32, y_ref) < 1e-4 and rel_err(h32, h_ref) < 1e-4
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:  # the outside oracle is an optional GPU extra
        return
    x, dt, A, B, C, h0 = (t.detach() for t in ins)
    y_m = mamba_chunk_scan_combined(x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), 64,
                                    initial_states=h0.transpose(-1, -2).contiguous())
    assert rel_err(y, y_m) < 2e-2
