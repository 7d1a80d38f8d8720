"""The block scans' Triton kernels (kernels.blockscan.triton, .gates) on what the basic tests leave out, against
the fp64 token recurrences and the fp64 softmax formula: more blocks than one program's tile (several
programs along the block axis, in every pass), the normed scan's own ``eps``, a transition whose last two axes
are not packed, an upstream gradient that is a strided view, and softmax logits far beyond ``exp``'s range.
"""
from __future__ import annotations

import pytest
import torch

from kernels.blockscan import block_scan, jordan_scan, jordan_scan_normed, softmax_gates, softmax_gates_reference
from kernels.blockscan.triton import _ChunkPlan, _normed_tile
from tests.kernels.harness import DEVICE, assert_rel_close, compare_backends, needs_triton

pytestmark = needs_triton


def _dense(B, T, N, m):
    """Rows of ``A`` with absolute sums in (0.5, 1): spectral radius at most 1."""
    sign = torch.randint(0, 2, (B, T, N, m, m), device=DEVICE).float() * 2 - 1
    scale = 0.5 + 0.5 * torch.rand(B, T, N, m, 1, device=DEVICE)
    A = sign * torch.softmax(torch.randn(B, T, N, m, m, device=DEVICE), -1) * scale
    return A, torch.randn(B, T, N, m, device=DEVICE), torch.randn(B, N, m, device=DEVICE)


def _jordan(B, T, N, m):
    lam = 0.05 + 0.9 * torch.rand(B, T, N, device=DEVICE)
    c = torch.rand(B, T, N, device=DEVICE) - 0.5
    return lam, c, torch.randn(B, T, N, m, device=DEVICE), torch.randn(B, N, m, device=DEVICE)


@pytest.mark.parametrize("N,m", [(10, 8), (3, 17)])
def test_scans_over_several_block_tiles_match_the_recurrence(N, m):
    """N above the blocks of a program: (10, 8) in the chunk-local and carry passes, (3, 17) in the rerun
    passes (and the carry) too."""
    plan = _ChunkPlan(11, N, m, 4)
    assert min(plan.bn_local, plan.bn_carry) < N and (m < 16 or plan.bn_run < N)
    A, b, h0 = _dense(1, 11, N, m)
    compare_backends(lambda A, b, h0: block_scan(A, b, h0, chunk_size=4, backend="triton"),
                     lambda A, b, h0: block_scan(A, b, h0, backend="reference"), [A, b, h0], tol=2e-5)
    lam, c, b, h0 = _jordan(1, 11, N, m)
    compare_backends(lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, chunk_size=4, backend="triton"),
                     lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend="reference"), [lam, c, b, h0],
                     tol=2e-5)


def _normed_case(N, m, eps):
    lam, c, b, h0 = _jordan(1, 9, N, m)
    weight = 1 + 0.3 * torch.randn(N, m, device=DEVICE)
    bias = 0.3 * torch.randn(N, m, device=DEVICE)
    # a per-token coupling (no cancelling sum over tokens); the norm's rounding varies by draw (rounding_factor)
    compare_backends(
        lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, eps=eps, initial_state=h0, backend="triton"),
        lambda lam, c, b, w, bi, h0: jordan_scan_normed(lam, c, b, w, bi, eps=eps, initial_state=h0,
                                                        backend="reference"),
        [lam, c, b, weight, bias, h0], tol=2e-5, grad_tol=5e-5, rounding_factor=4)


def test_normed_scan_over_several_programs_matches_the_recurrence():
    N, m = 5, 8
    _, bn, _ = _normed_tile(N, m)
    assert bn < N
    _normed_case(N, m, 1e-5)


def test_normed_scan_uses_the_eps_it_is_given():
    """An eps comparable to the pre-norm variance changes every state: the kernel must take the caller's."""
    _normed_case(2, 4, 0.5)


def test_block_scan_reads_a_transition_with_strided_inner_axes():
    """``A`` the transpose of a packed tensor in its last two axes: the scan of ``A``, not of ``A^T``."""
    At, b, h0 = _dense(1, 9, 2, 3)
    A = At.transpose(-1, -2)

    def run(A, b, h0):
        assert not A.is_contiguous()
        return block_scan(A, b, h0, chunk_size=4, backend="triton")

    compare_backends(run, lambda A, b, h0: block_scan(A, b, h0, backend="reference"), [A, b, h0], tol=2e-5)


