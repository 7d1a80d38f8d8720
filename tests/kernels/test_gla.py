"""GLA's Triton backend (kernels.gla.triton): the chunk stages shared with GKA, against the fp64 token recurrence
and flash-linear-attention's naive recurrence, under the interpreter (fp32, fp16) and on a GPU (bf16).

Tolerances (relative Frobenius error against fp64 on the same, already rounded inputs):

- fp32: exact fp32 products; measured 1e-7..4e-7 for the output, the final state and every gradient (T 37, chunk
  16). Tolerance 1e-5.
- fp16: the outputs are rounded to fp16 once (rms relative error u / sqrt(3) = 2.8e-4, u = 2^-11) and every
  computed operand (decay-weighted keys and values, ``P``, ``dP``, the states) enters its product rounded to
  fp16 once, as in flash-linear-attention's kernels: measured 2e-4..4e-4. Tolerance 2e-3.
- GKA's two-piece stages in fp16, fp32 outputs: the ``(H, U)`` state pass measured 4e-8..5e-8 (one piece:
  6e-5..8e-5), the output from an fp32 query 1.4e-7..1.5e-7 (one piece: 3e-4). Tolerance 1e-5, which one
  piece fails.
- bf16 (GPU): u = 2^-8, rms 2.3e-3 after rounding the outputs; tolerance 1e-2 forward, 2e-2 gradients.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import BackendUnavailable, triton_importable, triton_usable_for
from kernels.gka.chunked import chunk_states
from kernels.gla import gla, gla_reference
from kernels.gla.chunked import gla_chunk_readout, gla_chunk_states
from tests.kernels.harness import assert_rel_close, compare_backends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    not (triton_importable() and triton_usable_for(torch.empty(0, device=DEVICE))),
    reason="triton cannot run here (no CUDA and no TRITON_INTERPRET=1)")


def inputs(B, T, H, dk, dv, dtype, heads_qk=None, device="cpu"):
    hq = H if heads_qk is None else heads_qk
    q, k = torch.randn(B, T, hq, dk) / dk ** 0.5, torch.randn(B, T, hq, dk) / dk ** 0.5
    v, g = torch.randn(B, T, H, dv), -torch.rand(B, T, H) * 0.5
    h0 = torch.randn(B, H, dv, dk)
    return [t.to(device, dtype) for t in (q, k, v, g)] + [h0.to(device)]


def run_triton(q, k, v, g, h0, C=16):
    return gla(q, k, v, g, chunk_size=C, initial_state=h0, backend="triton")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_matches_the_recurrence(dtype, tol):
    """Output, final state and the gradients of q, k, v, g and the initial state (the final state's too: the
    upstream gradient reaches it); T not a multiple of the chunk, d_k != d_v, d_k below the 16 of a tile."""
    T = 37 if dtype == torch.float32 else 48
    ins = inputs(1, T, 2, 12, 20, dtype)
    compare_backends(run_triton, lambda q, k, v, g, h0: gla_reference(q, k, v, g, initial_state=h0), ins, tol=tol)


def test_triton_one_query_key_head_shared_by_the_value_heads():
    ins = inputs(2, 40, 3, 16, 16, torch.float32, heads_qk=1)
    compare_backends(run_triton, lambda q, k, v, g, h0: gla_reference(q.expand_as(v), k.expand_as(v), v, g,
                                                                      initial_state=h0), ins, tol=1e-5)


def test_triton_matches_fla_naive_recurrence():
    """An oracle nobody here wrote: flash-linear-attention's naive_recurrent_simple_gla (state (K, V) layout)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    q, k, v, g, _ = inputs(1, 45, 2, 16, 16, torch.float32)
    o, U = gla(q, k, v, g, chunk_size=16, backend="triton")
    o_fla, S_fla = naive.naive_recurrent_simple_gla(q, k, v, g, scale=16 ** -0.5)
    assert_rel_close(o, o_fla, 1e-5, "gla triton vs fla")
    assert_rel_close(U.transpose(-1, -2), S_fla, 1e-5, "state vs fla")


