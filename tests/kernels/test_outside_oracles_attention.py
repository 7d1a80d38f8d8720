"""Softmax attention (``kernels.attention.attention``) against flash-linear-attention's ``naive_parallel_attn``, a
second oracle nobody here wrote next to torch's SDPA (tests/kernels/test_attention.py), values and gradients on
every backend that runs here (Triton through the interpreter on a CPU).

fla 0.6.0's ``naive_parallel_attn(q, k, v, scale, window_size, causal)``, read from its source: time-first
``(B, T, H, .)``, query head ``h`` reading key/value head ``h // (H / Hkv)`` (grouped-query attention, as ours),
scale ``K ** -0.5`` by default, a causal mask for equally many queries and keys only, computed in its inputs'
dtype; it returns ``(output, max_logits)``.

Tolerance (relative Frobenius error): fp32 against the oracle in fp64. Measured up to 6e-7 for the output and
the gradients of q, k and v (T 37, head dim 16); tolerance 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import attention
from tests.kernels.harness import TRITON_ON_CPU, compare_backends

TOL = 1e-5


@pytest.mark.parametrize("backend", ["reference", "torch", TRITON_ON_CPU])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_matches_fla_naive_parallel_attn(backend, causal, kv_heads):
    """B 2, T 37, 4 query heads over ``kv_heads`` key/value heads, a scale other than the default."""
    naive = pytest.importorskip("fla.ops.attn.naive")
    B, T, H, D = 2, 37, 4, 16
    q = torch.randn(B, T, H, D)
    k, v = torch.randn(B, T, kv_heads, D), torch.randn(B, T, kv_heads, D)
    scale = float(torch.rand(())) * 0.5 + 0.05
    compare_backends(lambda q, k, v: attention(q, k, v, causal=causal, scale=scale, backend=backend),
                     lambda q, k, v: naive.naive_parallel_attn(q, k, v, scale=scale, causal=causal)[0],
                     [q, k, v], tol=TOL)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_attention_with_a_wider_value_head_matches_fla(backend):
    """A value head dim (24) other than the query's (8), which the flash kernels refuse; the default scale."""
    naive = pytest.importorskip("fla.ops.attn.naive")
    q, k, v = torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 24)
    compare_backends(lambda q, k, v: attention(q, k, v, backend=backend),
                     lambda q, k, v: naive.naive_parallel_attn(q, k, v)[0], [q, k, v], tol=TOL)
