"""Long sequences in segments (``kernels.common.in_segments``): every chunked path that carries its state
from one segment of whole chunks to the next computes the same function as the token recurrence, with the
segment length set tiny here (``kernels.common.SEGMENT``) so that small inputs span several segments and end
in a ragged one; no intermediate it keeps for the backward grows with the length; and the mixers' chunk-size
independence contract check holds on the segmented paths, which equal the unsegmented ones at the mixer
level (outputs and parameter gradients) and keep the examples of a batch independent."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.common
from kernels.blockscan import block_scan, jordan_scan
from kernels.common import in_segments, segment_length
from kernels.delta import delta_product
from kernels.gka import gka, gka_reference
from kernels.gla import gla, gla_chunked, gla_reference
from kernels.slots import slot_memory, slot_memory_reference
from tests.kernels.harness import assert_rel_close, compare_backends
from tests.mixers.contract import check_chunk_size, has_option, make

F64 = torch.float64


@pytest.fixture
def tiny_segment(monkeypatch):
    """Segments of 16 steps (rounded down to whole chunks, at least one chunk)."""
    monkeypatch.setattr(kernels.common, "SEGMENT", 16)


def test_in_segments_carries_the_state_and_passes_none_through():
    x = torch.randn(2, 23, 3, dtype=F64)
    calls = []

    def running_sum(x, absent, s):  # prefix sums along time, the state is the running total
        calls.append(x.shape[1])
        assert absent is None
        out = s[:, None] + x.cumsum(1)
        return out, out[:, -1]

    out, s = in_segments(running_sum, (x, None), torch.zeros(2, 3, dtype=F64), 8)
    assert calls == [8, 8, 7]
    torch.testing.assert_close(out, x.cumsum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, x.sum(1), rtol=1e-12, atol=1e-12)
    calls.clear()
    in_segments(running_sum, (x, None), torch.zeros(2, 3, dtype=F64), 23)
    assert calls == [23]  # one call when the sequence fits one segment


def test_segment_length_is_whole_chunks(monkeypatch):
    monkeypatch.setattr(kernels.common, "SEGMENT", 100)
    assert segment_length(16) == 96 and segment_length(7) == 98 and segment_length(128) == 128
    assert segment_length(6, multiple=4) == 96  # a multiple of both


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_delta_product_in_segments_matches_reference(tiny_segment, n, gate):
    """Chunk 4: segments of 16 positions = 16 / n tokens for n = 1, 2 and 5 1/3 for n = 3 (a segment
    boundary inside a token's sub-steps); T = 13 tokens, ragged."""
    from tests.kernels.test_delta import make_inputs, ref_fn

    inputs = make_inputs(2, 13, 2, 6, 5, n, gate, dtype=F64)

    def fn(q, k, v, b, g, s0):
        return delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0, chunk_size=4, backend="torch")

    compare_backends(fn, ref_fn(n), inputs, tol=1e-10, grad_tol=1e-9)


@pytest.mark.parametrize("alpha", [False, True])
def test_gka_in_segments_matches_reference(tiny_segment, alpha):
    from tests.kernels.test_gka import make_inputs

    q, k, v, g, a = make_inputs(2, 37, 2, 6)
    kw = dict(num_iter=40, initial_state=(torch.eye(6, dtype=F64).expand(2, 2, 6, 6) * 0.5,
                                          torch.randn(2, 2, 6, 6, dtype=F64)))
    ins = [q, k, v, g] + ([a] if alpha else [])

    def run(fn, **extra):
        def call(q, k, v, g, a=None):
            o, (H, U) = fn(q, k, v, g, a, **kw, **extra)
            return o, H, U
        return call

    compare_backends(run(gka, chunk_size=8, backend="torch"), run(gka_reference), ins, tol=1e-8, grad_tol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_gla_in_segments_matches_reference(tiny_segment, shared):
    B, T, H, dk, dv = 2, 41, 3, 5, 4
    q = torch.randn(B, T, 1 if shared else H, dk, dtype=F64)
    k = torch.randn(B, T, 1 if shared else H, dk, dtype=F64)
    v = torch.randn(B, T, H, dv, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, H, dtype=F64) + 2)
    h0 = torch.randn(B, H, dv, dk, dtype=F64)

    def expand(q, k):
        return (q.expand(-1, -1, H, -1), k.expand(-1, -1, H, -1)) if shared else (q, k)

    compare_backends(lambda q, k, v, g, h0: gla_chunked(q, k, v, g, chunk_size=8, initial_state=h0),
                     lambda q, k, v, g, h0: gla_reference(*expand(q, k), v, g, initial_state=h0),
                     [q, k, v, g, h0], tol=1e-10, grad_tol=1e-9)


@pytest.mark.parametrize("op", ["block", "jordan"])
def test_block_scans_in_segments_match_reference(tiny_segment, op):
    from tests.kernels.test_blockscan import _dense_inputs, _jordan_inputs

    if op == "block":
        ins = list(_dense_inputs(2, 45, 3, 3, dtype=F64))
        compare_backends(lambda A, b, h0: block_scan(A, b, h0, chunk_size=4, backend="torch"),
                         lambda A, b, h0: block_scan(A, b, h0, backend="reference"), ins, tol=1e-11)
    else:
        ins = list(_jordan_inputs(2, 45, 3, 4, "N", dtype=F64))
        compare_backends(lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, chunk_size=4, backend="torch"),
                         lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend="reference"), ins, tol=1e-11)


