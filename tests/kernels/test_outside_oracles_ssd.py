"""Mamba-2 SSD (``kernels.ssd.ssd``) against flash-linear-attention's simple-GLA recurrence (an oracle nobody here
wrote), values and gradients, on every backend that runs here (Triton through the interpreter on a CPU).

SSD (Dao & Gu, "Transformers are SSMs", arXiv:2405.21060) is simple GLA with ``q = C``, ``k = B``, ``v = dt x``,
log decay ``g = dt A`` and no scale; fla's ``naive_recurrent_simple_gla`` keeps a ``(B, H, K, V) = (B, H, N, P)``
state, the layout of ours, and computes in fp32. Mamba-2's skip ``D_h x_t`` is added to the oracle's output.
The existing comparison (tests/kernels/test_ssd.py) is forward only, without ``D``, on the torch and Triton
backends; mamba-ssm's ``ssd_minimal_discrete`` is a second oracle there when mamba-ssm is installed.

Tolerance (relative Frobenius error): fp32 against the oracle in fp32, T 37 with chunks of 16. Measured up to
2.3e-7 for ``y``, the final state and the gradients of x, dt, B, C, D and the initial state; the gradient of
``A`` (one number per head, a sum over every token, which can cancel) measured up to 9e-7. Tolerance 2e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.ssd import ssd
from tests.kernels.harness import TRITON_ON_CPU, compare_backends

TOL = 2e-5


def _inputs(b, T, H, P, N):
    x = torch.randn(b, T, H, P)
    dt = F.softplus(torch.randn(b, T, H) - 1.0)
    A = -(torch.rand(H) * 2 + 0.5)
    B, C = torch.randn(b, T, H, N), torch.randn(b, T, H, N)
    h0 = torch.randn(b, H, N, P)
    D = torch.randn(H)
    return [x, dt, A, B, C, h0, D]


@pytest.mark.parametrize("backend", ["reference", "torch", TRITON_ON_CPU])
@pytest.mark.parametrize("skip", [False, True])
def test_ssd_matches_fla_naive_simple_gla(backend, skip):
    """``y``, the final state and the gradients of x, dt, A, B, C, the initial state (and D); B 2, T 37 (not a
    multiple of the chunk), P 8 != N 16."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    ins = _inputs(2, 37, 2, 8, 16)
    if not skip:
        ins.pop()

    def ours(x, dt, A, B, C, h0, *D):
        return ssd(x, dt, A, B, C, chunk_size=16, initial_state=h0, D=D[0] if D else None, backend=backend)

    def oracle(x, dt, A, B, C, h0, *D):
        y, S = naive.naive_recurrent_simple_gla(C, B, x * dt[..., None], dt * A, scale=1.0, initial_state=h0,
                                                output_final_state=True)
        return (y + D[0][:, None] * x if D else y), S

    compare_backends(ours, oracle, ins, tol=TOL, ref_dtype=torch.float32)
