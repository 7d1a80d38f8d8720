"""Shared layers: the causal short convolution (hand-written backward) against ``conv1d`` and its
own decode step; the fused projection of the GPU plan against the modules called one by one."""
import pytest
import torch
import torch.nn.functional as F

from kernels.device import gpu_path_on_cpu
from mixers.layers import ShortConv, project


def _conv1d_reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), conv.conv.weight, conv.conv.bias, padding=conv.kernel_size - 1,
                 groups=conv.channels)[..., :T].transpose(1, 2)
    return F.silu(y) if conv.activation else y


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3, 29])
@pytest.mark.parametrize("activation", [True, False])
def test_short_conv_matches_conv1d_with_gradients(k, T, activation):
    conv = ShortConv(5, k, activation=activation).double()
    with torch.no_grad():
        conv.conv.bias.normal_()
    # a strided input, as produced by splitting a projection
    x = torch.randn(2, T, 9, dtype=torch.float64)[..., 2:7].requires_grad_()
    g = torch.randn(2, T, 5, dtype=torch.float64)
    params = (x, conv.conv.weight, conv.conv.bias)
    y = conv(x)
    got = torch.autograd.grad((y * g).sum(), params)
    y_ref = _conv1d_reference(conv, x)
    want = torch.autograd.grad((y_ref * g).sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_short_conv_forward_equals_decode_steps():
    conv = ShortConv(6, 4).double()
    x = torch.randn(3, 11, 6, dtype=torch.float64)
    state = conv.init_state(3, dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        y_t, state = conv.step(x[:, t], state)
        ys.append(y_t)
    torch.testing.assert_close(conv(x), torch.stack(ys, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, conv.final_state(x), rtol=0, atol=0)


def test_short_conv_rejects_wrong_shape():
    with pytest.raises(ValueError, match="batch, time, 6"):
        ShortConv(6, 4)(torch.randn(2, 5, 7))


@pytest.mark.parametrize("widths", [(24, 5, 7), (16, 8, 8), (3,)])
def test_project_fused_equals_modules_with_aligned_rows(widths):
    """On the GPU plan one matmul, its row padded to a multiple of 16 outputs: every part equals its module's
    output (and its gradients the separate modules'), and the token stride of every part read in place (a
    bias-free one; a bias is added into a new tensor) divides by 16."""
    d = 11
    group = [torch.nn.Linear(d, widths[0] - 1, bias=False, dtype=torch.float64),
             torch.nn.Linear(d, 1, bias=False, dtype=torch.float64)]
    modules = [group] + [torch.nn.Linear(d, w, bias=i % 2 == 1, dtype=torch.float64) for i, w in enumerate(widths[1:])]
    x = torch.randn(2, 7, d, dtype=torch.float64, requires_grad=True)
    with gpu_path_on_cpu():
        parts = project(x, modules)
    want = [torch.cat([m(x) for m in group], -1)] + [m(x) for m in modules[1:]]
    params = [x] + [p for m in group + modules[1:] for p in m.parameters()]
    gs = [torch.randn_like(w) for w in want]
    got_grads = torch.autograd.grad(sum((p * g).sum() for p, g in zip(parts, gs)), params)
    want_grads = torch.autograd.grad(sum((w * g).sum() for w, g in zip(want, gs)), params)
    for p, w, m in zip(parts, want, modules):
        torch.testing.assert_close(p, w, rtol=1e-12, atol=1e-12)
        if len(widths) > 1 and getattr(m, "bias", None) is None:
            assert p.stride(1) % 16 == 0, f"token stride {p.stride(1)} of a part of widths {widths}"
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("plan", ["gpu_plan", "cpu_plan"])
def test_project_parts_cuts_the_modules_outputs_with_one_split(plan):
    """:func:`mixers.layers.project_parts`: the parts equal the modules' outputs cut by the sizes (values and
    gradients); on the GPU plan they come from one matmul split once, so the backward gathers the parts'
    gradients once; a cut that crosses from one module into the next is refused, naming both."""
    import contextlib

    from mixers.layers import project_parts
    from tests.mixers.launches import count_launches

    d = 9
    first, second = (torch.nn.Linear(d, w, bias=False, dtype=torch.float64) for w in (12, 5))
    sizes = [4, 8, 5]
    x = torch.randn(2, 6, d, dtype=torch.float64, requires_grad=True)
    ctx = gpu_path_on_cpu if plan == "gpu_plan" else contextlib.nullcontext
    gs = [torch.randn(2, 6, n, dtype=torch.float64) for n in sizes]
    params = [x, first.weight, second.weight]
    with ctx():
        parts = project_parts(x, [first, second], sizes)
    want = list(first(x).split([4, 8], -1)) + [second(x)]
    got_grads = []
    _, ops = count_launches(lambda: got_grads.extend(
        torch.autograd.grad(sum((p * g).sum() for p, g in zip(parts, gs)), params)))
    want_grads = torch.autograd.grad(sum((w * g).sum() for w, g in zip(want, gs)), params)
    for a, b in zip(parts + list(got_grads), want + list(want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if plan == "gpu_plan":    # the parts' gradients gathered once (no consumer here writes in place: one cat)
        assert ops["aten::cat"] == 1 and not ops["aten::copy_"] and ops["aten::mm"] == 2     # dx and dW
    with pytest.raises(ValueError, match=r"parts \[4, 10, 3\] must cut the modules' outputs \[12, 5\]"):
        project_parts(x, [first, second], [4, 10, 3])


def _autocast_case(plan: str):
    """(plan context, autocast dtype): the GPU plan through the interpreter takes fp16 (its bf16 arithmetic is
    wrong), the CPU plan bf16."""
    import contextlib

    return (gpu_path_on_cpu, torch.float16) if plan == "gpu_plan" else (contextlib.nullcontext, torch.bfloat16)


def _under_autocast(call, modules, inputs, dtype, plan_ctx, seed):
    """The value of ``call(*inputs)`` under autocast and the gradients of one random cotangent (drawn from
    ``seed``) with respect to the inputs and the parameters of ``modules``."""
    with plan_ctx(), torch.autocast("cpu", dtype=dtype):
        y = call(*inputs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    params = [*inputs, *[p for m in modules for p in m.parameters()]]
    return [y.detach(), *torch.autograd.grad(y, params, dy)]


def test_rms_norm_to_linear_hands_the_linear_the_values_it_would_cast():
    """Under autocast on the GPU plan a pre-norm declared ``to_linear`` returns the autocast dtype, written by its
    kernel: the linear layer after it computes exactly what it computes after the norm's fp32 output (values, and
    gradients of the input, the gain and the weight), and the activation-sized cast and its backward are gone.
    Outside autocast, and on the CPU plan, the output keeps ``x``'s dtype."""
    from mixers.layers import RMSNorm
    from tests.mixers.launches import count_launches

    plan_ctx, dtype = _autocast_case("gpu_plan")
    D = 48
    norm, proj = RMSNorm(D, eps=1e-5), torch.nn.Linear(D, 40, bias=False)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 7, D, requires_grad=True)
    seed = int(torch.randint(1 << 30, ()))
    results, casts = {}, {}
    for to_linear in (False, True):
        norm.to_linear = to_linear
        _, ops = count_launches(lambda: results.__setitem__(
            to_linear, _under_autocast(lambda x: proj(norm(x)), [norm, proj], [x], dtype, plan_ctx, seed)))
        casts[to_linear] = ops["aten::_to_copy"]
    assert results[True][0].dtype == dtype
    for got, want in zip(results[True], results[False]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert casts[False] - casts[True] == 2          # the input's cast forward, its gradient's backward
    with plan_ctx():
        assert norm(x).dtype == torch.float32       # no autocast: x's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == torch.float32       # the CPU plan: the linear casts


@pytest.mark.parametrize("plan", ["gpu_plan", "cpu_plan"])
def test_an_output_kept_in_the_autocast_dtype_gives_the_same_values(plan):
    """:func:`mixers.layers.keep_autocast_dtype`: a core output already in the autocast dtype goes through the gated
    norm and the output projection as it is, and a mixer's output into the residual add: the projection and the
    sum compute exactly what they compute when it is raised to ``x``'s fp32 first (values and every gradient);
    outside autocast it is ``t.to(x.dtype)``."""
    from mixers.layers import GatedRMSNorm, keep_autocast_dtype

    plan_ctx, dtype = _autocast_case(plan)
    D = 32
    norm, proj = GatedRMSNorm(D, eps=1e-6), torch.nn.Linear(D, 24, bias=False)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, D)
    o = torch.randn(2, 5, D).to(dtype).requires_grad_()
    z = torch.randn(2, 5, D).to(dtype).requires_grad_()
    seed = int(torch.randint(1 << 30, ()))
    kept = _under_autocast(lambda o, z: proj(norm(keep_autocast_dtype(o, x), z)), [norm, proj], [o, z], dtype,
                           plan_ctx, seed)
    raised = _under_autocast(lambda o, z: proj(norm(o.to(x.dtype), z)), [norm, proj], [o, z], dtype, plan_ctx, seed)
    for got, want in zip(kept, raised):
        assert got.dtype == want.dtype and torch.equal(got, want)
    r = torch.randn(2, 5, 24, requires_grad=True)                   # the residual stream, fp32
    kept = _under_autocast(lambda r, o: r + keep_autocast_dtype(proj(o), r), [proj], [r, o], dtype, plan_ctx, seed)
    raised = _under_autocast(lambda r, o: r + proj(o).to(r.dtype), [proj], [r, o], dtype, plan_ctx, seed)
    for got, want in zip(kept, raised):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert keep_autocast_dtype(o, x).dtype == torch.float32
