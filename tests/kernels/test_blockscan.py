"""Block scans: the chunked torch path and the Triton kernels against the fp64 token recurrence
(outputs, final state and every input gradient), the Jordan polynomial path against the dense scan on
the materialised Jordan transitions, ``m = 1`` against an independently written diagonal recurrence
(cumulative log products), the decode steps against the scans, and the chunked path's saved-tensor
memory growing linearly in ``T``. The Triton kernels are chunk-parallel: they are checked over several
chunks (T not a multiple of the chunk), on both products of the chunk transition (register products for
m < 16, ``tl.dot`` for m >= 16), in fp16 against fp64, and for a number of launches that does not grow
with ``T``.

On a CPU the Triton kernels run through the interpreter (tests/conftest.py), so their shapes are tiny.
"""
from __future__ import annotations

import pytest
import torch

from kernels.blockscan import (
    block_scan,
    block_scan_step,
    jordan_scan,
    jordan_scan_normed,
    jordan_step,
    jordan_step_normed,
)
from tests.kernels.harness import DEVICE, assert_rel_close, compare_backends, needs_triton
from tests.mixers.launches import count_launches


def _dense_inputs(B, T, N, m, dtype=torch.float32):
    # rows: random signs times a softmax times a scale in (0.5, 1): ||A_t||_inf <= 1, so spectral radius <= 1
    logits = torch.randn(B, T, N, m, m, dtype=dtype, device=DEVICE)
    sign = torch.randint(0, 2, logits.shape, device=DEVICE).to(dtype) * 2 - 1
    scale = 0.5 + 0.5 * torch.rand(B, T, N, m, 1, dtype=dtype, device=DEVICE)
    A = sign * torch.softmax(logits, -1) * scale
    b = torch.randn(B, T, N, m, dtype=dtype, device=DEVICE)
    h0 = torch.randn(B, N, m, dtype=dtype, device=DEVICE)
    return A, b, h0


def _jordan_inputs(B, T, N, m, c_shape, dtype=torch.float32):
    lam = 0.05 + 0.9 * torch.rand(B, T, N, dtype=dtype, device=DEVICE)
    shape = {"N": (N,), "11N": (1, 1, N), "BTN": (B, T, N)}[c_shape]
    c = torch.rand(shape, dtype=dtype, device=DEVICE) - 0.5
    b = torch.randn(B, T, N, m, dtype=dtype, device=DEVICE)
    h0 = torch.randn(B, N, m, dtype=dtype, device=DEVICE)
    return lam, c, b, h0


def _block(backend, chunk=None):
    kw = {} if chunk is None else {"chunk_size": chunk}
    return (lambda A, b, h0: block_scan(A, b, h0, backend=backend, **kw),
            lambda A, b: block_scan(A, b, backend=backend, **kw))


def _jordan(backend, chunk=None):
    kw = {} if chunk is None else {"chunk_size": chunk}
    return (lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend=backend, **kw),
            lambda lam, c, b: jordan_scan(lam, c, b, backend=backend, **kw))


def _check_block(backend, B, T, N, m, chunk, init, tol=2e-5):
    A, b, h0 = _dense_inputs(B, T, N, m)
    fn_i, fn = _block(backend, chunk)
    ref_i, ref = _block("reference")
    if init:
        compare_backends(fn_i, ref_i, [A, b, h0], tol=tol)
    else:
        compare_backends(fn, ref, [A, b], tol=tol)


def _check_jordan(backend, B, T, N, m, chunk, init, c_shape, tol=2e-5):
    lam, c, b, h0 = _jordan_inputs(B, T, N, m, c_shape)
    fn_i, fn = _jordan(backend, chunk)
    ref_i, ref = _jordan("reference")
    # a c shared across tokens gets the sum of per-token gradients, which can cancel: with B = N = 1 its
    # fp32 error relative to the sum passed 2e-5 on 0.4% of 1000 draws (chunked, T = 37; up to 7e-5), so it
    # is judged against the sum of the terms' magnitudes (compare_backends' shared), over which the fp32
    # reference's error stays below 2.4e-7 (2000 draws, T = 16) and the chunked path passed 2000 of 2000
    shared = None if c_shape == "BTN" else {1: tuple(lam.shape)}
    if init:
        compare_backends(fn_i, ref_i, [lam, c, b, h0], tol=tol, shared=shared)
    else:
        compare_backends(fn, ref, [lam, c, b], tol=tol, shared=shared)


