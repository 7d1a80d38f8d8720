"""The Kronecker top-K addressing kernels (kernels.slots.triton.kronecker_topk_triton) against the fp64 product
distribution materialised over all ``M = d_p^U`` slots (kernels.slots.kronecker_dense, a softmax per factor
and their outer product, independent of the search): the selection is a top-K of that distribution, best
first, with distinct slots; the weights are its entries at the selected slots (renormalised, or ``1/K``
straight through, as asked); the gradient of the logits is that of those entries (the selection passes none).

The reference takes the kernel's own selection, so a near tie between slots (products equal up to rounding,
which the fp32 search and the fp64 distribution may order differently) cannot make the comparison fail. An
exact tie (all-zero logits, repeated logits) goes to the lower slot number on both backends, as the stable
order of the dense distribution puts it: the CPU and the GPU select the same slots. fp32 and fp16 logits
run under the interpreter at tiny shapes, bf16 on a GPU at a layer's size; a strided slice of a wider
tensor (the layer's joint write-and-read logits) gives exactly what its contiguous copy gives.
"""
from __future__ import annotations

import pytest
import torch

from kernels.slots import kronecker_dense, kronecker_topk
from tests.kernels.harness import DEVICE, assert_rel_close, needs_triton

#: (U, d_p, K): one factor; K above d_p; K not a power of two; d_p not a power of two; K = M (every slot);
#: many candidates per factor
CASES = [(1, 7, 3), (2, 4, 5), (3, 4, 4), (3, 5, 2), (2, 2, 4), (4, 3, 20), (2, 8, 6)]
MODES = [(False, False), (True, False), (True, True), (False, True)]  # (renormalize, straight_through)


def check_against_dense(logits, K, tau, renormalize, straight, tol, grad_tol):
    """Run the Triton addressing on ``logits`` and compare it with the fp64 dense distribution of the same values
    (the module docstring); ``tol`` for the weights (computed in fp32 from exact inputs), ``grad_tol`` for the
    logits' gradient (returned in the logits' dtype)."""
    x = logits.detach().clone().requires_grad_()
    idx, w = kronecker_topk(x, K, tau, renormalize, straight, backend="triton")
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (*logits.shape[:-2], K)
    x64 = logits.detach().double().requires_grad_()
    dense = kronecker_dense(x64, tau)
    M = dense.shape[-1]
    assert ((idx >= 0) & (idx < M)).all()
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all(), "a slot selected twice"
    raw = torch.gather(dense, -1, idx)
    best = dense.detach().topk(K, dim=-1).values
    assert_rel_close(raw.detach().sum(-1), best.sum(-1), tol, "mass of the selection against the top-K")
    assert (raw.detach().diff(dim=-1) <= tol * best[..., :1]).all(), "not best first"
    ref = raw / raw.sum(-1, keepdim=True) if renormalize else raw
    if straight:
        ref = ref + (torch.full_like(ref, 1.0 / K) - ref).detach()
    assert_rel_close(w, ref, tol, "weights")
    up = torch.randn_like(ref)
    (w * up.float()).sum().backward()
    (ref * up).sum().backward()
    assert x.grad.dtype == logits.dtype
    assert_rel_close(x.grad, x64.grad, grad_tol, "gradient of the logits")


# fp32: a weight is a product of U softmax entries, each an exponential, a sum of d_p terms and a division,
# about U (d_p + 3) roundings of 2^-24 (< 2e-6 for these cases): 1e-5. The gradient adds the renormalisation's
# and each factor's softmax-Jacobian sums (cancelling differences of the same size): 1e-5.
@needs_triton
@pytest.mark.parametrize("U,dp,K", CASES)
@pytest.mark.parametrize("renormalize,straight", MODES)
def test_fp32_matches_the_dense_distribution(U, dp, K, renormalize, straight):
    tau = float(torch.rand(()) + 0.3)
    check_against_dense(torch.randn(3, 5, U, dp, device=DEVICE) * 2, K, tau, renormalize, straight, 1e-5, 1e-5)


# fp16 logits: the inputs are exact in fp32, so the weights carry the fp32 error above (1e-5); the gradient is
# rounded once to fp16 (u = 2^-11): 2u.
FP16_U = 2.0 ** -11


@needs_triton
@pytest.mark.parametrize("U,dp,K", [(3, 4, 4), (2, 8, 6), (4, 3, 20)])
def test_fp16_matches_the_dense_distribution(U, dp, K):
    logits = (torch.randn(2, 7, U, dp, device=DEVICE) * 2).half()
    check_against_dense(logits, K, 0.8, True, False, 1e-5, 2 * FP16_U)


