"""``kernels.gla.gla`` against flash-linear-attention's own PyTorch functions (an oracle nobody here wrote), values
and gradients, on every backend that runs here (Triton through the interpreter on a CPU).

fla 0.6.0's conventions, read from its source: ``naive_recurrent_simple_gla(q, k, v, g, scale, initial_state,
output_final_state)``, ``naive_chunk_simple_gla(q, k, v, g, initial_state, output_final_state, chunk_size,
scale)`` and ``naive_parallel_simple_gla(q, k, v, g, scale)`` (no state) take our scalar per-head log decay
``g (B, T, H)`` in natural log and time-first tensors; ``naive_recurrent_gla(q, k, v, gk, ...)`` takes a
per-channel decay ``gk (B, T, H, K)`` (ours broadcast over ``K``) with the scale fixed at ``K ** -0.5``;
``naive_recurrent_linear_attn`` has no decay (our ``g=None``). fla's states are ``(B, H, K, V)``, ours ``(B, H,
V, K)``: the test transposes them on the way in and out. All of them compute in fp32.

Tolerances (relative Frobenius error, ``tests.kernels.harness.rel_err``), fp32 against the oracle in fp32 (and
fp64 for ``naive_parallel_simple_gla``, which keeps its inputs' dtype): measured up to 3.8e-7 for outputs, final
states and every gradient (T 19-40, chunks 8 and 16) on all three backends; tolerance 1e-5. fp16 inputs on the
Triton backend against the oracle in fp32 on the same fp16 values (rounded operands, an fp16 output): measured
8e-5..4e-4; tolerance 3e-3.
"""
from __future__ import annotations

import pytest
import torch

from kernels.gla import gla
from tests.kernels.harness import TRITON_ON_CPU, compare_backends, needs_triton_on_cpu

BACKENDS = ["reference", "torch", TRITON_ON_CPU]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _inputs(B, T, H, dk, dv, heads_qk=None, dtype=torch.float32):
    hq = H if heads_qk is None else heads_qk
    q, k = torch.randn(B, T, hq, dk) / dk ** 0.5, torch.randn(B, T, hq, dk) / dk ** 0.5
    v, g = torch.randn(B, T, H, dv), -torch.rand(B, T, H) * 0.5
    U0 = torch.randn(B, H, dv, dk)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, U0]


def _ours(backend, scale=None, chunk_size=16):
    return lambda q, k, v, g, U0: gla(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=U0,
                                      backend=backend)


def _fla_state(fn):
    """An fla function taking and returning ``(K, V)`` states as one taking and returning our ``(V, K)``."""
    def wrapped(*args, initial_state, **kw):
        o, S = fn(*args, initial_state=initial_state.transpose(-1, -2), **kw)
        return o, S.transpose(-1, -2)
    return wrapped


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_matches_fla_naive_recurrent_simple_gla(backend):
    """Output, final state and the gradients of q, k, v, g and the initial state; B 2, T 37 (not a multiple of the
    chunk), d_k 12 != d_v 20, a scale other than the default (the existing comparison: forward only, no state)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    scale = float(torch.rand(())) + 0.1
    oracle = _fla_state(naive.naive_recurrent_simple_gla)
    compare_backends(_ours(backend, scale), lambda q, k, v, g, U0: oracle(q, k, v, g, scale=scale, initial_state=U0),
                     _inputs(2, 37, 2, 12, 20), tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_matches_fla_naive_chunk_simple_gla(backend):
    """fla's chunked form (its chunk 16, padding T 29), against our chunks of 8 (torch) or 16 (Triton's least)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    oracle = _fla_state(naive.naive_chunk_simple_gla)
    compare_backends(_ours(backend, chunk_size=16 if backend == "triton" else 8),
                     lambda q, k, v, g, U0: oracle(q, k, v, g, initial_state=U0, output_final_state=True,
                                                   chunk_size=16),
                     _inputs(1, 29, 3, 16, 8), tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_matches_fla_naive_parallel_simple_gla(backend):
    """The quadratic form ``(Q K^T * scale * e^{G_t - G_s}) V`` (no state), in fp64 as fla runs it in its inputs'
    dtype: the output and its gradients."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    q, k, v, g, _ = _inputs(2, 23, 2, 16, 16)
    scale = float(torch.rand(())) + 0.1
    compare_backends(lambda q, k, v, g: gla(q, k, v, g, scale=scale, chunk_size=16, backend=backend)[0],
                     lambda q, k, v, g: naive.naive_parallel_simple_gla(q, k, v, g, scale=scale)[0],
                     [q, k, v, g], tol=TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_matches_fla_naive_recurrent_gla_with_a_per_channel_decay(backend):
    """fla's GLA with a per-channel decay ``gk (B, T, H, K)``: ours is the same decay on every channel."""
    naive = pytest.importorskip("fla.ops.gla.naive")
    oracle = _fla_state(naive.naive_recurrent_gla)
    compare_backends(_ours(backend),
                     lambda q, k, v, g, U0: oracle(q, k, v, g.unsqueeze(-1).expand_as(k), initial_state=U0,
                                                   output_final_state=True),
                     _inputs(2, 21, 2, 16, 8), tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_without_decay_matches_fla_naive_linear_attention(backend):
    """``g=None`` is causal linear attention: fla's ``naive_recurrent_linear_attn`` (unnormalised), from a state."""
    naive = pytest.importorskip("fla.ops.linear_attn.naive")
    q, k, v, _, U0 = _inputs(2, 19, 2, 8, 12)
    scale = float(torch.rand(())) + 0.1
    oracle = _fla_state(naive.naive_recurrent_linear_attn)
    compare_backends(lambda q, k, v, U0: gla(q, k, v, None, scale=scale, chunk_size=16, initial_state=U0,
                                             backend=backend),
                     lambda q, k, v, U0: oracle(q, k, v, scale=scale, initial_state=U0, output_final_state=True),
                     [q, k, v, U0], tol=TOL[torch.float32], ref_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_one_query_key_head_shared_matches_fla(backend):
    """One query/key head serving every value head: the oracle gets them repeated, so the gradients of ``q`` and
    ``k`` are its sums over the heads (``k``'s tolerance scaled by their cancellation, as the harness does; the
    harness cannot measure it for ``q``, which does not reach the final state, and a sum of three random terms
    over the whole tensor cancels little)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    ins = _inputs(2, 20, 3, 16, 8, heads_qk=1)
    oracle = _fla_state(naive.naive_recurrent_simple_gla)
    full = tuple(ins[2].shape[:3]) + (16,)
    compare_backends(_ours(backend),
                     lambda q, k, v, g, U0: oracle(q.expand(full), k.expand(full), v, g, initial_state=U0),
                     ins, tol=TOL[torch.float32], ref_dtype=torch.float32, shared={1: full})


@needs_triton_on_cpu
def test_gla_fp16_triton_matches_fla_naive_recurrent_simple_gla():
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    oracle = _fla_state(naive.naive_recurrent_simple_gla)
    compare_backends(_ours("triton"), lambda q, k, v, g, U0: oracle(q, k, v, g, initial_state=U0),
                     _inputs(1, 40, 2, 16, 16, dtype=torch.float16), tol=TOL[torch.float16], ref_dtype=torch.float32)