CHUNKED_CASES = [  # (B, T, N, m, chunk_size, initial_state)
    (2, 37, 3, 4, 5, True),
    (2, 37, 2, 3, 16, False),
    (1, 1, 2, 4, 16, True),
    (1, 100, 2, 2, 16, True),
    (2, 100, 3, 1, 5, False),
    (1, 37, 1, 8, 64, True),
]


@pytest.mark.parametrize("B,T,N,m,chunk,init", CHUNKED_CASES)
def test_block_scan_chunked_matches_reference(B, T, N, m, chunk, init):
    _check_block("torch", B, T, N, m, chunk, init)


@pytest.mark.parametrize("c_shape", ["N", "11N", "BTN"])
@pytest.mark.parametrize("B,T,N,m,chunk,init", CHUNKED_CASES)
def test_jordan_scan_chunked_matches_reference(B, T, N, m, chunk, init, c_shape):
    _check_jordan("torch", B, T, N, m, chunk, init, c_shape)


TRITON_CASES = [  # (B, T, N, m, initial_state): m = 3 and 5 exercise the masking of a padded block
    (2, 37, 2, 3, True),
    (1, 1, 2, 4, False),
    (1, 20, 2, 1, True),
    (1, 16, 1, 5, False),
]


@needs_triton
@pytest.mark.parametrize("B,T,N,m,init", TRITON_CASES)
def test_block_scan_triton_matches_reference(B, T, N, m, init):
    _check_block("triton", B, T, N, m, None, init)


@needs_triton
@pytest.mark.parametrize("B,T,N,m,init", TRITON_CASES)
@pytest.mark.parametrize("c_shape", ["N", "BTN"])
def test_jordan_scan_triton_matches_reference(B, T, N, m, init, c_shape):
    _check_jordan("triton", B, T, N, m, None, init, c_shape)


@needs_triton
@pytest.mark.parametrize("B,T,N,m,init,w_shape", [(2, 37, 2, 3, True, "Nm"), (1, 1, 2, 4, True, "m"),
                                                 (1, 20, 1, 5, False, "Nm"), (1, 9, 3, 6, True, "m")])
def test_jordan_scan_normed_triton_matches_reference(B, T, N, m, init, w_shape):
    # m >= 3: for m = 2 the normalised state is +-(1, -1) and its true gradient is an eps-sized
    # difference of O(1) terms, which fp32 cannot resolve to a relative tolerance
    lam, c, b, h0 = _jordan_inputs(B, T, N, m, "N")
    shape = (N, m) if w_shape == "Nm" else (m,)
    weight = 1 + 0.3 * torch.randn(shape, device=DEVICE)
    bias = 0.3 * torch.randn(shape, device=DEVICE)

    def run(backend, with_init):
        if with_init:
            return lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, initial_state=h0, backend=backend)
        return lambda lam, c, b, w, bi: jordan_scan_normed(lam, c, b, w, bi, backend=backend)

    ins = [lam, c, b, weight, bias] + ([h0] if init else [])
    # A block whose pre-norm components are nearly equal has a tiny variance, and the norm's Jacobian
    # amplifies rounding by 1/std: over 2000 draws of the first case, the fp32 reference itself misses
    # the fp64 one by more than 5e-5 in 0.5% of them (up to 7e-4), and Triton by the same amount (on the
    # 92 draws where the fp32 reference's error passes 1e-5 and 20 others, Triton's error / the fp32
    # reference's = 0.79..1.12 wherever Triton's passes 2e-5; up to 3.6 below that). So each tolerance is
    # at least 4x the fp32 reference's own error on the draw. The gradient of the shared c sums per-token
    # terms that can cancel (_check_jordan): with N = 1, T = 20 the fp32 reference's own error passes 5e-5
    # on 3 of 2000 draws (up to 1.7e-4), independently of Triton's (0.1..2.5x on the 20 worst draws);
    # over the sum of the terms' magnitudes it stays below 1.2e-6 (2000 draws).
    compare_backends(run("triton", init), run("reference", init), ins, tol=2e-5, grad_tol=5e-5, rounding_factor=4,
                     shared={1: tuple(lam.shape)})


