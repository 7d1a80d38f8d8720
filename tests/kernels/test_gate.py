"""The log-decay gate's Triton kernels (:mod:`kernels.gate`, the GPU path) against the PyTorch formula
``-exp(A_log) softplus(raw + dt_bias)``, values and gradients of all three inputs in fp32 and fp64 through
the interpreter, including steps far in both tails of the softplus and a strided projection block; and the
step size alone, ``min(softplus(raw + dt_bias), dt_max)``, the same way; and the beta gate ``(k sigmoid(raw),
v sigmoid(raw))`` of the GLA and GKA layers, on column blocks of one projection as the layers read them; and
the delta rule's step size ``scale sigmoid(raw)``."""
from __future__ import annotations

import pytest
import torch

from kernels.gate import (
    beta_scale,
    beta_scale_reference,
    log_decay,
    log_decay_reference,
    scaled_sigmoid,
    scaled_sigmoid_reference,
    step_size,
    step_size_reference,
)
from kernels.launch import counting
from tests.kernels.harness import assert_rel_close, cancellation, needs_triton, value_and_grads

pytestmark = needs_triton   # the interpreter on a CPU; on a GPU machine the GPU-marked tests run


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_log_decay_matches_formula(dtype, tol):
    """Pre-activations from -19 to 15 (torch's softplus switches to the identity above 20, where the two
    differ by exp(-20) relative); a column block of a wider matrix read in place. d A_log and d dt_bias sum
    one term per token, which can cancel (one fp32 draw missed 1e-6 by 4 %): their tolerance is scaled by
    how much the terms cancel on the draw."""
    H = 5
    wide = torch.randn(3, 40, 3 * H, dtype=dtype) * 4
    wide[0, 0, H:2 * H] = torch.linspace(-15, 15, H, dtype=dtype)
    raw = wide[..., H:2 * H]
    A_log, dt_bias = torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype) - 4
    dg = torch.randn(3, 40, H, dtype=dtype)
    outs = []
    for fn in (lambda *a: log_decay(*a, backend="triton"), log_decay_reference):
        with counting() as launches:
            outs.append((value_and_grads(fn, [raw, A_log, dt_bias], dg), sum(launches.values())))
    (got, n_launches), (want, _) = outs
    assert n_launches == 2
    exact = [t.detach().double() for t in (raw, A_log, dt_bias)]
    for i, (name, a, b) in enumerate(zip(("g", "d raw", "d A_log", "d dt_bias"), got, want)):
        spread = cancellation(log_decay_reference, exact, i - 1, tuple(raw.shape), dg.double()) if i >= 2 else 1.0
        assert_rel_close(a, b, tol * spread, name)


