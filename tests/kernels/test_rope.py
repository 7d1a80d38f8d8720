"""Rotary position embeddings' Triton kernel (:mod:`kernels.rope`, the GPU path) against the fp64 PyTorch
formula, values and gradients in fp32, fp64 and fp16 through the interpreter, on the strided ``q | k`` groups
of a fused ``q | k | v`` projection read in place, with the values copied; and the two properties that make
it RoPE whatever the formula: each rotated pair keeps its length, and the score of a rotated query and key
depends only on their distance.

fp32 tolerance: the angle ``p base^(-i/h)`` is rounded to fp32 at the position ``p``, an error of about
``p 2^-24`` radians that any fp32 implementation shares (the CPU formula too), so the bound is that error at
the last position, ``(start + T) 2^-24``, at least 1e-6 (the measured error is 10-20x below it).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels.launch import counting
from kernels.rope import rope_reference, rotary, rotary_reference
from tests.kernels.harness import assert_rel_close, needs_triton, value_and_grads

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run


def _fp32_tol(last_position: int) -> float:
    return max(1e-6, last_position * 2.0 ** -24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("start,head_dim,base", [(0, 16, 10000.0), (1000, 96, 500000.0), (7, 2, 10.0)])
def test_rotary_matches_formula(dtype, start, head_dim, base):
    """A fused projection ``(B, T, 3 H, D)`` with a ragged head dim (48 pairs, a block of 64), ``q | k``
    rotated and ``v`` copied bit for bit, forward and backward."""
    B, T, H = 2, 37, 3
    x = torch.randn(B, T, 3 * H * head_dim + 5, dtype=dtype)[..., 5:].unflatten(-1, (3 * H, head_dim))
    assert not x.is_contiguous()
    dy = torch.randn(x.shape, dtype=dtype)
    with counting() as launches:
        y, dx = value_and_grads(lambda t: rotary(t, start, base, rotated=2 * H, backend="triton"), [x], dy)
    assert dict(launches) == {"rope._rotate": 2}
    assert y.is_contiguous() and y.dtype == dtype
    want_y, want_dx = value_and_grads(lambda t: rotary_reference(t, start, base, rotated=2 * H), [x.double()], dy.double())
    tol = {torch.float32: _fp32_tol(start + T), torch.float64: 1e-12, torch.float16: 1e-3}[dtype]
    assert_rel_close(y[:, :, :2 * H].double(), want_y[:, :, :2 * H], tol, "rotated")
    assert_rel_close(dx[:, :, :2 * H].double(), want_dx[:, :, :2 * H], tol, "rotated gradient")
    assert torch.equal(y[:, :, 2 * H:], x[:, :, 2 * H:]) and torch.equal(dx[:, :, 2 * H:], dy[:, :, 2 * H:])


def test_rotation_keeps_pair_lengths_and_scores_depend_on_distance():
    """Independent of any formula: ``|(y_i, y_{i+h})| = |(x_i, x_{i+h})|``, and shifting every position by
    the same amount leaves every query-key score unchanged."""
    T, D = 24, 32
    q, k = torch.randn(1, T, 1, D, dtype=torch.float64), torch.randn(1, T, 1, D, dtype=torch.float64)
    x = torch.cat([q, k], dim=2)
    near, far = (rotary(x, start, 10000.0, backend="triton") for start in (0, 777))
    h = D // 2
    for y in (near, far):
        assert torch.allclose(y[..., :h].hypot(y[..., h:]), x[..., :h].hypot(x[..., h:]), rtol=1e-12, atol=0)

    def scores(y):
        return torch.einsum("td,sd->ts", y[0, :, 0], y[0, :, 1])

    assert torch.allclose(scores(near), scores(far), rtol=0, atol=1e-10)
    assert not torch.allclose(scores(near), scores(x), rtol=0, atol=1e-3)  # the rotation did something


def test_reference_rotates_like_the_attention_formula():
    """:func:`rotary_reference` with ``rotated`` groups is :func:`rope_reference` on those groups."""
    x = torch.randn(2, 9, 6, 8)
    got = rotary_reference(x, 3, 100.0, rotated=4)
    assert torch.equal(got[:, :, :4], rope_reference(x[:, :, :4], torch.arange(3, 12), 100.0))
    assert torch.equal(got[:, :, 4:], x[:, :, 4:])


def test_attention_decodes_on_the_gpu_path_as_on_the_cpu_path():
    """The attention layer's prefill and one-token steps (the rotation at ``start > 0``) on the GPU plan
    match the CPU path of the same weights."""
    from kernels.device import gpu_path_on_cpu
    from mixers import build_mixer

    layer = build_mixer("attention", 32, {"n_heads": 2, "backend": "torch"})
    x = torch.randn(2, 12, 32)
    outputs = []
    for gpu in (False, True):
        with torch.no_grad(), (gpu_path_on_cpu() if gpu else contextlib.nullcontext()):
            y, state = layer.prefill(x[:, :9])
            steps = []
            for t in range(9, 12):
                y_t, state = layer.step(x[:, t], state)
                steps.append(y_t)
        outputs.append(torch.cat([y, torch.stack(steps, 1)], 1))
    assert_rel_close(outputs[1], outputs[0], 1e-5, "gpu path")


@pytest.mark.parametrize("bad,match", [
    (lambda: rotary(torch.randn(2, 3, 4, 5)), "D even"),
    (lambda: rotary(torch.randn(2, 3, 4)), r"\(B, T, G, D\)"),
    (lambda: rotary(torch.randn(2, 3, 4, 6), rotated=5), "rotated=5"),
    (lambda: rotary(torch.randn(2, 3, 4, 6), start=-1), "start=-1"),
])
def test_bad_inputs_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.gpu
def test_rotary_in_bf16_at_real_size():
    """bf16 ``q | k | v`` of 8 heads of 128 over 8192 positions: within bf16 rounding of the fp64 formula,
    values and gradients."""
    x = torch.randn(1, 8192, 24, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, dx = value_and_grads(lambda t: rotary(t, 0, 10000.0, rotated=16, backend="triton"), [x], dy)
    want_y, want_dx = value_and_grads(lambda t: rotary_reference(t, 0, 10000.0, rotated=16), [x.double()], dy.double())
    assert_rel_close(y.double(), want_y, 1e-2, "bf16")
    assert_rel_close(dx.double(), want_dx, 1e-2, "bf16 gradient")
