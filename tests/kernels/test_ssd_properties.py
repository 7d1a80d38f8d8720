"""Mamba-2 SSD (Dao & Gu, "Transformers are SSMs", arXiv:2405.21060) on inputs the other SSD tests leave out,
against a token loop of the recurrence written here in fp64:

- ``B`` shared by the heads (one group, a head stride of 0) with a per-head ``C``, and the other way round: the
  chunked path's shared-group shortcut must take both or neither, and the Triton kernels, which read ``B`` and
  ``C`` with one set of strides, must not read one at the other's strides;
- fp64 inputs on the Triton backend (computed in fp32) with an initial state and the skip ``D``: neither may be
  lost on the way to the fp32 kernels;
- the one-token decode step with the skip ``D`` (the Mamba-2 mixer's decode passes it).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import BackendUnavailable
from kernels.ssd import ssd, ssd_step
from tests.kernels.harness import assert_rel_close, needs_triton

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def ssd_token_loop(x, dt, A, B, C, h0, D):
    """``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t + D x_t``, one token at a time."""
    h, ys = h0, []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + dt[:, t, :, None, None] * B[:, t, :, :, None] * x[:, t, :, None, :]
        ys.append(torch.einsum("bhn,bhnp->bhp", C[:, t], h) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), h


def draw(b, T, H, P, N, dtype=torch.float32):
    x = torch.randn(b, T, H, P, dtype=dtype)
    dt = F.softplus(torch.randn(b, T, H, dtype=dtype) - 1.0)
    A = -(torch.rand(H, dtype=dtype) * 2 + 0.5)
    B, C = torch.randn(b, T, H, N, dtype=dtype), torch.randn(b, T, H, N, dtype=dtype)
    h0 = torch.randn(b, H, N, P, dtype=dtype)
    D = torch.randn(H, dtype=dtype)
    return [x, dt, A, B, C, h0, D]


def check_against_loop(run, inputs, tol, grad_tol):
    """``run(*inputs) -> (y, final)`` and its gradients in every input against :func:`ssd_token_loop` in fp64."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    exact = [t.detach().double().requires_grad_(True) for t in inputs]
    y, h = run(*leaves)
    y_ref, h_ref = run(*exact, loop=True)
    assert_rel_close(y, y_ref, tol, "y")
    assert_rel_close(h, h_ref, tol, "final state")
    dy, dh = torch.randn_like(y_ref), torch.randn_like(h_ref)
    grads = torch.autograd.grad((y * dy.to(y.dtype)).sum() + (h * dh.to(h.dtype)).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (h_ref * dh).sum(), exact)
    for name, g, g_ref in zip(("dx", "ddt", "dA", "dB", "dC", "dh0", "dD"), grads, grads_ref):
        assert_rel_close(g, g_ref, grad_tol, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", ["B", "C"])
def test_one_of_B_and_C_shared_by_the_heads(backend, shared):
    """One of ``B``, ``C`` is one group expanded over the heads (head stride 0), the other is per head."""
    H = 3
    x, dt, A, B, C, h0, D = draw(2, int(torch.randint(17, 40, ())), H, 16, 8)
    if shared == "B":
        B = B[:, :, :1]
    else:
        C = C[:, :, :1]

    def run(x, dt, A, B, C, h0, D, loop=False):
        B, C = (t.expand(-1, -1, H, -1) if t.shape[2] == 1 else t for t in (B, C))
        if loop:
            return ssd_token_loop(x, dt, A, B, C, h0, D)
        return ssd(x, dt, A, B, C, chunk_size=16, initial_state=h0, backend=backend, D=D)

    # the one group's gradient is a sum over the heads: 3e-4 leaves room for its cancellation
    check_against_loop(run, [x, dt, A, B, C, h0, D], tol=2e-5, grad_tol=3e-4)


@needs_triton
def test_triton_refuses_fp64_inputs_and_auto_computes_them_in_fp64():
    """The Triton kernels compute in fp32 and 16 bits: fp64 inputs asked of them by name are refused (they ran in
    fp32 behind the caller's back), and ``auto`` on the GPU path gives them to a backend that keeps fp64, with the
    initial state and ``D``, matching the fp64 loop to fp64 accuracy."""
    from kernels.device import gpu_path_on_cpu
    inputs = draw(2, int(torch.randint(5, 40, ())), 2, 16, 16, dtype=torch.float64)
    x, dt, A, B, C, h0, D = inputs
    with pytest.raises(BackendUnavailable, match="not fp64"):
        ssd(x, dt, A, B, C, chunk_size=16, initial_state=h0, backend="triton", D=D)

    def run(x, dt, A, B, C, h0, D, loop=False):
        if loop:
            return ssd_token_loop(x, dt, A, B, C, h0, D)
        with gpu_path_on_cpu():
            y, h = ssd(x, dt, A, B, C, chunk_size=16, initial_state=h0, D=D)
        assert y.dtype == h.dtype == torch.float64
        return y, h

    check_against_loop(run, inputs, tol=1e-10, grad_tol=1e-9)


def test_decode_step_adds_the_skip():
    """``ssd_step(..., D=D)`` token after token is the loop with ``y_t += D x_t``, outputs and state."""
    x, dt, A, B, C, h0, D = draw(2, 6, 3, 4, 5, dtype=torch.float64)
    y_ref, h_ref = ssd_token_loop(x, dt, A, B, C, h0, D)
    h = h0
    for t in range(x.shape[1]):
        y_t, h = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h, D=D)
        assert_rel_close(y_t, y_ref[:, t], 1e-12, f"token {t}")
    assert_rel_close(h, h_ref, 1e-12, "state")