TRITON_CHUNKED_CASES = [  # (B, T, N, m, chunk_size, initial_state): several chunks, the last one partial
    (2, 37, 3, 4, 8, True),
    (1, 29, 2, 3, 4, False),
    (1, 21, 5, 1, 5, True),
    (1, 19, 1, 16, 8, True),   # m >= 16: the chunk transition as a tl.dot
    (1, 13, 2, 17, 4, False),  # ... padded to 32
]


@needs_triton
@pytest.mark.parametrize("B,T,N,m,chunk,init", TRITON_CHUNKED_CASES)
def test_block_scan_triton_over_chunks_matches_reference(B, T, N, m, chunk, init):
    _check_block("triton", B, T, N, m, chunk, init)


@needs_triton
@pytest.mark.parametrize("B,T,N,m,chunk,init", TRITON_CHUNKED_CASES[:3])
def test_jordan_scan_triton_over_chunks_matches_reference(B, T, N, m, chunk, init):
    _check_jordan("triton", B, T, N, m, chunk, init, "BTN")  # a per-block coupling: the fp16 test below


@needs_triton
def test_block_scan_triton_reads_a_broadcast_transition():
    """One transition per block for every token (a stride-0 view, as a time-invariant layer passes it): the
    kernels read it in place and its gradient is the sum over batch and time."""
    B, T, N, m = 2, 23, 3, 4
    A, _, _ = _dense_inputs(1, 1, N, m)

    def run(backend):
        return lambda A, b, h0: block_scan(A.expand(B, T, N, m, m), b, h0, chunk_size=6, backend=backend)

    b, h0 = torch.randn(B, T, N, m, device=DEVICE), torch.randn(B, N, m, device=DEVICE)
    compare_backends(run("triton"), run("reference"), [A[0, 0], b, h0], tol=2e-5)


# fp16 under the interpreter, against fp64 on the same rounded inputs. u = 2^-11 (fp16's unit roundoff): the
# kernels compute in fp32 (the m >= 16 product with the fp32 state split into two fp16 tiles, ~2^-22
# relative), so the forward error is the rounding of the output to fp16, at most u per entry (about u / 3
# in the norm): tolerance 2u. Gradients: the upstream gradient handed to the kernel is rounded to fp16 (u)
# and each gradient is rounded once more (u); the transitions are contractions here: tolerance 4u.
FP16_U = 2.0 ** -11


@needs_triton
@pytest.mark.parametrize("m", [4, 16])
def test_block_scan_triton_fp16_matches_fp64(m):
    A, b, h0 = (x.half() for x in _dense_inputs(2, 21, 3, m))
    compare_backends(lambda A, b, h0: block_scan(A, b, h0, chunk_size=8, backend="triton"),
                     lambda A, b, h0: block_scan(A, b, h0, backend="reference"), [A, b, h0],
                     tol=2 * FP16_U, grad_tol=4 * FP16_U)


@needs_triton
def test_jordan_scans_triton_fp16_match_fp64():
    lam, c, b, h0 = (x.half() for x in _jordan_inputs(2, 21, 3, 4, "N"))
    # c's gradient sums one term per token, which can cancel: judged against the terms' magnitudes
    shared_c = {1: (2, 21, 3)}
    compare_backends(lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, chunk_size=8, backend="triton"),
                     lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend="reference"), [lam, c, b, h0],
                     tol=2 * FP16_U, grad_tol=4 * FP16_U, shared=shared_c)
    w, bias = (1 + 0.1 * torch.randn(3, 4, device=DEVICE)).half(), (0.1 * torch.randn(3, 4, device=DEVICE)).half()
    # the LayerNorm divides by the state's spread: its Jacobian amplifies the fp16 rounding of the upstream
    # gradient by about 1 / (std of the normalised block) ~ 2 here, hence 8u for the gradients
    compare_backends(lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, initial_state=h0,
                                                                     backend="triton"),
                     lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, initial_state=h0,
                                                                     backend="reference"),
                     [lam, c, b, w, bias, h0], tol=2 * FP16_U, grad_tol=8 * FP16_U, shared=shared_c)


