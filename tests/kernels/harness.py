"""One harness for every kernel test: relative error, forward and gradient comparison of a backend
against a reference on the same fresh random inputs.

``rel_err(a, b) = ||a - b|| / max(||b||, tiny)`` over the whole tensor, computed in fp64.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.detach().double(), expected.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def compare_backends(
    fn: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    ref: Callable[..., torch.Tensor | Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    tol: float,
    grad_tol: float | None = None,
    ref_dtype: torch.dtype = torch.float64,
    grad: bool = True,
) -> None:
    """Check ``fn(*inputs)`` against ``ref`` run on fp64 copies, outputs and input gradients.

    Non-float inputs are passed through unchanged. The upstream gradient is random, so a kernel that
    drops a term cannot pass by symmetry.
    """
    grad_tol = tol if grad_tol is None else grad_tol
    xs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) if torch.is_tensor(x) else x for x in inputs]
    rs = [x.detach().clone().to(ref_dtype).requires_grad_(grad and x.is_floating_point())
          if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
    out = fn(*xs)
    exp = ref(*rs)
    outs = [out] if torch.is_tensor(out) else list(out)
    exps = [exp] if torch.is_tensor(exp) else list(exp)
    for i, (o, e) in enumerate(zip(outs, exps)):
        assert_rel_close(o, e, tol, f"output {i}")
    if not grad:
        return
    upstream = [torch.randn_like(e) for e in exps]
    torch.autograd.backward([o for o in outs], [u.to(o.dtype) for o, u in zip(outs, upstream)])
    torch.autograd.backward([e for e in exps], upstream)
    for i, (x, r) in enumerate(zip(xs, rs)):
        if torch.is_tensor(x) and x.requires_grad:
            assert x.grad is not None, f"input {i}: no gradient"
            assert_rel_close(x.grad, r.grad, grad_tol, f"grad of input {i}")
