"""SKA's Triton kernels with 16-bit inputs against fp64: the chain alone (fp16 queries, fp32 factors), the
statistics (fp16 under the interpreter, bf16 at real sizes on a GPU) and the whole op (fp16 inputs under the
interpreter, bf16 at real sizes on a GPU). The operator kernels take the fp32 statistics whatever the input
dtype (tests/kernels/test_ska.py).

The inputs are rounded to the 16-bit dtype first and the fp64 reference runs on exactly those values.
The chain rounds its per-chunk operator ``W`` once to 16 bits (the queries and the output gradient are
exact in 16 bits); tolerances (relative Frobenius error):

- the chain alone, fp16: ``y`` (and ``dq``) carry ``W``'s rounding, u = 2^-11 relative per entry, so
  ~u/sqrt(3) ~ 3e-4 over a tensor; ``dW`` (hence dLinv, dA, dC) is an exact product of 16-bit values
  accumulated in fp32. Measured 2.8e-4..4e-4 (y, dq), 1.5e-7 (the factors' gradients, whose products are
  fp32's). Tolerance 1e-3 for y and dq, 1e-5 for the factors'.
- the whole op, fp16 inputs: the output and the gradients are rounded to fp16 (~2.8e-4) as well:
  measured 1.9e-4..4.5e-4. Tolerance 1e-3.
- the statistics, fp16 or bf16 inputs: the products of two 16-bit numbers are exact in fp32 and summed in
  fp32, so ``S`` is as exact as fp32 sums of at most T terms: measured 6e-8 (fp16, T 45); tolerance 1e-6, and
  1e-4 at T 4096 on a GPU (the tensor cores' own accumulation order). Their gradients are rounded to the
  input dtype at the end (~2.8e-4 fp16, ~2.3e-3 bf16 over a tensor) after products with ~16 (bf16) or ~22
  (fp16) bits of the fp32 suffix sums: measured 2e-4 (fp16); tolerance 1e-3 (fp16), 1e-2 (bf16).
- bf16 (GPU): u = 2^-8; tolerance 1e-2 forward, 2e-2 gradients.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_importable, triton_usable_for
from kernels.ska import ska, ska_chain, ska_chain_torch
from tests.kernels.harness import assert_rel_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    not (triton_importable() and triton_usable_for(torch.empty(0, device=DEVICE))),
    reason="triton cannot run here (no CUDA and no TRITON_INTERPRET=1)")


def _grads(fn, inputs, w):
    xs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*xs)
    (y * w).sum().backward()
    return y.detach(), [x.grad for x in xs]


def test_chain_fp16_queries_against_fp64():
    B, T, H, r, P, cs, p = 1, 45, 2, 16, 24, 16, 2     # T and P off the tiles: masking
    N = -(-T // cs)
    Linv = (torch.randn(B, N, H, r, r) * 0.3).tril() + torch.eye(r)
    A, C = torch.randn(B, N, H, r, r) * 0.2, torch.randn(B, N, H, P, r)
    q = torch.randn(B, T, H, r).half()
    w = torch.randn(B, T, H, P).half()                 # the upstream gradient of a 16-bit output
    y, g = _grads(lambda *a: ska_chain(*a, p, cs, backend="triton"), [Linv, A, C, q], w)
    y_ref, g_ref = _grads(lambda *a: ska_chain_torch(*a, p, cs), [t.double() for t in (Linv, A, C, q)], w.double())
    assert y.dtype == torch.float16 and g[3].dtype == torch.float16
    assert_rel_close(y, y_ref, 1e-3, "y")
    for name, a, b in zip(("Linv", "A", "C", "q"), g, g_ref):
        assert_rel_close(a, b, 1e-3 if name == "q" else 1e-5, f"d{name}")


def _statistics_against_fp64(dtype, B, T, H, r, P, chunk_size, mode, tol, grad_tol):
    from kernels.ska.triton import ska_statistics_triton
    from tests.kernels.test_ska import _explicit_statistics
    k, v = torch.randn(B, T, H, r, device=DEVICE).to(dtype), torch.randn(B, T, H, P, device=DEVICE).to(dtype)
    wts = (torch.rand(B, T, device=DEVICE) < 0.8).float()
    up = torch.randn(B, -(-T // chunk_size) if mode == "chunk_causal" else 1, H, 2 * r * r + P * r, device=DEVICE)
    S, g = _grads(lambda k, v: ska_statistics_triton(k, v, wts, chunk_size=chunk_size, mode=mode), [k, v], up)
    S_ref, g_ref = _grads(lambda k, v: _explicit_statistics(k, v, wts.double(), chunk_size, mode == "prefix"),
                          [k.double(), v.double()], up.double())
    assert S.dtype == torch.float32 and g[0].dtype == dtype
    assert_rel_close(S, S_ref, tol, "statistics")
    for name, a, b in zip("kv", g, g_ref):
        assert_rel_close(a, b, grad_tol, f"d{name}")


@pytest.mark.parametrize("mode,cs", [("chunk_causal", 16), ("prefix", 64)])
def test_statistics_fp16_against_fp64(mode, cs):
    _statistics_against_fp64(torch.float16, 1, 45, 2, 8, 12, cs, mode, tol=1e-6, grad_tol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("r,P", [(32, 64), (64, 128)])
def test_statistics_bf16_real_size(r, P):
    _statistics_against_fp64(torch.bfloat16, 2, 4096, 4, r, P, 64, "chunk_causal", tol=1e-4, grad_tol=1e-2)


@pytest.mark.parametrize("mode,cs", [("chunk_causal", 16), ("prefix", 1)])
def test_ska_fp16_against_fp64(mode, cs):
    B, T, H, r, P = 1, 40, 2, 8, 12
    q, k, v = (torch.randn(B, T, H, d).half() for d in (r, r, P))
    wts = (torch.rand(B, T) < 0.8).half()
    kw = dict(mode=mode, chunk_size=cs, ridge=0.05, normalisation="running_max", power=2)
    up = torch.randn(B, T, H, P).half()
    y, g = _grads(lambda q, k, v: ska(q, k, v, wts, backend="triton", **kw), [q, k, v], up)
    y_ref, g_ref = _grads(lambda q, k, v: ska(q, k, v, wts.double(), backend="torch", **kw),
                          [t.double() for t in (q, k, v)], up.double())
    assert y.dtype == torch.float16
    assert_rel_close(y, y_ref, 1e-3, "output")
    for name, a, b in zip("qkv", g, g_ref):
        assert_rel_close(a, b, 1e-3, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("r,P,cs", [(32, 64, 64), (64, 128, 128)])
def test_ska_bf16_real_size(r, P, cs):
    B, T, H = 2, 4096, 4
    q, k, v = (torch.randn(B, T, H, d, device=DEVICE).bfloat16() for d in (r, r, P))
    kw = dict(mode="chunk_causal", chunk_size=cs, normalisation="running_max", ridge=0.05, gamma=1.3)
    up = torch.randn(B, T, H, P, device=DEVICE).bfloat16()
    y, g = _grads(lambda q, k, v: ska(q, k, v, backend="triton", **kw), [q, k, v], up)
    y_ref, g_ref = _grads(lambda q, k, v: ska(q, k, v, backend="torch", **kw), [t.double() for t in (q, k, v)],
                          up.double())
    assert y.dtype == torch.bfloat16
    assert_rel_close(y, y_ref, 1e-2, "output")
    for name, a, b in zip("qkv", g, g_ref):
        assert_rel_close(a, b, 2e-2, f"d{name}")