@needs_triton
@pytest.mark.parametrize("op,m,expected", [
    ("block", 4, {"triton:blockscan._dense_fwd": 2, "triton:blockscan._carry": 2, "triton:blockscan._dense_bwd": 2}),
    ("block", 16, {"triton:blockscan._dense_local_mm": 1, "triton:blockscan._carry": 2, "triton:blockscan._dense_fwd": 1,
                   "triton:blockscan._dense_bwd": 2}),
    ("jordan", 4, {"triton:blockscan._jordan_fwd": 2, "triton:blockscan._carry": 2, "triton:blockscan._jordan_bwd": 2}),
    ("normed", 4, {"triton:blockscan._normed_fwd": 1, "triton:blockscan._normed_bwd": 1}),
])
def test_launches_per_forward_backward_do_not_grow_with_T(op, m, expected):
    """Three launches forward and three backward for the linear scans (local chunk pass, carry, rerun; at m = 16
    the local pass is the chunk transition's product kernel), one and one for the sequential normed scan; the
    same operations and kernels at T and 4T (:func:`tests.mixers.launches.count_launches` on meta tensors, the
    kernels counted, not run)."""
    from kernels.blockscan.triton import block_scan_triton, jordan_scan_normed_triton, jordan_scan_triton

    def meta(*shape):
        return torch.empty(shape, device="meta").requires_grad_()

    def run(T, B=2, N=8):
        h0 = meta(B, N, m)
        if op == "block":
            return block_scan_triton(meta(B, T, N, m, m), meta(B, T, N, m), h0, chunk_size=64)
        lam, c, b = meta(B, T, N), meta(N), meta(B, T, N, m)
        if op == "jordan":
            return jordan_scan_triton(lam, c, b, h0, chunk_size=64)
        return jordan_scan_normed_triton(lam, c, b, meta(N, m), meta(N, m), initial_state=h0)

    def counts(T):
        def go():
            sum(o.float().sum() for o in run(T)).backward()
        return count_launches(go, execute=False)[1]

    short, long = counts(1024), counts(4096)
    assert short == long, (short, long)
    assert {k: v for k, v in short.items() if k.startswith("triton:")} == expected, short


@needs_triton
def test_triton_keeps_fp64():
    A, b, h0 = _dense_inputs(1, 9, 2, 3, dtype=torch.float64)
    h, last = block_scan(A, b, h0, backend="triton")
    h_r, last_r = block_scan(A, b, h0, backend="reference")
    assert h.dtype == torch.float64
    assert_rel_close(h, h_r, 1e-13, "fp64 triton block_scan")
    lam, c, b, h0 = _jordan_inputs(1, 9, 2, 3, "N", dtype=torch.float64)
    h, _ = jordan_scan(lam, c, b, h0, backend="triton")
    assert_rel_close(h, jordan_scan(lam, c, b, h0, backend="reference")[0], 1e-13, "fp64 triton jordan_scan")


def _materialised_jordan(lam, c, m):
    # built here independently of the package: lam I + c * (ones on the superdiagonal)
    eye = torch.eye(m, dtype=lam.dtype, device=lam.device)
    sup = torch.zeros(m, m, dtype=lam.dtype, device=lam.device)
    for i in range(m - 1):
        sup[i, i + 1] = 1.0
    c = torch.broadcast_to(c, lam.shape)
    return lam[..., None, None] * eye + c[..., None, None] * sup


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_jordan_scan_equals_dense_scan_on_materialised_transitions(backend, m):
    lam, c, b, h0 = _jordan_inputs(2, 29, 3, m, "N")
    compare_backends(
        lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, chunk_size=8, backend=backend),
        lambda lam, c, b, h0: block_scan(_materialised_jordan(lam, c, m), b, h0, backend="reference"),
        [lam, c, b, h0], tol=2e-5,
    )


