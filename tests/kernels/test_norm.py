"""The row normalisations' Triton kernels (:mod:`kernels.norm`, the GPU path) against their PyTorch
formulas (``F.normalize``; ``RMSNorm(x)``, with and without ``* SiLU(z)``), values and gradients in fp32 and fp64 through the
interpreter, on contiguous inputs and on the strided views the mixers hand them (a column block of a wider
projection, heads in a heads-first layout), which are read in place."""
from __future__ import annotations

import pytest
import torch

from kernels.launch import counting
from kernels.norm import (
    gated_rms_norm,
    gated_rms_norm_reference,
    l2_normalize,
    l2_normalize_reference,
    rms_norm,
    rms_norm_reference,
)
from tests.kernels.harness import assert_rel_close, compare_backends, needs_triton, value_and_grads

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run
TOL = {torch.float32: 1e-6, torch.float64: 1e-13}


def _views(dtype):
    """name -> (B, T, H, D) tensor: contiguous, a column block of a wider matrix, heads-first."""
    wide = torch.randn(2, 9, 3 * 4 * 16, dtype=dtype)
    return {"contiguous": torch.randn(2, 9, 4, 16, dtype=dtype),
            "column block": wide[..., 16:16 + 4 * 16].unflatten(-1, (4, 16)),
            "heads first": torch.randn(2, 4, 9, 16, dtype=dtype).transpose(1, 2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "column block", "heads first"])
def test_l2_normalize(dtype, layout):
    x = _views(dtype)[layout]
    dy = torch.randn(x.shape, dtype=dtype)
    got = value_and_grads(lambda x: l2_normalize(x, backend="triton"), [x], dy)
    want = value_and_grads(l2_normalize_reference, [x], dy)
    for g, w in zip(got, want):
        assert_rel_close(g, w, TOL[dtype], layout)


def test_l2_normalize_zero_row_and_eps():
    """A zero row stays zero with gradient ``dy / eps`` (the clamp), as ``F.normalize``."""
    x = torch.randn(3, 5, 8)
    x[1, 2] = 0
    compare_backends(lambda x: l2_normalize(x, eps=1e-3, backend="triton"),
                     lambda x: l2_normalize_reference(x, eps=1e-3), [x], tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "column block", "heads first"])
def test_gated_rms_norm(dtype, layout):
    views = _views(dtype)
    x, z = views[layout], views["column block" if layout != "column block" else "heads first"]
    w, dy = torch.randn(16, dtype=dtype), torch.randn(x.shape, dtype=dtype)
    got = value_and_grads(lambda x, z, w: gated_rms_norm(x, z, w, eps=1e-5, backend="triton"), [x, z, w], dy)
    want = value_and_grads(lambda x, z, w: gated_rms_norm_reference(x, z, w, eps=1e-5), [x, z, w], dy)
    for g, w_ in zip(got, want):
        assert_rel_close(g, w_, TOL[dtype], layout)


def test_gated_rms_norm_wide_rows_and_one_launch_each_way():
    """Rows of 200 (a ragged block of 256), several programs' shares of the weight gradient summed."""
    x, z = torch.randn(3, 40, 200), torch.randn(3, 40, 200)
    w = torch.randn(200)
    with counting() as launches:
        compare_backends(lambda x, z, w: gated_rms_norm(x, z, w, backend="triton"), gated_rms_norm_reference,
                         [x, z, w], tol=1e-6)
    assert dict(launches) == {"norm._rms_fwd": 1, "norm._rms_bwd": 1}


@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_programs_walking_several_row_blocks(monkeypatch, gated):
    """At most 3 shares of the weight gradient: each program walks 11 blocks of 4 rows of 200 (123 rows, so the
    last program's last blocks are past the end), on a strided input and gate, in fp64 against the formulas."""
    import kernels.norm.triton as kt

    monkeypatch.setattr(kt, "_DW_SHARES", 3)
    wide = torch.randn(3, 41, 600, dtype=torch.float64)
    x, z = wide[..., 100:300], wide[..., 350:550]
    w, dy = torch.randn(200, dtype=torch.float64), torch.randn(3, 41, 200, dtype=torch.float64)
    if gated:
        fn, ref, ins = (lambda x, z, w: gated_rms_norm(x, z, w, backend="triton"), gated_rms_norm_reference,
                        [x, z, w])
    else:
        fn, ref, ins = lambda x, w: rms_norm(x, w, backend="triton"), rms_norm_reference, [x, w]
    with counting() as launches:
        got = value_and_grads(fn, ins, dy)
    assert launches["norm._rms_bwd"] == 1
    for what, g, w_ in zip(("y", "dx", "dz" if gated else "dw", "dw"), got, value_and_grads(ref, ins, dy)):
        assert_rel_close(g, w_, 1e-13, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "column block", "heads first"])
def test_rms_norm(dtype, layout):
    x = _views(dtype)[layout]
    w, dy = torch.randn(16, dtype=dtype), torch.randn(x.shape, dtype=dtype)
    got = value_and_grads(lambda x, w: rms_norm(x, w, eps=1e-5, backend="triton"), [x, w], dy)
    want = value_and_grads(lambda x, w: rms_norm_reference(x, w, eps=1e-5), [x, w], dy)
    for g, w_ in zip(got, want):
        assert_rel_close(g, w_, TOL[dtype], layout)


def test_rms_norm_in_a_model_is_one_launch_each_way_on_the_gpu_path():
    """The blocks' pre-norm (:class:`mixers.layers.RMSNorm`) takes the kernels on the GPU plan, with a 16-bit
    input (fp16 through the interpreter) within fp16 rounding of the fp64 formula, and the formula on a CPU."""
    from kernels.device import gpu_path_on_cpu
    from mixers.layers import RMSNorm

    norm = RMSNorm(200, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(200))
    x = torch.randn(3, 40, 200)
    with gpu_path_on_cpu(), counting() as launches:
        y = norm(x)
        y.backward(torch.randn_like(y))
    assert dict(launches) == {"norm._rms_fwd": 1, "norm._rms_bwd": 1}
    assert_rel_close(y.detach(), rms_norm_reference(x, norm.weight.detach(), 1e-5), 1e-6, "fp32")
    with counting() as launches:
        cpu = norm(x)
    assert dict(launches) == {} and torch.equal(cpu, rms_norm_reference(x, norm.weight, 1e-5))
    half = x.half()
    with gpu_path_on_cpu():
        y16 = norm(half)
    assert y16.dtype == torch.float16
    truth = rms_norm_reference(half.double(), norm.weight.detach().double(), 1e-5)
    assert_rel_close(y16.double(), truth, 2e-3, "fp16")


@pytest.mark.gpu
def test_rms_norms_in_bf16_at_real_size():
    """bf16 rows of 1024 (a model's width), values and gradients within bf16 rounding of the fp64 formulas."""
    x, z, dy = (torch.randn(4, 2048, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(1024, device="cuda")
    cases = [(lambda x, w: rms_norm(x, w, backend="triton"), rms_norm_reference, [x, w]),
             (lambda x, z, w: gated_rms_norm(x, z, w, backend="triton"), gated_rms_norm_reference, [x, z, w])]
    for fast, formula, inputs in cases:
        got = value_and_grads(fast, inputs, dy)
        want = value_and_grads(formula, [t.double() for t in inputs], dy.double())
        for g, w_ in zip(got, want):
            assert_rel_close(g.double(), w_, 1e-2, "bf16")
