"""GLA's Triton stages (kernels.gla.triton) on the shapes the basic tests leave out, against the fp64 token
recurrence: a value dimension wide enough for several row blocks of the state passes and several value
blocks of the output and chunk-backward kernels, and an initial state passed as a strided view.

Tolerance 1e-5 relative (fp32 with exact fp32 products; the module's own tests measure 1e-7..4e-7).
"""
from __future__ import annotations

import torch

from kernels.gla import gla, gla_reference
from kernels.gla.triton import chunk_bwd_config, output_config, state_config
from tests.kernels.harness import compare_backends, needs_triton

pytestmark = needs_triton


def _inputs(T, H, dk, dv):
    q, k = torch.randn(1, T, H, dk) / dk ** 0.5, torch.randn(1, T, H, dk) / dk ** 0.5
    v, g = torch.randn(1, T, H, dv), -torch.rand(1, T, H) * 0.5
    return q, k, v, g


def _triton(q, k, v, g, h0):
    return gla(q, k, v, g, chunk_size=16, initial_state=h0, backend="triton")


def _reference(q, k, v, g, h0):
    return gla_reference(q, k, v, g, initial_state=h0)


def test_several_row_and_value_blocks_match_the_recurrence():
    """d_v 72 at d_k 8: two row blocks of the state, three value blocks of the output and of the backward."""
    dk, dv = 8, 72
    _, BR, _ = state_config(dk, dv)
    _, BV_out, _ = output_config(dk, dv, fp32_operands=True)
    _, BV_bwd, _ = chunk_bwd_config(dk, dv, fp32_operands=True)
    assert dv > BR and dv > BV_out and dv > BV_bwd, "the shape must span several blocks"
    q, k, v, g = _inputs(20, 1, dk, dv)
    h0 = torch.randn(1, 1, dv, dk)
    compare_backends(_triton, _reference, [q, k, v, g, h0], tol=1e-5, grad_tol=2e-3)


def test_a_transposed_initial_state_is_read_by_its_strides():
    """An initial state that is the transpose of a ``(B, H, d_k, d_v)`` tensor: the output, the final state
    and every gradient as from its contiguous copy."""
    dk, dv = 8, 12
    q, k, v, g = _inputs(20, 2, dk, dv)
    h0 = torch.randn(1, 2, dk, dv).transpose(-1, -2)
    assert not h0.is_contiguous()

    def run(q, k, v, g, h0):
        assert not h0.is_contiguous()
        return _triton(q, k, v, g, h0)

    compare_backends(run, _reference, [q, k, v, g, h0], tol=1e-5)


def test_fp32_queries_with_fp16_keys_and_values_multiply_in_fp32():
    """Mixed input dtypes: the products take fp32 operands (no rounding of the fp32 queries or of the computed
    operands to fp16): the fp32 output and final state are as exact as from all-fp32 inputs (the gradients of
    the fp16 keys and values are rounded to fp16 once, rms 2.8e-4 relative: tolerance 2e-3 for the gradients)."""
    q, k, v, g = _inputs(20, 2, 16, 16)
    k, v = k.half(), v.half()
    h0 = torch.randn(1, 2, 16, 16)
    compare_backends(_triton, _reference, [q, k, v, g, h0], tol=1e-5, grad_tol=2e-3)