def _diagonal_oracle(a, b, h0):
    """h_t = a_t h_{t-1} + b_t for positive scalars a, via cumulative log products (O(T^2))."""
    G = torch.cumsum(torch.log(a), dim=1)  # (B, T, N)
    T = a.shape[1]
    seg = G[:, :, None] - G[:, None, :]  # [t, s] = sum_{s < r <= t} log a_r
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()
    w = torch.where(causal[None, :, :, None], seg, torch.full_like(seg, float("-inf"))).exp()
    return torch.einsum("btsn,bsn->btn", w, b) + G.exp() * h0[:, None]


@pytest.mark.parametrize("backend", ["reference", "torch",
                                     pytest.param("triton", marks=needs_triton)])
def test_m1_block_scan_is_the_diagonal_recurrence(backend):
    T = 37 if backend != "triton" else 20
    a = 0.2 + 0.8 * torch.rand(2, T, 3, dtype=torch.float64, device=DEVICE)
    b = torch.randn(2, T, 3, dtype=torch.float64, device=DEVICE)
    h0 = torch.randn(2, 3, dtype=torch.float64, device=DEVICE)
    h, last = block_scan(a[..., None, None], b[..., None], h0[..., None], chunk_size=6, backend=backend)
    expected = _diagonal_oracle(a, b, h0)
    assert_rel_close(h[..., 0], expected, 1e-12, "m = 1 block_scan")
    assert_rel_close(last[..., 0], expected[:, -1], 1e-12, "m = 1 h_last")


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
def test_scans_equal_repeated_steps(backend):
    B, T, N, m = 2, 11, 2, 3
    A, b, h0 = _dense_inputs(B, T, N, m, dtype=torch.float64)
    h, last = block_scan(A, b, h0, chunk_size=4, backend=backend)
    state = h0
    for t in range(T):
        state = block_scan_step(A[:, t], b[:, t], state)
        assert_rel_close(h[:, t], state, 1e-12, f"block_scan vs steps at t={t}")
    assert_rel_close(last, state, 1e-12, "block_scan h_last")

    lam, c, b, h0 = _jordan_inputs(B, T, N, m, "N", dtype=torch.float64)
    h, last = jordan_scan(lam, c, b, h0, chunk_size=4, backend=backend)
    state = h0
    for t in range(T):
        state = jordan_step(lam[:, t], c, b[:, t], state)
        assert_rel_close(h[:, t], state, 1e-12, f"jordan_scan vs steps at t={t}")
    assert_rel_close(last, state, 1e-12, "jordan_scan h_last")

    w, bi = torch.randn(N, m, dtype=torch.float64), torch.randn(m, dtype=torch.float64)
    h, last = jordan_scan_normed(lam, c, b, w, bi, initial_state=h0, backend=backend)
    state = h0
    for t in range(T):
        state = jordan_step_normed(lam[:, t], c, b[:, t], w, bi, state)
        assert_rel_close(h[:, t], state, 1e-12, f"jordan_scan_normed vs steps at t={t}")
    assert_rel_close(last, state, 1e-12, "jordan_scan_normed h_last")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_prefix_then_step_and_continue_equals_full_scan(backend):
    B, T, N, m, k = 2, 23, 2, 4, 13
    A, b, h0 = _dense_inputs(B, T, N, m, dtype=torch.float64)
    full, full_last = block_scan(A, b, h0, chunk_size=5, backend=backend)
    _, mid = block_scan(A[:, :k], b[:, :k], h0, chunk_size=5, backend=backend)
    assert_rel_close(block_scan_step(A[:, k], b[:, k], mid), full[:, k], 1e-12, "prefix + step")
    rest, rest_last = block_scan(A[:, k:], b[:, k:], mid, chunk_size=5, backend=backend)
    assert_rel_close(rest, full[:, k:], 1e-12, "prefix + continued scan")
    assert_rel_close(rest_last, full_last, 1e-12, "continued h_last")

    lam, c, b, h0 = _jordan_inputs(B, T, N, m, "11N", dtype=torch.float64)
    full, full_last = jordan_scan(lam, c, b, h0, chunk_size=5, backend=backend)
    _, mid = jordan_scan(lam[:, :k], c, b[:, :k], h0, chunk_size=5, backend=backend)
    assert_rel_close(jordan_step(lam[:, k], c, b[:, k], mid), full[:, k], 1e-12, "jordan prefix + step")
    rest, rest_last = jordan_scan(lam[:, k:], c, b[:, k:], mid, chunk_size=5, backend=backend)
    assert_rel_close(rest, full[:, k:], 1e-12, "jordan prefix + continued scan")

    w, bi = torch.randn(N, m, dtype=torch.float64), torch.randn(N, m, dtype=torch.float64)
    full, _ = jordan_scan_normed(lam, c, b, w, bi, initial_state=h0, backend=backend)
    _, mid = jordan_scan_normed(lam[:, :k], c, b[:, :k], w, bi, initial_state=h0, backend=backend)
    assert_rel_close(jordan_step_normed(lam[:, k], c, b[:, k], w, bi, mid), full[:, k], 1e-12,
                     "normed prefix + step")