def _grads_from_a_transposed_loss(fn, inputs, weight):
    """Gradients of ``sum(h^T W)`` with ``h`` the states read as ``(B, N, T, m)``: the upstream gradient reaching
    the scan is a transposed (strided) view of ``W``."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    h, _ = fn(*xs)
    (h.transpose(1, 2) * weight.to(h.dtype)).sum().backward()
    return [x.grad for x in xs]


@pytest.mark.parametrize("scan", ["dense", "jordan", "normed"])
def test_a_strided_upstream_gradient_is_read_by_its_strides(scan):
    B, T, N, m = 2, 9, 2, 3
    if scan == "dense":
        inputs = list(_dense(B, T, N, m))
        op = lambda A, b, h0, backend: block_scan(A, b, h0, chunk_size=4, backend=backend)  # noqa: E731
    elif scan == "jordan":
        inputs = list(_jordan(B, T, N, m))
        op = lambda lam, c, b, h0, backend: jordan_scan(lam, c, b, h0, chunk_size=4, backend=backend)  # noqa: E731
    else:
        inputs = list(_jordan(B, T, N, m)) + [1 + 0.3 * torch.randn(N, m, device=DEVICE)]
        op = lambda lam, c, b, h0, w, backend: jordan_scan_normed(  # noqa: E731
            lam, c, b, w, torch.zeros(N, m, device=DEVICE), eps=0.5, initial_state=h0, backend=backend)
    weight = torch.randn(B, N, T, m, device=DEVICE)
    mine = _grads_from_a_transposed_loss(lambda *xs: op(*xs, backend="triton"), inputs, weight)
    truth = _grads_from_a_transposed_loss(lambda *xs: op(*xs, backend="reference"), [x.double() for x in inputs],
                                          weight.double())
    for i, (g, r) in enumerate(zip(mine, truth)):
        assert_rel_close(g, r, 5e-5, f"grad of input {i}")


def test_softmax_gates_take_logits_beyond_the_range_of_exp():
    """Logits near 200 (``exp`` overflows fp32 past 88): the softmax, invariant to a shift, is what the fp64
    formula gives."""
    B, T, N, m = 1, 5, 2, 3
    logits = torch.randn(B, T, N * m * (m + 1), device=DEVICE) + 200
    v = torch.randn(B, T, N * m, device=DEVICE)
    compare_backends(lambda z, x: softmax_gates(z, x, m, backend="triton"),
                     lambda z, x: softmax_gates_reference(z, x, m), [logits, v], tol=1e-6, grad_tol=1e-6)


@pytest.mark.parametrize("normed", [False, True])
def test_a_coupling_strided_along_the_blocks_is_read_by_its_strides(normed):
    """``c`` every other column of a wider tensor (its blocks two apart), forward and backward."""
    B, T, N, m = 2, 9, 3, 4
    lam, _, b, h0 = _jordan(B, T, N, m)
    c = (torch.rand(B, T, 2 * N, device=DEVICE) - 0.5)[..., ::2]
    assert c.stride(-1) == 2
    if normed:
        w, bias = 1 + 0.3 * torch.randn(N, m, device=DEVICE), 0.3 * torch.randn(N, m, device=DEVICE)

        def op(lam, c, b, h0, backend):
            return jordan_scan_normed(lam, c, b, w, bias, eps=0.5, initial_state=h0, backend=backend)
    else:
        def op(lam, c, b, h0, backend):
            return jordan_scan(lam, c, b, h0, chunk_size=4, backend=backend)

    def values_and_grads(backend, inputs, upstream):
        xs = [x.detach().requires_grad_() for x in inputs]     # views keep their strides
        outs = op(*xs, backend)
        grads = torch.autograd.grad(outs, xs, upstream)
        return [o.detach() for o in outs] + list(grads)

    upstream = [torch.randn(B, T, N, m, device=DEVICE), torch.randn(B, N, m, device=DEVICE)]
    got = values_and_grads("triton", [lam, c, b, h0], upstream)
    want = values_and_grads("reference", [x.double() for x in (lam, c, b, h0)], [u.double() for u in upstream])
    for name, a, r in zip(("h", "h_last", "d lam", "d c", "d b", "d h0"), got, want):
        assert_rel_close(a, r, 5e-5, name)
