"""The short convolution's Triton kernels (:mod:`kernels.shortconv`, the GPU path) against torch's
``conv1d`` (the reference), values and gradients of input, weight and bias, in fp32 and fp64 through the
interpreter; and the time-first layer (:func:`mixers.conv_time_first.causal_conv_time_first`) taking them on
the GPU plan, where it makes one launch forward and one backward at every length."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels.device import gpu_path_on_cpu
from kernels.launch import counting
from kernels.shortconv import causal_conv, causal_conv_reference
from mixers.conv_time_first import causal_conv_time_first
from tests.kernels.harness import assert_rel_close, compare_backends, needs_triton

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run


@pytest.mark.parametrize("T,C,k,activation,bias", [(37, 80, 4, True, True), (37, 80, 4, False, False),
                                                    (3, 20, 4, True, False), (70, 9, 2, False, True),
                                                    (5, 16, 1, True, True), (30, 24, 3, True, True),
                                                    (50, 20, 9, True, True)])
def test_triton_matches_conv1d(T, C, k, activation, bias):
    """Ragged tiles in time and channels (37 x 80 against the forward's 32 x 64 tiles), T shorter than the filter,
    filters of 1 to 4 taps (the backward pads them to 4; at T = 30 its last step of 4 rows holds the last row a
    token of the sequence needs) and a width-9 filter (the wide backward, a ring of 16 slots), with and without
    SiLU and bias."""
    x, w = torch.randn(2, T, C), torch.randn(C, k)
    ins = [x, w] + ([torch.randn(C)] if bias else [])

    def fn(x, w, b=None):
        return causal_conv(x, w, b, activation, backend="triton")

    def ref(x, w, b=None):
        return causal_conv_reference(x, w, b, activation)

    compare_backends(fn, ref, ins, tol=1e-6, grad_tol=1e-6)
    compare_backends(fn, ref, [t.double() for t in ins], tol=1e-13, grad_tol=1e-13)


@pytest.mark.parametrize("rows", [4, 8, 128])
def test_backward_programs_along_time(monkeypatch, rows):
    """The backward's programs along time each walk ``rows`` rows and sum their share of dw and db: 4 (as many as
    the filter's taps, so a program reads nearly as many rows past its end as its own), 8 (the last program's rows
    ragged) and 128 (one program walks the whole sequence); a strided input (a column block of a wider
    projection) is read in place."""
    import kernels.shortconv.triton as kt

    monkeypatch.setattr(kt, "_MIN_ROWS", rows)
    monkeypatch.setattr(kt, "_BWD_PROGRAMS", 10**9)          # no more rows than the least
    x = torch.randn(2, 75, 30, dtype=torch.float64)[..., 5:17]
    w, b, dy = (torch.randn(*shape, dtype=torch.float64) for shape in ((12, 4), (12,), (2, 75, 12)))
    results = []
    for fn in (lambda *a: causal_conv(*a, backend="triton"), causal_conv_reference):
        ins = [t.detach().requires_grad_() for t in (x, w, b)]             # the view keeps its strides
        y = fn(*ins)
        results.append([y.detach(), *torch.autograd.grad(y, ins, dy)])
    for what, got, want in zip(("y", "dx", "dw", "db"), *results):
        assert_rel_close(got, want, 1e-13, what)


def test_bad_shapes():
    with pytest.raises(ValueError, match="same C"):
        causal_conv(torch.randn(1, 4, 3), torch.randn(5, 4), None, backend="triton")


@pytest.mark.parametrize("T", [40, 100])
def test_gpu_plan_is_one_kernel_forward_and_one_backward(monkeypatch, T):
    """Time blocks of 64 elements: the CPU path runs several; the GPU plan one kernel forward and one backward,
    same values."""
    import mixers.conv_time_first as ctf

    monkeypatch.setattr(ctf, "_BLOCK_ELEMENTS", 64)
    x, w, b, dy = (torch.randn(*shape, dtype=torch.float64) for shape in ((2, T, 12), (12, 4), (12,), (2, T, 12)))
    results = []
    for gpu in (False, True):
        xs = [t.clone().requires_grad_() for t in (x, w, b)]
        with (gpu_path_on_cpu() if gpu else contextlib.nullcontext()), counting() as launches:
            y = causal_conv_time_first(*xs)
            y.backward(dy)
        assert sum(launches.values()) == (2 if gpu else 0)
        results.append([y.detach()] + [t.grad for t in xs])
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)


def _against_fp64(x, w, b, dy, tol):
    """Output and gradients of the Triton convolution (SiLU, bias) on low-precision inputs against the fp64
    reference on the same (rounded) values, each judged by its relative error."""
    ins = [t.detach().requires_grad_() for t in (x, w, b)]
    y = causal_conv(*ins, backend="triton")
    got = [y.detach(), *torch.autograd.grad(y, ins, dy)]
    ref_ins = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y_ref = causal_conv_reference(*ref_ins)
    want = [y_ref.detach(), *torch.autograd.grad(y_ref, ref_ins, dy.double())]
    for what, g, r in zip(("y", "dx", "dw", "db"), got, want):
        assert g.dtype == x.dtype, what
        assert_rel_close(g.double(), r, tol, what)


def test_fp16_against_fp64():
    """fp16 inputs (fp32 arithmetic inside): within fp16's rounding of each output."""
    C = 48
    x, dy = (torch.randn(2, 70, C).half() for _ in range(2))
    _against_fp64(x, (torch.randn(C, 4) / 2).half(), torch.randn(C).half(), dy, 2e-3)


@pytest.mark.gpu
def test_bf16_at_layer_size_against_fp64():
    """Gated DeltaNet's q/k/v convolution at d_model 1024 and 16K tokens in bf16 (several time tiles per
    program, 48 channel blocks): within bf16's rounding of each output."""
    C = 3072
    x, dy = (torch.randn(1, 16384, C, device="cuda").bfloat16() for _ in range(2))
    _against_fp64(x, (torch.randn(C, 4, device="cuda") / 2).bfloat16(), torch.randn(C, device="cuda").bfloat16(),
                  dy, 1e-2)
