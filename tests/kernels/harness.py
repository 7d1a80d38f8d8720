"""One harness for every kernel test: relative error, forward and gradient comparison of a backend
against a reference on the same fresh random inputs.

``rel_err(a, b) = ||a - b|| / max(||b||, tiny)`` over the whole tensor, computed in fp64. :data:`DEVICE` and
:data:`needs_triton` say where the tests run and which need Triton; :func:`compiler_env` is the environment of a
child process that compiles kernels instead of interpreting them.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import pytest
import torch

from kernels.backend import BackendUnavailable, triton_importable, triton_usable_for

#: where the kernel tests run: the GPU when there is one, else the CPU (Triton through the interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the mark of a test of a Triton kernel: skipped where Triton cannot run (no CUDA and no TRITON_INTERPRET=1)
needs_triton = pytest.mark.skipif(
    not (triton_importable() and triton_usable_for(torch.empty(0, device=DEVICE))),
    reason="triton cannot run here (no CUDA and no TRITON_INTERPRET=1)",
)
#: the same for a test whose tensors are CPU tensors on any machine (Triton runs them through the interpreter only)
needs_triton_on_cpu = pytest.mark.skipif(not (triton_importable() and triton_usable_for(torch.empty(0))),
                                         reason="triton cannot run on CPU tensors here (no TRITON_INTERPRET=1)")
#: the ``triton`` backend as a parameter of such a test
TRITON_ON_CPU = pytest.param("triton", marks=needs_triton_on_cpu)


def compiler_env(**extra: str) -> dict:
    """This process's environment without ``TRITON_INTERPRET``, with ``extra`` set: a child given it compiles its
    kernels (as the compile checks must) unless it turns the interpreter on itself."""
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **extra}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.detach().double(), expected.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def value_and_grads(fn, inputs, dy) -> list[torch.Tensor]:
    """``[fn(*inputs), its gradient in each input]`` for the upstream gradient ``dy``; each input keeps its
    strides (a strided view reaches ``fn`` as one)."""
    xs = [x.detach().requires_grad_() for x in inputs]
    y = fn(*xs)
    return [y.detach()] + list(torch.autograd.grad(y, xs, dy))


def compare_backends(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    ref: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    tol: float,
    grad_tol: float | None = None,
    ref_dtype: torch.dtype = torch.float64,
    grad: bool = True,
    rounding_factor: float | None = None,
    shared: dict[int, tuple[int, ...]] | None = None,
) -> None:
    """Check ``fn(*inputs)`` against ``ref`` run on fp64 copies, outputs and input gradients.

    Non-float inputs are passed through unchanged. The upstream gradient is random, so a kernel that
    drops a term cannot pass by symmetry.

    ``rounding_factor``: for ops whose conditioning varies from draw to draw (a gradient through a
    normalisation of a nearly constant vector), each tolerance becomes at least ``rounding_factor`` times
    the error of ``ref`` itself run in the inputs' own dtype: what rounding at that precision costs on
    this draw, which no fixed tolerance can bound.

    ``shared``: ``{input index: the shape the op broadcasts that input to}``. The gradient of a shared
    input is a sum of per-element terms that can cancel, so its relative error has no bound; the sum's
    error does have one relative to the sum of the terms' magnitudes, and its tolerance is scaled by
    ``||sum |terms||| / ||sum terms||`` (the terms from ``ref`` on the expanded input, same upstream).
    """
    grad_tol = tol if grad_tol is None else grad_tol
    xs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) if torch.is_tensor(x) else x for x in inputs]
    rs = [x.detach().clone().to(ref_dtype).requires_grad_(grad and x.is_floating_point())
          if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
    ws = [x.detach().clone().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in xs]
    out = fn(*xs)
    exp = ref(*rs)
    outs = [out] if torch.is_tensor(out) else list(out)
    exps = [exp] if torch.is_tensor(exp) else list(exp)
    own = None
    if rounding_factor is not None:
        own = ref(*ws)
        own = [own] if torch.is_tensor(own) else list(own)

    def allowed(base, mine, truth):
        return base if mine is None else max(base, rounding_factor * rel_err(mine, truth))

    for i, (o, e) in enumerate(zip(outs, exps)):
        assert_rel_close(o, e, allowed(tol, None if own is None else own[i], e), f"output {i}")
    if not grad:
        return
    upstream = [torch.randn_like(e) for e in exps]
    torch.autograd.backward([o for o in outs], [u.to(o.dtype) for o, u in zip(outs, upstream)])
    torch.autograd.backward([e for e in exps], upstream)
    if own is not None:
        torch.autograd.backward(own, [u.to(o.dtype) for o, u in zip(own, upstream)])
    spread = {i: cancellation(ref, rs, i, shape, upstream) for i, shape in (shared or {}).items()}
    for i, (x, r) in enumerate(zip(xs, rs)):
        if torch.is_tensor(x) and x.requires_grad:
            assert x.grad is not None, f"input {i}: no gradient"
            mine = None if own is None else ws[i].grad
            base = grad_tol * spread.get(i, 1.0)
            assert_rel_close(x.grad, r.grad, allowed(base, mine, r.grad), f"grad of input {i}")


def cancellation(ref, inputs, i: int, shape: tuple[int, ...], upstream) -> float:
    """``||sum |terms||| / ||sum terms||`` (at least 1) for the gradient of ``inputs[i]`` through ``ref`` with
    ``upstream``, when ``ref`` broadcasts that input to ``shape``: the terms are the gradient of the input
    expanded to ``shape``, their sum the gradient of the input itself."""
    full = [x.detach() if torch.is_tensor(x) else x for x in inputs]
    full[i] = full[i].expand(shape).clone().requires_grad_(True)
    out = ref(*full)
    outs = [out] if torch.is_tensor(out) else list(out)
    grads = [upstream] if torch.is_tensor(upstream) else list(upstream)
    reached = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]   # an output the input never reaches is left out
    terms, = torch.autograd.grad([o for o, _ in reached], full[i], [g for _, g in reached])
    size = tuple(inputs[i].shape)
    return max(1.0, (terms.abs().sum_to_size(size).norm() / terms.sum_to_size(size).norm().clamp_min(1e-300)).item())


def attention_backend_refused(attention, q, k, v, backend: str) -> bool:
    """Whether ``backend`` of ``attention`` cannot run on these inputs here (flash-attn without CUDA and the
    package, Triton without CUDA or the interpreter); when so, asserts that it is refused with
    :class:`kernels.backend.BackendUnavailable` rather than run some other way."""
    from kernels.attention import flash_attn_available

    if (backend == "flash_attn" and not (q.is_cuda and flash_attn_available())) or \
            (backend == "triton" and not triton_usable_for(q)):
        with pytest.raises(BackendUnavailable):
            attention(q, k, v, backend=backend)
        return True
    return False


def ssd_reference_any_A(x, dt, A, B, C, initial_state=None):
    """:func:`kernels.ssd.ssd_reference` that also takes ``A`` per token, ``(B, T, H)``, as :func:`cancellation`
    passes it to bound the error of ``dA``, a sum over every token (``compare_backends(..., shared={2: dt.shape})``)."""
    from kernels.ssd import ssd_reference, ssd_step

    if A.dim() == 1:
        return ssd_reference(x, dt, A, B, C, initial_state=initial_state)
    h, ys = initial_state, []
    if h is None:
        h = x.new_zeros(x.shape[0], x.shape[2], B.shape[-1], x.shape[-1])
    for t in range(x.shape[1]):
        y, h = ssd_step(x[:, t], dt[:, t], A[:, t], B[:, t], C[:, t], h)
        ys.append(y)
    return torch.stack(ys, 1), h