@needs_triton
def test_a_strided_slice_gives_what_its_copy_gives():
    """The layer's joint logits: the write and read halves of the address columns of a wider tensor, read in
    place; equal, bit for bit, to the same call on a contiguous copy (weights and gradient)."""
    B, T, H, U, dp, K = 2, 6, 2, 3, 4, 4
    a = H * U * dp
    wide = torch.randn(B, T, 2 * a + 7, device=DEVICE) * 2
    strided = wide[..., :2 * a].unflatten(-1, (2, H, U, dp))
    assert not strided.is_contiguous()
    check_against_dense(strided, K, 1.0, True, False, 1e-5, 1e-5)
    up = torch.randn(B, T, 2, H, K, device=DEVICE)

    def run(logits, leaf):
        idx, w = kronecker_topk(logits, K, 1.0, True, backend="triton")
        (w * up).sum().backward()
        return idx, w.detach(), leaf.grad

    leaf = wide.clone().requires_grad_()
    i1, w1, g1 = run(leaf[..., :2 * a].unflatten(-1, (2, H, U, dp)), leaf)
    copy = strided.contiguous().requires_grad_()
    i2, w2, g2 = run(copy, copy)
    assert torch.equal(i1, i2) and torch.equal(w1, w2)
    assert torch.equal(g1[..., :2 * a].unflatten(-1, (2, H, U, dp)), g2) and not g1[..., 2 * a:].any()


def logits_with_exact_ties(rows: int, U: int, dp: int) -> torch.Tensor:
    """Address logits whose product distribution has exact ties, equal in any precision and order of
    multiplication: all-zero rows (the shifted write address of a first token), rows whose factors repeat
    two values (slots that differ in the repeated digits tie), and, at U = 2, rows whose two factors are
    equal (slot (i, j) ties with (j, i))."""
    logits = torch.randn(rows, U, dp, device=DEVICE)
    third = rows // 3
    logits[:third] = 0
    two_values = torch.randn(third, U, 2, device=DEVICE)
    logits[third:2 * third] = two_values.gather(-1, torch.randint(2, (third, U, dp), device=DEVICE))
    if U == 2:
        logits[2 * third:, 1] = logits[2 * third:, 0]
    return logits


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("U,dp,K", [(3, 4, 4), (2, 4, 16), (2, 5, 3), (4, 2, 16), (2, 8, 6)])
def test_an_exact_tie_goes_to_the_lower_slot(backend, U, dp, K):
    """Against the dense fp64 distribution: the selection is its top K, best first, up to rounding (1e-5, the
    fp32 error of the weights above) where products differ; where they are exactly equal (the ties this input
    makes, the same in any precision), the lower slot comes first and an unselected slot equal to a selected
    one is a higher slot. torch.topk on a CPU returns equal values in no such order."""
    logits = logits_with_exact_ties(600, U, dp)
    idx, _ = kronecker_topk(logits, K, backend=backend)
    dense = kronecker_dense(logits.double())
    chosen = dense.gather(-1, idx)
    assert (chosen[:, 1:] <= chosen[:, :-1] * (1 + 1e-5)).all(), "not best first"
    unchosen = torch.ones_like(dense, dtype=torch.bool).scatter(-1, idx, False)
    assert (dense.where(unchosen, -1.0).amax(-1) <= chosen.amin(-1) * (1 + 1e-5)).all(), "not the top K"
    equal_order = (chosen[:, 1:] != chosen[:, :-1]) | (idx[:, 1:] > idx[:, :-1])
    assert equal_order.all(), f"equal products out of slot order in {int((~equal_order).any(-1).sum())} rows"
    slot = torch.arange(dense.shape[-1], device=DEVICE)
    passed_over = (dense.unsqueeze(-2) == chosen.unsqueeze(-1)) & unchosen.unsqueeze(-2) & (slot < idx.unsqueeze(-1))
    assert not passed_over.any(), f"a lower slot of an equal product left out in {int(passed_over.any((-2, -1)).sum())} rows"


@needs_triton
def test_triton_refuses_fp64_and_auto_passes_it_over():
    logits = torch.randn(2, 3, 2, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(Exception, match="fp64"):
        kronecker_topk(logits, 3, backend="triton")
    from kernels.device import gpu_path_on_cpu
    with gpu_path_on_cpu():
        idx, w = kronecker_topk(logits, 3)
    assert w.dtype == torch.float64 and torch.equal(idx, kronecker_topk(logits, 3, backend="torch")[0])


@pytest.mark.gpu
@pytest.mark.parametrize("U,dp,K", [(3, 4, 4), (2, 16, 8)])
def test_bf16_at_layer_size_matches_the_dense_distribution(U, dp, K):
    """A layer's joint write-and-read logits (T 4096, 8 heads) in bf16. Weights in fp32 from exact inputs: 1e-5;
    the gradient rounded once to bf16 (u = 2^-8): 2u."""
    H = 8
    wide = (torch.randn(1, 4096, 2 * H * U * dp + 64, device="cuda") * 2).bfloat16()
    logits = wide[..., :2 * H * U * dp].unflatten(-1, (2, H, U, dp))
    check_against_dense(logits, K, 1.0, True, False, 1e-5, 2 * 2.0 ** -8)
