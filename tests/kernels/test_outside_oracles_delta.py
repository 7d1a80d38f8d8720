"""The ``delta`` family against flash-linear-attention's own PyTorch functions (an oracle nobody here wrote),
values and gradients, on every backend that runs here (Triton through the interpreter on a CPU).

fla 0.6.0's conventions, read from its source: ``naive_recurrent_gated_delta_product(q, k, v, g, beta, scale,
...)`` and ``naive_chunk_gated_delta_rule(q, k, v, g, beta, ...)`` take the gate before ``beta``,
``naive_recurrent_gated_delta_rule(q, k, v, beta, g, ...)`` after it; all three are time-first ``(B, T, H, .)``
with a ``(B, H, K, V)`` state and compute in fp32 whatever their inputs. ``delta_rule_recurrence`` (the ungated
DeltaNet) is heads-first ``(B, H, T, .)`` with the scale fixed at ``K ** -0.5``; ``delta_rule_chunkwise`` also
has no initial state and needs ``T`` a multiple of its chunk. The gated chunked function is fla's UT-transform
algorithm, not a token loop: it checks our chunked form against a second chunked derivation.

Tolerances (relative Frobenius error, ``tests.kernels.harness.rel_err``): the oracles run in fp32, so the
comparison is fp32 against fp32. Measured for fp32 inputs (T 17-32, chunks 8 and 16): 9e-8..4.2e-7 for outputs,
final states and every gradient, on all three backends; tolerance 1e-5. fp16 inputs on the Triton backend (the
same fp16 values given to the oracle in fp32): products on rounded fp16 operands and an fp16 output, measured
3.5e-4..7.8e-4 over five draws; tolerance 3e-3.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.delta import delta_product, delta_rule
from tests.kernels.harness import TRITON_ON_CPU, compare_backends, needs_triton_on_cpu

BACKENDS = ["reference", "torch", TRITON_ON_CPU]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _inputs(B, T, H, K, V, n, gate, dtype=torch.float32):
    """Normalised keys (fla's kernels assume them), beta in (0, 2) (negative eigenvalues), a random state."""
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T * n, H, K), dim=-1)
    v = torch.randn(B, T * n, H, V)
    beta = 2 * torch.rand(B, T * n, H)
    s0 = torch.randn(B, H, K, V)
    g = F.logsigmoid(torch.randn(B, T, H) + 2) if gate else None
    return [t.to(dtype) for t in (q, k, v, beta)], g, s0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,gate", [(1, False), (1, True), (2, True), (3, False)])
def test_delta_product_matches_fla_naive_recurrence(backend, n, gate):
    """Output, final state and the gradients of q, k, v, beta, g and the initial state against
    ``naive_recurrent_gated_delta_product``: B 2, T 19 (not a multiple of the chunk), d_k != d_v, a scale
    other than the default."""
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    (q, k, v, beta), g, s0 = _inputs(2, 19, 2, 16, 8, n, gate)
    scale = float(torch.rand(())) + 0.1

    def ours(q, k, v, beta, s0, *g):
        return delta_product(q, k, v, beta, g=g[0] if g else None, num_householder=n, scale=scale, initial_state=s0,
                             chunk_size=16, backend=backend)

    def oracle(q, k, v, beta, s0, *g):
        return naive.naive_recurrent_gated_delta_product(q, k, v, g[0] if g else None, beta, scale, initial_state=s0,
                                                         output_final_state=True, num_householder=n)

    ins = [q, k, v, beta, s0] + ([g] if gate else [])
    compare_backends(ours, oracle, ins, tol=TOL[torch.float32], ref_dtype=torch.float32)


