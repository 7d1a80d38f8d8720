"""Slot memory ("RAM-Net", arXiv:2602.11958) with repeated slot numbers within one token: a slot written twice has
no single decay, so every backend refuses it by name (they had resolved it differently), while a slot read twice is
well defined (read with both weights) and every backend agrees with the recurrence written out here."""
import pytest
import torch

from kernels.backend import triton_usable_for
from kernels.slots import slot_memory
from tests.kernels.harness import DEVICE, assert_rel_close

RUNS = [("reference", "auto"), ("torch", "dense"), ("torch", "sparse")]
if triton_usable_for(torch.empty(0, device=DEVICE)):
    RUNS.append(("triton", "auto"))
B, T, H, K, M, DV = 2, 5, 2, 3, 8, 4


def _distinct():
    return torch.stack([torch.randperm(M, device=DEVICE)[:K] for _ in range(B * T * H)]).view(B, T, H, K)


def _explicit(wi, ww, ri, rw, v, gamma, eps=1e-6):
    """Token by token in fp64 over the dense memory: the written slots decay by ``(1 - w)^gamma`` and add ``w v``."""
    ww, rw, v, gamma = (t.double() for t in (ww, rw, v, gamma))
    S = torch.zeros(B, H, M, DV, dtype=torch.float64, device=v.device)
    z = torch.zeros(B, H, M, dtype=torch.float64, device=v.device)
    outs = torch.zeros(B, T, H, DV, dtype=torch.float64, device=v.device)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                for j in range(K):
                    m, w = wi[b, t, h, j], ww[b, t, h, j]
                    d = (1 - w) ** gamma[h]
                    S[b, h, m] = d * S[b, h, m] + w * v[b, t, h]
                    z[b, h, m] = d * z[b, h, m] + w
                for j in range(K):
                    m = ri[b, t, h, j]
                    outs[b, t, h] += rw[b, t, h, j] * S[b, h, m] / (z[b, h, m] + eps)
    return outs, S, z


def _inputs():
    return (torch.rand(B, T, H, K, device=DEVICE) * 0.9 + 0.05, torch.rand(B, T, H, K, device=DEVICE),
            torch.randn(B, T, H, DV, device=DEVICE), torch.rand(H, device=DEVICE) + 0.5)


@pytest.mark.parametrize("backend,layout", RUNS)
def test_a_slot_written_twice_in_one_token_is_refused(backend, layout):
    ww, rw, v, gamma = _inputs()
    wi = _distinct()
    wi[1, 3, 0, 2] = wi[1, 3, 0, 0]
    with pytest.raises(ValueError, match="write_idx repeats a slot"):
        slot_memory(wi, ww, _distinct(), rw, v, gamma, M, backend=backend, layout=layout)


@pytest.mark.parametrize("chunk_size", [2, 32])   # several chunks (the chunk-start state read twice) and one
@pytest.mark.parametrize("backend,layout", RUNS)
def test_a_slot_read_twice_in_one_token_matches_the_recurrence(backend, layout, chunk_size):
    ww, rw, v, gamma = _inputs()
    wi, ri = _distinct(), _distinct()
    ri[..., 1] = ri[..., 0]
    o, (S, z) = slot_memory(wi, ww, ri, rw, v, gamma, M, backend=backend, layout=layout, chunk_size=chunk_size)
    o_ref, S_ref, z_ref = _explicit(wi, ww, ri, rw, v, gamma)
    assert_rel_close(o, o_ref, 1e-5, "output")
    assert_rel_close(S, S_ref, 1e-5, "memory")
    assert_rel_close(z, z_ref, 1e-5, "normaliser")


@pytest.mark.parametrize("backend,layout", RUNS[1:])
def test_a_slot_read_twice_has_the_gradients_of_the_reference_across_chunks(backend, layout):
    ww, rw, v, gamma = _inputs()
    wi, ri = _distinct(), _distinct()
    ri[..., 1] = ri[..., 0]
    up = torch.randn(B, T, H, DV, device=DEVICE, dtype=torch.float64)
    grads = {}
    for run, dtype in ((backend, torch.float32), ("reference", torch.float64)):
        xs = [x.to(dtype).requires_grad_() for x in (ww, rw, v, gamma)]
        o, _ = slot_memory(wi, xs[0], ri, xs[1], xs[2], xs[3], M, backend=run,
                           layout=layout if run == backend else "auto", chunk_size=2)
        grads[run] = torch.autograd.grad((o.double() * up).sum(), xs)
    for name, a, e in zip(("dw", "dr", "dv", "dgamma"), grads[backend], grads["reference"]):
        assert_rel_close(a, e, 1e-4, name)