def test_slot_memory_in_segments_matches_reference(tiny_segment):
    from tests.kernels.test_slots import _call, _inputs

    M = 12
    ins = _inputs(2, 39, 2, M, 3, 4, init=True, dtype=F64, device="cpu")
    compare_backends(_call(slot_memory, M, backend="torch", layout="dense", chunk_size=4),
                     _call(slot_memory_reference, M), ins, tol=1e-10, grad_tol=1e-9)


def _largest_saved(fn) -> int:
    """Elements of the largest tensor autograd saves while ``fn`` runs."""
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return largest[0]


def _family_runs():
    from tests.kernels.test_blockscan import _dense_inputs, _jordan_inputs
    from tests.kernels.test_delta import make_inputs as delta_inputs
    from tests.kernels.test_gka import make_inputs as gka_inputs
    from tests.kernels.test_slots import _inputs as slot_inputs

    def grad(*xs):
        return [x.requires_grad_() if x.is_floating_point() else x for x in xs]

    def _delta_product_of(xs):   # q, k, v, beta, g of two sub-steps a token
        return delta_product(*xs[:4], g=xs[4], num_householder=2, chunk_size=4, backend="torch")

    return {
        "deltaproduct": lambda T: _delta_product_of(grad(*delta_inputs(1, T, 2, 4, 4, 2, True)[:5])),
        "gka": lambda T: gka(*grad(*gka_inputs(1, T, 2, 4, dtype=torch.float32)), num_iter=4, chunk_size=4,
                             backend="torch"),
        "gla": lambda T: gla(*grad(torch.randn(1, T, 2, 4), torch.randn(1, T, 2, 4), torch.randn(1, T, 2, 4),
                                   -torch.rand(1, T, 2)), chunk_size=4, backend="torch"),
        "block": lambda T: block_scan(*grad(*_dense_inputs(1, T, 2, 3)), chunk_size=4, backend="torch"),
        "jordan": lambda T: jordan_scan(*grad(*_jordan_inputs(1, T, 2, 3, "N")), chunk_size=4, backend="torch"),
        "slots": lambda T: slot_memory(*grad(*slot_inputs(1, T, 2, 8, 2, 4, device="cpu")), 8, chunk_size=4,
                                       backend="torch", layout="dense"),
    }


@pytest.mark.parametrize("family", ["deltaproduct", "gka", "gla", "block", "jordan", "slots"])
def test_no_saved_intermediate_grows_with_the_length(tiny_segment, family):
    """Past a few segments, 4x the length does not enlarge the largest tensor kept for the backward (the
    inputs themselves are kept as per-segment views)."""
    run = _family_runs()[family]
    small, large = _largest_saved(lambda: run(64)), _largest_saved(lambda: run(256))
    assert large <= small, f"{family}: largest saved tensor grows {large / small:.2f}x for 4x the length"


SEGMENTED_MIXERS = ["bdlru", "deltanet", "deltaproduct", "gated_deltanet", "gka", "gla", "jordan", "kronecker_slots",
                    "mamba2"]


@pytest.mark.parametrize("name", SEGMENTED_MIXERS)
def test_mixer_chunk_size_independence_on_segmented_paths(monkeypatch, name):
    """The contract's chunk-size independence (chunk 1, 4, 16 against the default, T = 29) with segments of
    8 steps: every chunk size but the default runs in several segments."""
    monkeypatch.setattr(kernels.common, "SEGMENT", 8)
    check_chunk_size(name)


@pytest.mark.parametrize("name", SEGMENTED_MIXERS)
def test_mixer_segmented_equals_unsegmented_and_is_batch_independent(monkeypatch, name):
    """Chunk 4, T = 37: segments of 8 steps (five of them, the last ragged) against one segment, outputs and
    every parameter's gradient; then each example of the batch alone through the segmented path."""
    m = make(name, F64, **({"chunk_size": 4} if has_option(name, "chunk_size") else {}))
    x = torch.randn(3, 37, m.d_model, dtype=F64)
    dy = torch.randn(3, 37, m.d_model, dtype=F64)

    def run(segment):
        monkeypatch.setattr(kernels.common, "SEGMENT", segment)
        m.zero_grad(set_to_none=True)
        y = m(x)
        y.backward(dy)
        return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    y_one, g_one = run(1 << 20)
    y_seg, g_seg = run(8)
    assert_rel_close(y_seg, y_one, 1e-10, f"{name}: output")
    assert g_seg.keys() == g_one.keys()
    for n in g_one:
        assert_rel_close(g_seg[n], g_one[n], 1e-9, f"{name}: grad of {n}")
    with torch.no_grad():
        for i in range(3):
            assert_rel_close(m(x[i:i + 1]), y_seg[i:i + 1], 1e-10, f"{name}: example {i} alone")
