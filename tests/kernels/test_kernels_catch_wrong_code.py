"""Checks aimed at kernel paths whose wrong versions the family tests let through: each test compares one path,
forward and gradients, against the family's fp64 token-by-token reference on fresh random inputs.

- GLA's ``torch`` backend with one query/key head shared by all value heads (the ``_SharedChunkReadout``
  path, whose backward is written by hand): the family's GLA tests check that layout on the Triton backend
  only. The gate gradient ``dG`` has a row term and a column term of ``W = dP * P``; a readout that drops the
  column term, or forgets the causal decay mask in ``dS``, leaves the forward unchanged.
- Triton causal attention with fewer queries than keys over several blocks (the key loop's upper bound).
"""
from __future__ import annotations

import torch

from kernels.attention import attention, attention_reference
from kernels.gla import gla, gla_reference
from tests.kernels.harness import compare_backends, needs_triton


def test_gla_torch_one_query_key_head_shared_by_the_value_heads_forward_and_gradients():
    """fp32 against the fp64 recurrence with every head's ``q``, ``k`` expanded from the shared one (so ``dq``,
    ``dk`` of the reference are the sums over the heads); T 37 with chunk 16 (a ragged last chunk), an initial
    state, the final state in the loss. Measured errors are ~1e-7; tolerance 1e-5."""
    B, T, H, dk, dv = 2, 37, 3, 8, 6
    q, k = torch.randn(B, T, 1, dk) / dk ** 0.5, torch.randn(B, T, 1, dk) / dk ** 0.5
    v, g = torch.randn(B, T, H, dv), -torch.rand(B, T, H) * 0.5
    h0 = torch.randn(B, H, dv, dk)

    def torch_path(q, k, v, g, h0):
        return gla(q, k, v, g, chunk_size=16, initial_state=h0, backend="torch")

    def reference(q, k, v, g, h0):
        return gla_reference(q.expand(-1, -1, H, -1), k.expand(-1, -1, H, -1), v, g, initial_state=h0)

    compare_backends(torch_path, reference, [q, k, v, g, h0], tol=1e-5)


@needs_triton
def test_triton_causal_attention_with_fewer_queries_than_keys_over_several_blocks():
    """Causal attention with ``TQ < TK`` aligns the queries to the end: query ``i`` sees keys ``j <= i + TK - TQ``.
    With several query and key blocks the last row of a query block needs keys past the block's diagonal, so a
    forward that stops its key loop one block early is wrong there; the corner-case tests use one block.
    fp32 against the fp64 reference, outputs and gradients; measured ~1e-7, tolerance 1e-5."""
    q = torch.randn(1, 37, 2, 16)
    k, v = torch.randn(1, 45, 2, 16), torch.randn(1, 45, 2, 16)
    compare_backends(lambda q, k, v: attention(q, k, v, causal=True, backend="triton"),
                     lambda q, k, v: attention_reference(q, k, v, causal=True), [q, k, v], tol=1e-5)
