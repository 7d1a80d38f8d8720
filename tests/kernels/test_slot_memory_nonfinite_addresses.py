"""Kronecker top-K addresses of logits that are not all finite (a NaN or an infinity in a factor, as a diverging
step produces): every backend returns real, distinct slot numbers in ``[0, d_p^U)`` (the memory kernels index
the slot memory with them, so a number outside it would read and write outside the memory), NaN weights for
those addresses (in every weighting mode, so the NaN reaches the loss instead of being hidden), and, for the
finite addresses beside them in the same call, the slots and weights of the materialised product distribution.

On a CPU the Triton kernels run through the interpreter (tests/conftest.py): tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from kernels.slots import kronecker_dense, kronecker_topk
from tests.kernels.harness import DEVICE, assert_rel_close, needs_triton

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
#: the interpreter computes with NumPy, which warns on the NaN arithmetic these inputs are about
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("renormalize,straight", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("U,dp,K", [(2, 4, 3), (3, 3, 5), (1, 6, 6)])
def test_nonfinite_logits_give_real_slots_and_nan_weights(backend, renormalize, straight, U, dp, K):
    M = dp ** U
    logits = torch.randn(4, 5, U, dp, device=DEVICE)
    bad = torch.zeros(4, 5, dtype=torch.bool, device=DEVICE)
    rows = torch.randperm(20)[:3].tolist()  # three different addresses
    for row, value in zip(rows, (float("nan"), float("inf"), float("-inf"))):
        b, t, u, d = row // 5, row % 5, int(torch.randint(0, U, ())), int(torch.randint(0, dp, ()))
        logits[b, t, u, d] = value
        bad[b, t] = value != float("-inf")  # one -inf logit is a zero probability: still a finite address
    idx, w = kronecker_topk(logits, K, renormalize=renormalize, straight_through=straight, backend=backend)
    assert idx.dtype == torch.int64 and ((idx >= 0) & (idx < M)).all(), f"slots outside [0, {M}): {idx[bad]}"
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all(), "a slot repeated within an address"
    assert torch.isnan(w[bad]).all(), "an address with a NaN probability got a weight that is not NaN"
    assert torch.isfinite(w[~bad]).all()
    # the finite addresses: the top-K of the materialised distribution
    p = kronecker_dense(logits.double(), 1.0)
    top = p.topk(K, dim=-1).values
    good = ~bad & torch.isfinite(p).all(-1)
    assert_rel_close(p.gather(-1, idx)[good], top[good], 1e-6, "selected probabilities")
    if not straight:
        want = top / top.sum(-1, keepdim=True) if renormalize else top
        assert_rel_close(w[good].double(), want[good], 1e-5, "weights")