def test_small_steps_keep_their_digits():
    """softplus(u) for u around -17 (steps dt ~ 4e-8): the relative error stays at rounding, where
    log(1 + exp(u)) in fp32 would return 0."""
    raw = torch.linspace(-18, -16, 7).unsqueeze(-1)
    got = log_decay(raw, torch.zeros(1), torch.zeros(1), backend="triton")
    want = log_decay_reference(raw.double(), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert_rel_close(got, want, 1e-6, "small steps")


def test_bad_shapes():
    with pytest.raises(ValueError, match="share H"):
        log_decay(torch.randn(2, 3), torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("dt_max", [None, 3.0])
def test_step_size_matches_formula(dtype, tol, dt_max):
    """``dt = min(softplus(raw + dt_bias), dt_max)`` from a column block of a wider projection: values, the
    gradient of ``raw`` (zero above the cap, passed at it) and of ``dt_bias`` (one term per token, its
    tolerance scaled by how much they cancel), against the formula's autograd."""
    H = 6
    wide = torch.randn(3, 40, 3 * H, dtype=dtype) * 4
    wide[0, 0, H:2 * H] = torch.linspace(-15, 15, H, dtype=dtype)
    raw = wide[..., H:2 * H]
    dt_bias = torch.randn(H, dtype=dtype)
    ddt = torch.randn(3, 40, H, dtype=dtype)
    outs = []
    for fn in (lambda r, b: step_size(r, b, dt_max, backend="triton"), lambda r, b: step_size_reference(r, b, dt_max)):
        with counting() as launches:
            outs.append((value_and_grads(fn, [raw, dt_bias], ddt), dict(launches)))
    (got, launched), (want, _) = outs
    assert launched == {"gate._step_fwd": 1, "gate._step_bwd": 1}
    if dt_max is not None:
        capped = want[0] >= dt_max
        assert capped.any() and (~capped).any()             # the draw crosses the cap
        assert torch.equal(got[1][capped], torch.zeros_like(got[1][capped]))
    exact = [t.detach().double() for t in (raw, dt_bias)]
    spread = cancellation(lambda r, b: step_size_reference(r, b, dt_max), exact, 1, tuple(raw.shape), ddt.double())
    for name, a, b, t in zip(("dt", "d raw", "d dt_bias"), got, want, (tol, tol, tol * spread)):
        assert_rel_close(a, b, t, name)


def test_step_size_in_a_16_bit_dtype_and_bad_inputs():
    """``out_dtype`` stores the fp32 result rounded once (within fp16 rounding of the fp64 formula); a wrong
    bias length and a cap <= 0 are refused."""
    raw, bias = torch.randn(2, 30, 4).half(), torch.randn(4)
    got = step_size(raw, bias, 1e3, out_dtype=torch.float16, backend="triton")
    assert got.dtype == torch.float16
    assert_rel_close(got.double(), step_size_reference(raw.double(), bias.double(), 1e3), 2 ** -11, "fp16")
    with pytest.raises(ValueError, match="share H"):
        step_size(raw, torch.randn(5))
    with pytest.raises(ValueError, match="dt_max=0"):
        step_size(raw, bias, 0)


@pytest.mark.gpu
def test_gates_in_bf16_at_real_size():
    """bf16 projections of 32 heads over 8 x 2048 tokens (a Mamba-2 layer of d_model 1024): the log decay,
    the capped step size (stored in bf16, as Mamba-2 feeds its scan) and the delta rule's 2 sigmoid within
    bf16 rounding of the fp64 formulas, values and gradients."""
    raw = torch.randn(8, 2048, 32, device="cuda", dtype=torch.bfloat16) * 4
    A_log, dt_bias = torch.randn(32, device="cuda"), torch.randn(32, device="cuda") - 4
    dy = torch.randn(8, 2048, 32, device="cuda")
    cases = [(lambda r, a, b: log_decay(r, a, b, backend="triton"), log_decay_reference, [raw, A_log, dt_bias],
              torch.float32),
             (lambda r, b: step_size(r, b, 1e3, out_dtype=torch.bfloat16, backend="triton"),
              lambda r, b: step_size_reference(r, b, 1e3), [raw, dt_bias], torch.bfloat16),
             (lambda r: scaled_sigmoid(r, 2.0, backend="triton"), lambda r: scaled_sigmoid_reference(r, 2.0), [raw],
              torch.float32)]
    for fast, formula, inputs, out_dtype in cases:
        got = value_and_grads(fast, inputs, dy.to(out_dtype))
        want = value_and_grads(formula, [t.double() for t in inputs], dy.double())
        for i, (g, w) in enumerate(zip(got, want)):          # the value, then the inputs' gradients
            assert_rel_close(g.double(), w, 1e-2, f"bf16 [{i}]")


def _beta_inputs(B, T, H, dk, dv, dtype, device="cpu"):
    """``k (B, T, H, dk)``, ``v (B, T, H, dv)`` and ``raw (B, T, H)``: column blocks of one wide tensor (row strides
    wider than their own rows, as a layer's projections are), and the upstream gradients (contiguous)."""
    wide = torch.randn(B, T, H * (dk + dv + 1) + 7, dtype=dtype, device=device)
    k = wide[..., 3:3 + H * dk].unflatten(-1, (H, dk))
    v = wide[..., 3 + H * dk:3 + H * (dk + dv)].unflatten(-1, (H, dv))
    raw = wide[..., 3 + H * (dk + dv):3 + H * (dk + dv + 1)] * 3
    return [k, v, raw], [torch.randn(B, T, H, d, dtype=dtype, device=device) for d in (dk, dv)]


def _beta_values_and_grads(fn, inputs, grads):
    xs = [x.detach().requires_grad_() for x in inputs]
    ko, vo = fn(*xs)
    return [ko.detach(), vo.detach(), *torch.autograd.grad((ko, vo), xs, grads)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_beta_scale_matches_formula(dtype, tol):
    """Head dims that are not powers of two, more heads than one step of the kernel takes; one launch each way."""
    H, dk, dv = int(torch.randint(3, 12, ())), int(torch.randint(5, 40, ())), int(torch.randint(5, 40, ()))
    inputs, grads = _beta_inputs(2, int(torch.randint(3, 30, ())), H, dk, dv, dtype)
    with counting() as forward:
        ko, vo = beta_scale(*inputs, backend="triton")
    assert sum(forward.values()) == 1 and ko.dtype == vo.dtype == dtype
    with counting() as both:
        got = _beta_values_and_grads(lambda *a: beta_scale(*a, backend="triton"), inputs, grads)
    assert sum(both.values()) == 2
    want = _beta_values_and_grads(beta_scale_reference, inputs, grads)
    for name, a, b in zip(("k beta", "v beta", "d k", "d v", "d raw"), got, want):
        assert_rel_close(a, b, tol, name)


def test_beta_scale_in_fp16_and_bad_shapes():
    """fp16 inputs: computed in fp32 and rounded once, within fp16's rounding of the fp64 formula."""
    inputs, grads = _beta_inputs(2, 19, 4, 16, 24, torch.float16)
    got = _beta_values_and_grads(lambda *a: beta_scale(*a, backend="triton"), inputs, grads)
    want = _beta_values_and_grads(beta_scale_reference, [x.double() for x in inputs], [g.double() for g in grads])
    for name, a, b in zip(("k beta", "v beta", "d k", "d v", "d raw"), got, want):
        assert a.dtype == torch.float16
        assert_rel_close(a.double(), b, 2e-3, name)
    k, v, raw = inputs
    with pytest.raises(ValueError, match="must share"):
        beta_scale(k, v[:, :-1], raw)
    with pytest.raises(ValueError, match="must share"):
        beta_scale(k, v, raw[..., :-1])


@pytest.mark.gpu
def test_beta_scale_in_bf16_at_real_size():
    """bf16 keys and values of a GLA / GKA layer (8 heads of 128, 8 x 2048 tokens) within bf16 rounding of the
    fp64 formula, values and gradients."""
    inputs, grads = _beta_inputs(8, 2048, 8, 128, 128, torch.bfloat16, device="cuda")
    got = _beta_values_and_grads(lambda *a: beta_scale(*a, backend="triton"), inputs, grads)
    want = _beta_values_and_grads(beta_scale_reference, [x.double() for x in inputs], [g.double() for g in grads])
    for name, a, b in zip(("k beta", "v beta", "d k", "d v", "d raw"), got, want):
        assert_rel_close(a.double(), b, 1e-2, name)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13), (torch.float16, 1e-6)])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_scaled_sigmoid_matches_formula(dtype, tol, scale):
    """A column block of a wider projection, logits from -20 to 20; the output in fp32 (fp64 for fp64 logits)
    from 16-bit logits too, as the formula computes it; one launch each way."""
    H = int(torch.randint(2, 9, ()))
    wide = (torch.randn(2, int(torch.randint(3, 40, ())), 3 * H) * 6).to(dtype)
    wide[0, 0, H:2 * H] = torch.linspace(-20, 20, H).to(dtype)
    raw = wide[..., H:2 * H]
    dout = torch.randn(raw.shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with counting() as launched:
        got = value_and_grads(lambda r: scaled_sigmoid(r, scale, backend="triton"), [raw], dout)
    assert sum(launched.values()) == 2
    want = value_and_grads(lambda r: scaled_sigmoid_reference(r, scale), [raw], dout)
    assert got[0].dtype == want[0].dtype and got[1].dtype == dtype
    assert_rel_close(got[0], want[0], tol, "beta")
    assert_rel_close(got[1].double(), want[1].double(), tol if dtype != torch.float16 else 1e-3, "d raw")
