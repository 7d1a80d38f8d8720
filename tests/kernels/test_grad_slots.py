"""kernels.grad_slots: a split whose backward finds its parts' gradients already in place, against the plain split
(``torch.split``, whose backward concatenates) on the same random cotangents."""
import gc

import pytest
import torch

from kernels import grad_slots
from kernels.grad_slots import empty_grad, split_in_place
from tests.kernels.harness import needs_triton
from tests.mixers.launches import count_launches


class _Scale(torch.autograd.Function):
    """``2 x``, whose backward writes ``dx`` into :func:`empty_grad` (a consumer that asks for its slot)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = empty_grad(x)
        dx.copy_(2 * dy)
        return dx


def _grads(split, consume, y, cotangents):
    parts = split(y)
    outs = consume(parts)
    return torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cotangents)), y)[0]


def test_parts_written_in_place_are_not_copied_again():
    """The first part's consumer writes into its slot (read as the (B, T, H, K) view a mixer makes of it), the
    second's gradient comes from plain operators and is copied in, the third gets none and is zero-filled: the
    gradient equals the concatenation's, with one copy and no concatenation."""
    y = torch.randn(2, 5, 24, requires_grad=True)
    sizes = [8, 12, 4]
    cot = [torch.randn(2, 5, 2, 4), torch.randn(2, 5, 12)]

    def consume(parts):
        return [_Scale.apply(parts[0].unflatten(-1, (2, 4))), parts[1].sin()]

    want = _grads(lambda t: t.split(sizes, -1), consume, y, cot)
    got = []
    _, ops = count_launches(lambda: got.append(_grads(lambda t: split_in_place(t, sizes), consume, y, cot)))
    assert torch.equal(got[0], want)
    assert ops["aten::copy_"] == 2 and not ops["aten::cat"]      # _Scale's own copy_, and the sine's part
    assert not grad_slots._registry                               # the split's backward dropped its tensor


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 1)])
def test_a_slot_read_through_a_view_of_size_one_dimensions_is_not_copied_onto_itself(shape):
    """With batch 1 and one token the consumer's view of its slot has other strides on its size-1 dimensions than
    the split's part: still the same elements, never copied onto themselves (copy_ refuses overlapping memory)."""
    y = torch.randn(*shape, 24, requires_grad=True)
    sizes = [8, 16]
    cot = [torch.randn(*shape, 2, 4), torch.randn(*shape, 16)]

    def consume(parts):
        return [_Scale.apply(parts[0].unflatten(-1, (2, 4))), parts[1].sin()]

    want = _grads(lambda t: t.split(sizes, -1), consume, y, cot)
    assert torch.equal(_grads(lambda t: split_in_place(t, sizes), consume, y, cot), want)


def test_one_slot_per_region_and_whole_rows_only():
    """Two consumers of one part: the first gets the slot, the second allocates its own, and autograd's sum of the
    two is what arrives; a view of some rows only, or of every other column, gets no slot."""
    y = torch.randn(3, 16, requires_grad=True)
    a, b = split_in_place(y, [10, 6])
    assert grad_slots.grad_slot(a[1:]) is None and grad_slots.grad_slot(a[:, ::2]) is None
    first, second = grad_slots.grad_slot(a), grad_slots.grad_slot(a)
    assert first is not None and first.shape == a.shape and first.stride() == a.stride() and second is None
    assert grad_slots.grad_slot(b.unflatten(-1, (2, 3))) is not None        # the other part's columns, free
    del a, b, first
    gc.collect()

    y = torch.randn(3, 16, requires_grad=True)
    cot = [torch.randn(3, 10), torch.randn(3, 10)]
    want = _grads(lambda t: t.split([10, 6], -1), lambda p: [_Scale.apply(p[0]), _Scale.apply(p[0])], y, cot)
    got = _grads(lambda t: split_in_place(t, [10, 6]), lambda p: [_Scale.apply(p[0]), _Scale.apply(p[0])], y, cot)
    assert torch.equal(got, want)


def test_a_graph_freed_without_its_backward_leaves_no_registration():
    y = torch.randn(4, 8, requires_grad=True)
    parts = split_in_place(y, [3, 5])
    assert grad_slots._registry
    del parts
    gc.collect()
    assert grad_slots.grad_slot(torch.randn(4, 8)) is None
    assert all(ref() is None for refs in grad_slots._registry.values() for ref in refs)


@pytest.mark.parametrize("why", ["no_grad", "not_contiguous"])
def test_without_autograd_or_contiguity_a_plain_split(why):
    y = torch.randn(6, 4, requires_grad=True)
    if why == "no_grad":
        with torch.no_grad():
            parts = split_in_place(y, [1, 3])
    else:
        parts = split_in_place(y.t(), [2, 4])
    assert all(p.grad_fn is None or "Split" in type(p.grad_fn).__name__ for p in parts)
    assert not [ref for refs in grad_slots._registry.values() for ref in refs if ref() is not None]


@needs_triton
def test_the_norm_kernels_write_their_input_gradients_in_place():
    """The q/k normalisation and the output norm's gate read their parts of a split tensor in place and write
    their gradients into its slots (at the parts' strides): the gradient equals the formulas' through a plain
    split, and only the third part (read by plain operators) is copied in."""
    from kernels.norm import gated_rms_norm, gated_rms_norm_reference, l2_normalize, l2_normalize_reference

    y = torch.randn(2, 7, 3 * 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64)
    cot = [torch.randn(2, 7, 2, 16, dtype=torch.float64), torch.randn(2, 7, 2, 16, dtype=torch.float64),
           torch.randn(2, 7, 32, dtype=torch.float64)]

    def consume(l2, gated):
        def run(parts):
            qk, z, rest = parts[0].unflatten(-1, (2, 16)), parts[1].unflatten(-1, (2, 16)), parts[2]
            o = torch.ones(2, 7, 2, 16, dtype=torch.float64)
            return [l2(qk), gated(o, z, w), rest.tanh()]
        return run

    want = _grads(lambda t: t.split([32, 32, 32], -1),
                  consume(l2_normalize_reference, gated_rms_norm_reference), y, cot)
    got = []
    fast = consume(lambda x: l2_normalize(x, backend="triton"),
                   lambda x, z, w: gated_rms_norm(x, z, w, backend="triton"))
    _, ops = count_launches(lambda: got.append(_grads(lambda t: split_in_place(t, [32, 32, 32]), fast, y, cot)))
    torch.testing.assert_close(got[0], want, rtol=1e-12, atol=1e-12)
    assert ops["aten::copy_"] == 1 and not ops["aten::cat"]


def test_a_retained_graph_runs_its_backward_twice():
    """The first backward writes in place and drops the registration; a second one through the retained graph
    gets no slot and concatenates: both give the plain split's gradient."""
    y = torch.randn(2, 3, 12, requires_grad=True)
    cot = [torch.randn(2, 3, 4)]
    want = _grads(lambda t: t.split([4, 8], -1), lambda p: [_Scale.apply(p[0])], y, cot)
    out = _Scale.apply(split_in_place(y, [4, 8])[0])
    loss = (out * cot[0]).sum()
    first = torch.autograd.grad(loss, y, retain_graph=True)[0].clone()
    second = torch.autograd.grad(loss, y)[0]
    assert torch.equal(first, want) and torch.equal(second, want)
