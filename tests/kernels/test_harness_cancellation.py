"""The test harness's cancellation factor (how much a shared input's gradient cancels when it is summed over the
positions it is broadcast to), against a hand computation, also for an op one of whose outputs that input never
reaches (a final state that does not read the query): those outputs add nothing to its gradient."""
from __future__ import annotations

import torch

from tests.kernels.harness import cancellation


def _op(q, k):
    """``(sum_t q_t k_t, 2 k)``: the second output does not read ``q``."""
    return (q * k).sum(0), 2 * k


def test_the_cancellation_of_a_shared_input_leaves_out_outputs_it_never_reaches():
    T, d = int(torch.randint(2, 9, ())), int(torch.randint(1, 5, ()))
    q, k = torch.randn(1, d, dtype=torch.float64), torch.randn(T, d, dtype=torch.float64)
    upstream = [torch.randn(d, dtype=torch.float64), torch.randn(T, d, dtype=torch.float64)]
    terms = upstream[0] * k               # d/dq of <u, sum_t q_t k_t> at each broadcast position t
    expected = max(1.0, (terms.abs().sum(0).norm() / terms.sum(0).norm()).item())
    assert abs(cancellation(_op, [q, k], 0, (T, d), upstream) - expected) <= 1e-12 * expected