@needs_triton_on_cpu
def test_delta_product_fp16_triton_matches_fla_naive_recurrence():
    """fp16 inputs on the Triton kernels (tensor-core operands on a GPU, an fp32 state) against the oracle run in
    fp32 on the same fp16 values."""
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    n = 2
    (q, k, v, beta), g, s0 = _inputs(1, 24, 2, 16, 16, n, True, dtype=torch.float16)
    ours = lambda q, k, v, beta, g, s0: delta_product(q, k, v, beta, g=g, num_householder=n, initial_state=s0,
                                                      chunk_size=16, backend="triton")
    oracle = lambda q, k, v, beta, g, s0: naive.naive_recurrent_gated_delta_product(
        q, k, v, g, beta, 16 ** -0.5, initial_state=s0, output_final_state=True, num_householder=n)
    compare_backends(ours, oracle, [q, k, v, beta, g, s0], tol=TOL[torch.float16], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", [False, True])
def test_delta_rule_matches_fla_naive_recurrent_gated_delta_rule(backend, gate):
    """``naive_recurrent_gated_delta_rule`` (beta before g), with a scale and an initial state, gradients
    included (the existing comparison is forward only)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    (q, k, v, beta), g, s0 = _inputs(2, 21, 2, 16, 12, 1, gate)
    scale = float(torch.rand(())) + 0.1

    def ours(q, k, v, beta, s0, *g):
        return delta_rule(q, k, v, beta, g=g[0] if g else None, scale=scale, initial_state=s0, chunk_size=16,
                          backend=backend)

    def oracle(q, k, v, beta, s0, *g):  # fla's gated rule needs a gate: zero for none
        return naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g[0] if g else torch.zeros(beta.shape),
                                                      scale=scale, initial_state=s0, output_final_state=True)

    ins = [q, k, v, beta, s0] + ([g] if gate else [])
    compare_backends(ours, oracle, ins, tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_delta_rule_matches_fla_naive_chunk(backend):
    """fla's chunked UT-transform form (``naive_chunk_gated_delta_rule``, gate before beta, its own padding of a
    length that is not a multiple of its chunk of 16), with a scale and an initial state."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    (q, k, v, beta), g, s0 = _inputs(2, 27, 2, 16, 8, 1, True)
    scale = float(torch.rand(())) + 0.1
    ours = lambda q, k, v, beta, g, s0: delta_rule(q, k, v, beta, g=g, scale=scale, initial_state=s0, chunk_size=8,
                                                   backend=backend)
    oracle = lambda q, k, v, beta, g, s0: naive.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=16, scale=scale, initial_state=s0, output_final_state=True)
    compare_backends(ours, oracle, [q, k, v, beta, g, s0], tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_rule_matches_fla_deltanet_recurrence(backend):
    """The ungated DeltaNet of fla's ``delta_rule`` package (``delta_rule_recurrence``: heads first, scale
    ``K ** -0.5``), from an initial state."""
    naive = pytest.importorskip("fla.ops.delta_rule.naive")
    (q, k, v, beta), _, s0 = _inputs(2, 17, 3, 8, 12, 1, False)
    heads_first = lambda *ts: [t.transpose(1, 2) for t in ts]
    ours = lambda q, k, v, beta, s0: delta_rule(q, k, v, beta, initial_state=s0, chunk_size=16, backend=backend)

    def oracle(q, k, v, beta, s0):
        o, S = naive.delta_rule_recurrence(*heads_first(q, k, v, beta), initial_state=s0)
        return o.transpose(1, 2), S

    compare_backends(ours, oracle, [q, k, v, beta, s0], tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_delta_rule_matches_fla_deltanet_chunkwise(backend):
    """``delta_rule_chunkwise`` (fla's chunked DeltaNet: heads first, from a zero state, T a multiple of its
    chunk) against our chunk of another size."""
    naive = pytest.importorskip("fla.ops.delta_rule.naive")
    (q, k, v, beta), _, _ = _inputs(2, 32, 2, 8, 8, 1, False)
    heads_first = lambda *ts: [t.transpose(1, 2) for t in ts]
    ours = lambda q, k, v, beta: delta_rule(q, k, v, beta, chunk_size=8, backend=backend)

    def oracle(q, k, v, beta):
        o, S = naive.delta_rule_chunkwise(*heads_first(q, k, v, beta), chunk_size=16)
        return o.transpose(1, 2), S

    compare_backends(ours, oracle, [q, k, v, beta], tol=TOL[torch.float32], ref_dtype=torch.float32)
