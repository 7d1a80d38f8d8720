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
        assert_rel_close(a, b, 1e-5 if n in ("output", "S_T", "z_T") else 1e-4, f"{kernel} {n}")