def _heads_first(t, C):
    b, T, h = t.shape[:3]
    return t.reshape(b, T // C, C, h, *t.shape[3:]).movedim(3, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_pass_stage(dtype):
    """``state_pass`` against its references: GLA's ``U`` (:func:`gla_chunk_states`, one piece) and GKA's
    ``(H, U)`` pair (:func:`kernels.gka.chunked.chunk_states`, two pieces) from an initial state."""
    from kernels.gla import triton as stages
    C, d = 16, 16
    q, k, v, g, h0 = inputs(1, 48, 2, d, d, dtype)
    K, V = (_heads_first(t.double(), C) for t in (k, v))
    G = _heads_first(g.double(), C).cumsum(-1)
    op = stages.operand_code(k, v)
    starts, fin = stages.state_pass(k, v, g, h0, C, False, op, 1)
    U0, U = gla_chunk_states(K, V, G, h0.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert_rel_close(starts, U0, tol, "U chunk starts")
    assert_rel_close(fin, U, tol, "U final")
    H_init = torch.randn(1, 2, d, d).double() * 0.1
    init = torch.cat([H_init, h0.double()], dim=-2)
    starts, fin = stages.state_pass(k, v, g, init.float(), C, True, op, 2)
    H0, U0, H, U = chunk_states(K, V, G, H_init, h0.double())
    assert_rel_close(starts, torch.cat([H0, U0], dim=-2), 1e-5, "(H, U) chunk starts")
    assert_rel_close(fin, torch.cat([H, U], dim=-2), 1e-5, "(H, U) final")


def test_output_stage_from_an_fp32_query_in_two_pieces():
    """``output`` with GKA's settings (an fp32 query, two pieces of it and of the states, fp16 keys and values)
    against :func:`gla_chunk_readout` in fp64: the query is large and the readout must not round it once."""
    from kernels.gla import triton as stages
    C, d = 16, 16
    _, k, v, g, _ = inputs(1, 32, 2, d, d, torch.float16)
    x = torch.randn(1, 32, 2, d) * 30.0            # an fp32 query, far from 16-bit values
    starts = torch.randn(1, 2, 2, d, d)            # (B, H, n, d_v, d_k) chunk-start states
    o = stages.output(x, k, v, g, starts, 0.25, C, stages.operand_code(k, v), 2, 2, torch.float32)
    K, V, X = (_heads_first(t.double(), C) for t in (k, v, x))
    G = _heads_first(g.double(), C).cumsum(-1)
    ref = gla_chunk_readout(X * 0.25, K, V, G, starts.double())
    assert_rel_close(o, ref.movedim(1, 3).reshape(1, 32, 2, d), 1e-5, "output")


def test_dispatch():
    q, k, v, g, _ = inputs(1, 20, 1, 16, 16, torch.float32)
    with pytest.raises(BackendUnavailable, match="power of two"):
        gla(q, k, v, g, chunk_size=8, backend="triton")
    with pytest.raises(BackendUnavailable, match="fp64"):
        gla(*(t.double() for t in (q, k, v, g)), chunk_size=16, backend="triton")
    from kernels.device import gpu_path_on_cpu
    with gpu_path_on_cpu():   # auto on the GPU plan: triton where it can, the chunked path where it cannot
        o8, _ = gla(q, k, v, g, chunk_size=8)
        o16, _ = gla(q, k, v, g, chunk_size=16)
    assert_rel_close(o8, o16, 1e-5, "chunk 8 (torch) vs chunk 16 (triton)")


@pytest.mark.gpu
def test_bf16_real_size():
    B, T, H, d = 1, 2048, 4, 128
    ins = inputs(B, T, H, d, d, torch.bfloat16, device=DEVICE)
    compare_backends(lambda q, k, v, g, h0: gla(q, k, v, g, chunk_size=64, initial_state=h0, backend="triton"),
                     lambda q, k, v, g, h0: gla(q, k, v, g, chunk_size=64, initial_state=h0, backend="torch"),
                     ins, tol=1e-2, grad_tol=2e-2)
