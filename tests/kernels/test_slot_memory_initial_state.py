"""Slot memory with a given initial state ``(S_0, z_0)``: every backend leaves the caller's tensors as they were,
and its outputs, final state and gradients (of the weights, values, gamma and the initial state) match the fp64
token loop, also when the final state of one call is the initial state of the next and when a gradient then
flows back through both calls. The shapes cover both Triton layouts (the chunk-parallel kernels up to
``CHUNKED_MAX_SLOTS`` slots, the sparse scan above it) with ``d_v`` in one tile of the sparse scan and in two.

On a CPU the Triton kernels run through the interpreter (tests/conftest.py): tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from kernels.slots import slot_memory
from kernels.slots.triton import CHUNKED_MAX_SLOTS
from tests.kernels.harness import DEVICE, assert_rel_close, needs_triton

KERNELS = {
    "reference": dict(backend="reference"),
    "dense": dict(backend="torch", layout="dense", chunk_size=4),
    "sparse": dict(backend="torch", layout="sparse"),
    "triton": pytest.param(dict(backend="triton", chunk_size=16), marks=needs_triton),
}


def _draw(B, T, H, M, K, dv):
    idx = [torch.rand(B, T, H, M, device=DEVICE).argsort(-1)[..., :K].contiguous() for _ in range(2)]
    return dict(wi=idx[0], ri=idx[1], w=torch.rand(B, T, H, K, device=DEVICE) * 0.9 + 0.05,
                r=torch.rand(B, T, H, K, device=DEVICE), v=torch.randn(B, T, H, dv, device=DEVICE),
                gamma=torch.rand(H, device=DEVICE) * 1.5 + 0.25, S0=torch.randn(B, H, M, dv, device=DEVICE),
                z0=torch.rand(B, H, M, device=DEVICE) + 0.1)


def _two_calls(d, M, split, dtype, kw):
    """Outputs, final state and gradients of two chained calls (the first call's final state is the second's
    initial state), from the initial state ``(S0, z0)``; the loss weighs outputs and the final state."""
    leaves = {n: d[n].to(dtype).requires_grad_() for n in ("w", "r", "v", "gamma", "S0", "z0")}
    kept = {n: leaves[n].detach().clone() for n in ("S0", "z0")}
    state, outs = (leaves["S0"], leaves["z0"]), []
    for part in (slice(0, split), slice(split, None)):
        o, state = slot_memory(d["wi"][:, part], leaves["w"][:, part], d["ri"][:, part], leaves["r"][:, part],
                               leaves["v"][:, part], leaves["gamma"], M, initial_state=state, **kw)
        outs.append(o)
    o, (S, z) = torch.cat(outs, 1), state
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    cot = [torch.randn(t.shape, generator=gen, device=DEVICE, dtype=torch.float64).to(dtype) for t in (o, S, z)]
    loss = sum((a * b).sum() for a, b in zip((o, S, z), cot))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    for n in ("S0", "z0"):
        assert torch.equal(leaves[n].detach(), kept[n]), f"{kw}: the caller's {n} was changed"
    return [o, S, z, *grads]


@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
@pytest.mark.parametrize("M,dv", [(20, 5), (CHUNKED_MAX_SLOTS + 4, 5), (CHUNKED_MAX_SLOTS + 4, 40)])
def test_initial_state_is_read_not_written(kernel, M, dv):
    d = _draw(2, 7, 2, M, 3, dv)
    want = _two_calls(d, M, 3, torch.float64, dict(backend="reference"))
    got = _two_calls(d, M, 3, torch.float32, kernel)
    names = ["output", "S_T", "z_T", "dw", "dr", "dv", "dgamma", "dS_0", "dz_0"]
    for n, a, b in zip(names, got, want):
        tol = 1e-5 if n in ("output", "S_T", "z_T") else 1e-4
        assert_rel_close(a, b, tol * (_gamma_cancellation(d, M) if n == "dgamma" else 1.0), f"{kernel} {n}")


def _gamma_cancellation(d, M):
    """``||sum |terms||| / ||sum terms||`` (at least 1) of gamma's gradient under :func:`_two_calls`' loss.

    gamma's gradient sums one signed term per write and value channel (and H = 2 heads give a norm over two
    sums only), so on some draws it cancels to a small fraction of its terms and its relative error has no
    fixed bound; its error stays bounded relative to the terms' magnitudes. The terms are the gradient of
    gamma given per token, slot and head (tests/kernels/test_slots.py's dense formula, one call: two chained
    calls compute the same function), one value channel of one upstream gradient at a time."""
    from tests.kernels.test_slots import _dense_formula

    B, T, H, dv = d["v"].shape
    x = {n: d[n].double() for n in ("w", "r", "v", "gamma", "S0", "z0")}
    gamma = x["gamma"].expand(B, T, M, H).clone().requires_grad_()
    outs = _dense_formula(d["wi"], x["w"], d["ri"], x["r"], x["v"], gamma, M, x["S0"], x["z0"])
    gen = torch.Generator(device=DEVICE).manual_seed(7)      # the upstream gradients of _two_calls
    cot = [torch.randn(t.shape, generator=gen, device=DEVICE, dtype=torch.float64) for t in outs]
    total = magnitude = 0.0
    for out, up in zip(outs, cot):
        channels = up.unsqueeze(-1) if out.dim() == 3 else up      # z has no value channel
        for j in range(channels.shape[-1]):
            piece = torch.zeros_like(channels)
            piece[..., j] = channels[..., j]
            terms, = torch.autograd.grad(out, gamma, piece.view(out.shape), retain_graph=True)
            total, magnitude = total + terms, magnitude + terms.abs()
    sums = [t.sum((0, 1, 2)).norm() for t in (magnitude, total)]
    return max(1.0, (sums[0] / sums[1].clamp_min(1e-300)).item())
