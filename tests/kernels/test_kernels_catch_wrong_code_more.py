"""Checks aimed at Triton kernel paths whose wrong versions the family tests let through: each test compares
one path, forward and gradients, against the family's fp64 token-by-token reference on fresh random inputs.

- SKA with a ``gamma`` below the clamp's lower bound: ``A = clamp(gamma, 1, gamma_max) A_w / max(sigma, 1)``,
  so such a head computes what ``gamma = 1`` computes and its ``gamma`` gets no gradient. The family's Triton
  tests draw ``gamma`` in ``[1, gamma_max]`` or above it, where a kernel that drops the lower bound (in the
  operator's forward, or in the mask of its ``gamma`` gradient) gives the right answer.
- The slot memory with full writes (``w = 1``, e.g. one write per token or a saturated address softmax): the
  decay ``gamma log(1 - min(w, W_MAX))`` is clamped there, so the weight's gradient has no decay term. The
  family's tests draw ``w <= 0.99``, where a backward that forgets the clamp is right.
- Options the family tests leave at their defaults, which a Triton path that ignores them passes: GKA's ridge
  ``lambda_t = ridge_a ||H_t||_F + ridge_eps`` and the slot memory's read normaliser ``r / (z + eps)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gka import gka, gka_reference
from kernels.ska import ska, ska_reference
from kernels.slots import slot_memory, slot_memory_reference
from tests.kernels.harness import compare_backends, needs_triton, value_and_grads


@needs_triton
def test_triton_ska_gamma_below_one_is_clamped_to_one_forward_and_gradients():
    """Head 0's gamma (0.2..0.9) is below the clamp, head 1's (1.05..1.45) inside it: fp32 Triton against the
    fp64 reference (q, k, v and gamma's gradients), and head 0's gamma gradient exactly zero. Two chunks of 4
    and a partial third, power 2 (A is read twice). Measured ~1e-6; tolerances 1e-4 (output), 1e-3
    (gradients), as the family's end-to-end Triton test."""
    B, T, H, r, P = 1, 11, 2, 4, 5
    q, k, v = torch.randn(B, T, H, r), torch.randn(B, T, H, r), torch.randn(B, T, H, P)
    gamma = torch.stack([0.2 + 0.7 * torch.rand(()), 1.05 + 0.4 * torch.rand(())])
    kw = dict(mode="chunk_causal", chunk_size=4, ridge=0.1, power=2, gamma_max=1.5)
    compare_backends(lambda q, k, v, g: ska(q, k, v, gamma=g, backend="triton", **kw),
                     lambda q, k, v, g: ska_reference(q, k, v, gamma=g, **kw),
                     [q, k, v, gamma], tol=1e-4, grad_tol=1e-3)
    dgamma = value_and_grads(lambda g: ska(q, k, v, gamma=g, backend="triton", **kw), [gamma],
                             torch.randn(B, T, H, P))[1]
    assert dgamma[0] == 0, f"gamma {gamma[0]:.3f} < 1 is clamped to 1 and takes no gradient, got {dgamma[0]:.3e}"


@needs_triton
def test_triton_slot_memory_full_writes_take_no_decay_gradient():
    """About a third of the writes have ``w = 1`` exactly, the rest ``w`` in [0.01, 0.99]; M = 16 slots (the
    chunked layout), T = 37 in chunks of 16 (the last one partial), with an initial state. fp32 Triton against
    the fp64 token loop: output, final state and the gradients of w, r, v and the initial state (gamma is held
    fixed: its gradient is the family tests' concern). Tolerance 1e-5, or 4x what the fp32 token loop misses by
    on the draw: ``W_MAX = 1 - 1e-6`` is ``1 - 1.013e-6`` in fp32, so a full write keeps ``(1 - W_MAX)^gamma``
    about ``1.3 gamma`` percent apart from fp64's, which at a small gamma moves the output by up to ~1e-4 on
    every fp32 path alike (a backward that forgets the clamp is off by ~1e6 x the decay gradient)."""
    B, T, H, M, K, dv = 2, 37, 2, 16, 3, 5
    wi = torch.rand(B, T, H, M).argsort(-1)[..., :K].contiguous()
    ri = torch.rand(B, T, H, M).argsort(-1)[..., :K].contiguous()
    ww = torch.rand(B, T, H, K) * 0.98 + 0.01
    ww = torch.where(torch.rand(B, T, H, K) < 0.35, torch.ones_like(ww), ww)
    rw, v = torch.rand(B, T, H, K), torch.randn(B, T, H, dv)
    gamma = torch.rand(H) * 1.5 + 0.25
    S0, z0 = torch.randn(B, H, M, dv), torch.rand(B, H, M) + 0.1

    def run(fn, **kw):
        def call(ww, rw, v, S0, z0):
            o, (S, z) = fn(wi, ww, ri, rw, v, gamma.to(v.dtype), M, initial_state=(S0, z0), **kw)
            return o, S, z
        return call

    compare_backends(run(slot_memory, backend="triton", chunk_size=16), run(slot_memory_reference),
                     [ww, rw, v, S0, z0], tol=1e-5, rounding_factor=4)


@needs_triton
def test_triton_gka_takes_the_ridge_it_is_given():
    """``ridge_a`` in [0.05, 0.15] and ``ridge_eps`` in [0.01, 0.06] (defaults 0.02 and 1e-6; both move every
    ``lambda_t`` by O(1) of itself): fp32 Triton against the fp64 token loop, 12 Chebyshev iterations, outputs
    and the gradients of q, k, v, g and alpha. T 37 in chunks of 16 (a partial last chunk), d 12 (a masked head
    dimension). Measured ~1e-7; tolerance 3e-5, as the family's Triton state test."""
    B, T, H, d = 1, 37, 2, 12
    q = F.normalize(torch.randn(B, T, H, d), dim=-1)
    k = F.normalize(torch.randn(B, T, H, d), dim=-1) * (torch.rand(B, T, H, 1) * 0.8 + 0.2)
    v, g, alpha = torch.randn(B, T, H, d), -torch.rand(B, T, H) * 0.3, torch.rand(B, T, H)
    kw = dict(num_iter=12, ridge_a=0.05 + 0.1 * torch.rand(()).item(), ridge_eps=0.01 + 0.05 * torch.rand(()).item())
    compare_backends(lambda *a: gka(*a, backend="triton", chunk_size=16, **kw)[0],
                     lambda *a: gka_reference(*a, **kw)[0], [q, k, v, g, alpha], tol=3e-5)


@needs_triton
def test_triton_slot_memory_takes_the_eps_it_is_given():
    """``eps`` in [0.2, 0.7] (default 1e-6), comparable to the normalisers ``z``: fp32 Triton against the fp64
    token loop given the same eps, output, final state and the gradients of w, r and v; M = 16 slots (the
    chunked layout), T 37 in chunks of 16. Measured ~1e-7; tolerance 1e-5."""
    B, T, H, M, K, dv = 2, 37, 2, 16, 3, 5
    wi = torch.rand(B, T, H, M).argsort(-1)[..., :K].contiguous()
    ri = torch.rand(B, T, H, M).argsort(-1)[..., :K].contiguous()
    ww, rw = torch.rand(B, T, H, K) * 0.98 + 0.01, torch.rand(B, T, H, K)
    v, gamma = torch.randn(B, T, H, dv), torch.rand(H) * 1.5 + 0.25
    eps = 0.2 + 0.5 * torch.rand(()).item()

    def run(fn, **kw):
        def call(ww, rw, v):
            o, (S, z) = fn(wi, ww, ri, rw, v, gamma.to(v.dtype), M, eps=eps, **kw)
            return o, S, z
        return call

    compare_backends(run(slot_memory, backend="triton", chunk_size=16), run(slot_memory_reference), [ww, rw, v],
                     tol=1e-5)