def test_chunk_size_does_not_change_the_result():
    A, b, h0 = _dense_inputs(1, 50, 2, 3, dtype=torch.float64)
    h1, _ = block_scan(A, b, h0, chunk_size=1, backend="torch")
    h2, _ = block_scan(A, b, h0, chunk_size=7, backend="torch")
    h3, _ = block_scan(A, b, h0, chunk_size=64, backend="torch")
    assert_rel_close(h1, h3, 1e-12, "chunk 1 vs 64")
    assert_rel_close(h2, h3, 1e-12, "chunk 7 vs 64")


def test_bf16_inputs_return_bf16_states_with_an_fp32_final_state():
    A, b, h0 = _dense_inputs(1, 40, 2, 4)
    h, last = block_scan(A.bfloat16(), b.bfloat16(), h0.bfloat16(), chunk_size=8, backend="torch")
    assert h.dtype == torch.bfloat16 and last.dtype == torch.float32
    h_ref, _ = block_scan(A.bfloat16().double(), b.bfloat16().double(), h0.bfloat16().double(), backend="reference")
    assert_rel_close(h.double(), h_ref, 2e-2, "bf16 chunked vs fp64 on the same rounded inputs")


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("op", ["block", "jordan"])
def test_chunked_saved_memory_is_linear_in_T(op):
    """The chunked path's autograd graph saves O(T) bytes (4x the length, <= 4.5x the bytes), and the
    backward runs and matches the reference at the shorter length (covered above)."""
    N, m, C = 2, 4, 16

    def run(T):
        if op == "block":
            A, b, h0 = _dense_inputs(1, T, N, m)
            A.requires_grad_()
            return _saved_bytes(lambda: block_scan(A, b, h0, chunk_size=C, backend="torch"))
        lam, c, b, h0 = _jordan_inputs(1, T, N, m, "N")
        lam.requires_grad_()
        return _saved_bytes(lambda: jordan_scan(lam, c, b, h0, chunk_size=C, backend="torch"))

    small, _ = run(256)
    large, (h, _) = run(1024)
    assert large <= 4.5 * small, f"saved bytes grow {large / small:.2f}x for 4x the length"
    h.sum().backward()


