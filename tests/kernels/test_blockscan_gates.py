"""BD-LRU's gates in one Triton kernel each way (:mod:`kernels.blockscan.gates`) against the PyTorch formula
(:func:`kernels.blockscan.softmax_gates_reference`) run in fp64: ``A``, ``b`` and the gradients of the logits
and values, for block sizes 1 to 5, logits and values read in place as column blocks of wider projections,
row counts that leave a program part-filled, fp32 and fp64 through the interpreter, fp16 against fp64, and
bf16 at a layer's size on a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels.blockscan import softmax_gates, softmax_gates_reference
from tests.kernels.harness import DEVICE, compare_backends, needs_triton

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run


def _inputs(B, T, N, m, dtype, device=DEVICE):
    """Logits and values as column blocks of wider projections (what the layer's fused projections give)."""
    width = N * m * (m + 1)
    logits = torch.randn(B, T, width + 7, dtype=dtype, device=device)[..., 3:3 + width]
    v = torch.randn(B, T, N * m + 5, dtype=dtype, device=device)[..., 2:2 + N * m]
    return logits, v


@pytest.mark.parametrize("B,T,N,m", [(2, 37, 3, 4), (1, 5, 7, 1), (2, 19, 2, 5), (1, 130, 1, 3)])
def test_triton_matches_the_formula(B, T, N, m):
    logits, v = _inputs(B, T, N, m, torch.float32)
    compare_backends(lambda z, x: softmax_gates(z, x, m, backend="triton"),
                     lambda z, x: softmax_gates_reference(z, x, m), [logits, v], tol=1e-6, grad_tol=1e-6)
    compare_backends(lambda z, x: softmax_gates(z, x, m, backend="triton"),
                     lambda z, x: softmax_gates_reference(z, x, m), [logits.double(), v.double()], tol=1e-13,
                     grad_tol=1e-13)


def test_outputs_are_what_the_scan_reads():
    logits, v = _inputs(2, 9, 3, 4, torch.float16)
    A, b = softmax_gates(logits, v, 4, backend="triton")
    assert A.shape == (2, 9, 3, 4, 4) and b.shape == (2, 9, 3, 4)
    assert A.is_contiguous() and b.is_contiguous() and A.dtype == b.dtype == torch.float32
    rows = torch.cat([A, (b / v.float().unflatten(-1, (3, 4)))[..., None]], -1)   # each row's m + 1 weights
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, 9, 3, 4, device=A.device), rtol=0, atol=1e-5)


def test_fp16_against_fp64():
    """fp16 logits and values (fp32 arithmetic, fp32 outputs): the outputs within fp32's rounding of the fp64
    formula on the same values; the gradients, stored in fp16, within its rounding."""
    logits, v = _inputs(2, 33, 4, 4, torch.float16)
    compare_backends(lambda z, x: softmax_gates(z, x, 4, backend="triton"),
                     lambda z, x: softmax_gates_reference(z, x, 4), [logits, v], tol=1e-6, grad_tol=2e-3)


def test_bad_shapes_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"expected logits \(\.\.\., N m \(m\+1\)\) and v \(\.\.\., N m\)"):
        softmax_gates(torch.randn(2, 3, 20), torch.randn(2, 3, 5), 4)


@pytest.mark.gpu
def test_bf16_at_layer_size_against_fp64():
    """BD-LRU at d_model 1024 (256 blocks of 4) and 16K tokens in bf16: fp32 outputs within fp32's rounding of
    the fp64 formula on the same values, the bf16 gradients within bf16's."""
    logits, v = _inputs(1, 16384, 256, 4, torch.bfloat16, device="cuda")
    compare_backends(lambda z, x: softmax_gates(z, x, 4, backend="triton"),
                     lambda z, x: softmax_gates_reference(z, x, 4), [logits, v], tol=1e-6, grad_tol=1e-2)
