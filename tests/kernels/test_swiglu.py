"""The SwiGLU gate's Triton kernels (:mod:`kernels.swiglu`, the GPU path) against the fp64 PyTorch formula
``SiLU(a) * b``, values and gradients in fp32, fp64 and fp16 through the interpreter, on contiguous rows and
on a column block of a wider matrix read in place; and the SwiGLU state mixer on the GPU plan against its CPU
path, one launch each way."""
from __future__ import annotations

import pytest
import torch

from kernels.launch import counting
from kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.harness import assert_rel_close, needs_triton, value_and_grads

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run
TOL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("width,layout", [(5, "contiguous"), (300, "column block"), (48, "column block")])
def test_swiglu_matches_formula(dtype, width, layout):
    """Pre-activations out to +-12 (both tails of the sigmoid); 300 columns span two column blocks of 256."""
    wide = torch.randn(3, 7, 2 * width + 3, dtype=dtype) * 4
    h = wide[..., 3:] if layout == "column block" else wide[..., :2 * width].contiguous()
    assert h.is_contiguous() == (layout == "contiguous")
    dy = torch.randn(3, 7, width, dtype=dtype)
    with counting() as launches:
        y, dh = value_and_grads(lambda t: swiglu(t, backend="triton"), [h], dy)
    assert dict(launches) == {"swiglu._swiglu_fwd": 1, "swiglu._swiglu_bwd": 1}
    assert y.dtype == dh.dtype == dtype
    want_y, want_dh = value_and_grads(swiglu_reference, [h.double()], dy.double())
    assert_rel_close(y.double(), want_y, TOL[dtype], "value")
    assert_rel_close(dh.double(), want_dh, TOL[dtype], "gradient")


def test_bad_width_names_the_problem():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(4, 7))


def test_state_mixer_on_the_gpu_path_is_one_launch_each_way():
    """:class:`mixers.mlp.SwiGLU` on the GPU plan: the same output and gradients as its CPU path, with the
    gate one kernel each way; on a CPU no kernel."""
    from kernels.device import gpu_path_on_cpu
    from mixers import STATE_MIXERS

    cls = STATE_MIXERS.get("swiglu")
    mlp = cls(40, cls.Options())
    x, dy = torch.randn(2, 9, 40), torch.randn(2, 9, 40)
    results = []
    for gpu in (True, False):
        mlp.zero_grad()
        xg = x.clone().requires_grad_()
        with counting() as launches:
            if gpu:
                with gpu_path_on_cpu():
                    y = mlp(xg)
            else:
                y = mlp(xg)
            y.backward(dy)
        results.append(([y.detach(), xg.grad] + [p.grad.clone() for p in mlp.parameters()], dict(launches)))
    (gpu_out, gpu_launches), (cpu_out, cpu_launches) = results
    assert gpu_launches == {"swiglu._swiglu_fwd": 1, "swiglu._swiglu_bwd": 1} and cpu_launches == {}
    for got, want in zip(gpu_out, cpu_out):
        assert_rel_close(got, want, 1e-6, "gpu path")


@pytest.mark.gpu
def test_swiglu_in_bf16_at_real_size():
    """bf16 rows of a model's hidden width (2 x 2816 columns), values and gradients within bf16 rounding of
    the fp64 formula."""
    h = torch.randn(8, 2048, 2 * 2816, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(8, 2048, 2816, device="cuda", dtype=torch.bfloat16)
    y, dh = value_and_grads(lambda t: swiglu(t, backend="triton"), [h], dy)
    want_y, want_dh = value_and_grads(swiglu_reference, [h.double()], dy.double())
    assert_rel_close(y.double(), want_y, 1e-2, "bf16")
    assert_rel_close(dh.double(), want_dh, 1e-2, "bf16 gradient")