def test_bad_inputs_raise_clear_errors():
    A, b, h0 = _dense_inputs(1, 5, 2, 3)
    with pytest.raises(ValueError, match="A must be"):
        block_scan(A[..., :2], b)
    with pytest.raises(ValueError, match="initial_state"):
        block_scan(A, b, h0[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        block_scan(A, b, chunk_size=0)
    lam, c, b, h0 = _jordan_inputs(1, 5, 2, 3, "N")
    with pytest.raises(ValueError, match="does not broadcast"):
        jordan_scan(lam, torch.ones(3), b)
    with pytest.raises(ValueError, match="lam must be"):
        jordan_scan(lam[:, :4], c, b)
    with pytest.raises(ValueError, match="weight"):
        jordan_scan_normed(lam, c, b, torch.ones(4), torch.zeros(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        jordan_step(lam[:, 0], torch.ones(3), b[:, 0], h0)
    with pytest.raises(ValueError, match="m >= 2"):
        jordan_scan_normed(lam, c, b[..., :1], torch.ones(1), torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 4, 5])
def test_triton_bf16_at_real_size_matches_chunked(m):
    """On a GPU: bf16 inputs at a real size, the fused kernels against the chunked path in fp32."""
    B, T, N = 2, 2048, 64
    A, b, h0 = _dense_inputs(B, T, N, m)
    tri = [x.bfloat16().requires_grad_() for x in (A, b, h0)]
    ref = [x.bfloat16().float().requires_grad_() for x in (A, b, h0)]
    h, last = block_scan(*tri[:2], tri[2], backend="triton")
    h_r, last_r = block_scan(*ref[:2], ref[2], chunk_size=64, backend="torch")
    assert h.dtype == torch.bfloat16
    assert_rel_close(h.float(), h_r, 2e-2, "bf16 triton block_scan")
    g = torch.randn_like(h_r)
    (h.float() * g).sum().backward()
    (h_r * g).sum().backward()
    for x, r, name in zip(tri, ref, ("A", "b", "h0")):
        assert_rel_close(x.grad.float(), r.grad, 3e-2, f"bf16 triton grad {name}")

    lam, c, bj, hj = _jordan_inputs(B, T, N, m, "N")
    w, bias = 1 + 0.3 * torch.randn(N, m, device=DEVICE), 0.3 * torch.randn(N, m, device=DEVICE)
    h, _ = jordan_scan(lam.bfloat16(), c.bfloat16(), bj.bfloat16(), hj.bfloat16(), backend="triton")
    h_r, _ = jordan_scan(lam.bfloat16().float(), c.bfloat16().float(), bj.bfloat16().float(),
                         hj.bfloat16().float(), backend="torch")
    assert_rel_close(h.float(), h_r, 2e-2, "bf16 triton jordan_scan")
    h, _ = jordan_scan_normed(lam[:, :256], c, bj[:, :256], w, bias, initial_state=hj, backend="triton")
    h_r, _ = jordan_scan_normed(lam[:, :256].double(), c.double(), bj[:, :256].double(), w.double(),
                                bias.double(), initial_state=hj.double(), backend="reference")
    assert_rel_close(h, h_r, 1e-4, "fp32 triton jordan_scan_normed")


BF16_U = 2.0 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 16])
def test_triton_bf16_at_layer_size_matches_fp64_reference(m):
    """On a GPU: bf16 inputs at one layer's size (d_model 1024 in blocks of m, T 4096: 64 chunks), the
    chunk-parallel kernels against the fp64 token loop on the same rounded inputs. Tolerances derived as for
    fp16 above with bf16's unit roundoff u = 2^-8: 2u forward, 4u gradients, 8u for the normed scan's."""
    B, T, N = 1, 4096, 1024 // m
    A, b, h0 = (x.bfloat16() for x in _dense_inputs(B, T, N, m))
    compare_backends(lambda A, b, h0: block_scan(A, b, h0, chunk_size=64, backend="triton"),
                     lambda A, b, h0: block_scan(A, b, h0, backend="reference"), [A, b, h0],
                     tol=2 * BF16_U, grad_tol=4 * BF16_U)
    if m != 4:
        return
    lam, c, b, h0 = (x.bfloat16() for x in _jordan_inputs(B, T, N, m, "N"))
    compare_backends(lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, chunk_size=64, backend="triton"),
                     lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend="reference"), [lam, c, b, h0],
                     tol=2 * BF16_U, grad_tol=4 * BF16_U)
    w, bias = (1 + 0.1 * torch.randn(N, m, device=DEVICE)).bfloat16(), (0.1 * torch.randn(N, m, device=DEVICE)).bfloat16()
    short = [x[:, :1024] for x in (lam, b)]
    compare_backends(lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, initial_state=h0,
                                                                     backend="triton"),
                     lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, initial_state=h0,
                                                                     backend="reference"),
                     [short[0], c, short[1], w, bias, h0], tol=2 * BF16_U, grad_tol=8 * BF16_U)
