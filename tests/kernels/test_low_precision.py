"""Every Triton kernel with fp16 (and, on a GPU, bf16) inputs against the fp64 reference, forward and gradients.

The inputs are drawn in fp32 and rounded to the low-precision dtype; the reference runs in fp64 on exactly
those rounded values, so the error measured is the kernel's own (its fp16/bf16 products and output
rounding), not the rounding of the inputs. Tolerances, relative Frobenius error over the whole tensor
(as flash-linear-attention's tests compare), per dtype:

===========  =========  ==========  ======================================================================
dtype        forward    gradients   why
===========  =========  ==========  ======================================================================
fp16         5e-3       1e-2        unit roundoff 4.9e-4; outputs and gradients are rounded to fp16 once,
                                    attention also multiplies in fp16 (fp32 accumulators)
bf16         2e-2       4e-2        unit roundoff 3.9e-3 (8x fp16's)
===========  =========  ==========  ======================================================================

bf16 runs only on a CUDA device: the Triton interpreter computes bf16 arithmetic wrongly (it emulates
bf16 with numpy types that do not round like the hardware), so a CPU result would test the interpreter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import attention, attention_reference
from kernels.backend import triton_importable, triton_usable_for
from kernels.blockscan import block_scan, jordan_scan, jordan_scan_normed
from kernels.blockscan.reference import block_scan_reference, jordan_scan_normed_reference, jordan_scan_reference
from kernels.delta import delta_product
from kernels.delta.reference import delta_product_reference
from kernels.gka import gka
from kernels.gka.reference import gka_reference
from kernels.ska import ska_chain, ska_chain_torch
from kernels.slots import slot_memory
from kernels.ssd import ssd
from tests.kernels.harness import compare_backends, ssd_reference_any_A
from tests.kernels.test_slots import _reference as _slot_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float16: (5e-3, 1e-2), torch.bfloat16: (2e-2, 4e-2)}
DTYPES = [torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]  # bf16: see the module docstring

pytestmark = pytest.mark.skipif(
    not (triton_importable() and triton_usable_for(torch.empty(0, device=DEVICE))),
    reason="triton cannot run here (no CUDA and no TRITON_INTERPRET=1)")


def _low(dtype, *xs):
    return [x.to(DEVICE, dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in xs]


def _check(fn, ref, inputs, dtype, shared=None):
    tol, grad_tol = TOLERANCES[dtype]
    compare_backends(fn, ref, inputs, tol=tol, grad_tol=grad_tol, shared=shared)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(dtype):
    q, k, v = (torch.randn(2, 40, 2, 16) for _ in range(3))
    _check(lambda q, k, v: attention(q, k, v, backend="triton"), lambda q, k, v: attention_reference(q, k, v),
           _low(dtype, q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_product(dtype):
    n, B, T, H, D = 2, 1, 19, 2, 16
    q = torch.randn(B, T, H, D)
    k = F.normalize(torch.randn(B, T * n, H, D), dim=-1)
    v, beta = torch.randn(B, T * n, H, D), torch.rand(B, T * n, H) * 2
    g, s0 = F.logsigmoid(torch.randn(B, T, H) + 2), torch.randn(B, H, D, D)
    _check(lambda *a: delta_product(*a[:4], g=a[4], num_householder=n, initial_state=a[5], chunk_size=16, backend="triton"),
           lambda *a: delta_product_reference(*a[:5], n, initial_state=a[5]), _low(dtype, q, k, v, beta, g, s0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd(dtype):
    b, T, H, P, N = 2, 37, 2, 8, 16
    x, B, C = torch.randn(b, T, H, P), torch.randn(b, T, H, N), torch.randn(b, T, H, N)
    dt = F.softplus(torch.randn(b, T, H) - 1.0)
    A, h0 = -(torch.rand(H) * 2 + 0.5), torch.randn(b, H, N, P)
    _check(lambda x, dt, A, B, C, h0: ssd(x, dt, A, B, C, chunk_size=16, initial_state=h0, backend="triton"),
           lambda x, dt, A, B, C, h0: ssd_reference_any_A(x, dt, A, B, C, initial_state=h0),
           _low(dtype, x, dt, A, B, C, h0), dtype, shared={2: (b, T, H)})  # dA: a sum over every token


@pytest.mark.parametrize("dtype", DTYPES)
def test_ska_chain(dtype):
    Bz, T, H, r, P, cs, p = 1, 37, 2, 16, 16, 16, 2
    n = -(-T // cs)
    Linv = (torch.randn(Bz, n, H, r, r) * 0.3).tril() + torch.eye(r)
    A, C, q = torch.randn(Bz, n, H, r, r) * 0.2, torch.randn(Bz, n, H, P, r), torch.randn(Bz, T, H, r)
    _check(lambda *a: ska_chain(*a, p, cs, backend="triton"), lambda *a: ska_chain_torch(*a, p, cs),
           _low(dtype, Linv, A, C, q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_and_jordan_scans(dtype):
    B, T, N, m = 2, 23, 3, 4
    A = torch.softmax(torch.randn(B, T, N, m, m), -1) * 0.9
    b, h0 = torch.randn(B, T, N, m), torch.randn(B, N, m)
    _check(lambda A, b, h0: block_scan(A, b, h0, backend="triton"),
           lambda A, b, h0: block_scan_reference(A, b, h0), _low(dtype, A, b, h0), dtype)
    lam, c = 0.05 + 0.9 * torch.rand(B, T, N), torch.rand(B, T, N) - 0.5
    _check(lambda lam, c, b, h0: jordan_scan(lam, c, b, h0, backend="triton"),
           lambda lam, c, b, h0: jordan_scan_reference(lam, c, b, h0), _low(dtype, lam, c, b, h0), dtype)
    w, bias = 1 + 0.1 * torch.randn(N, m), 0.1 * torch.randn(N, m)
    _check(lambda lam, c, b, w, bias, h0: jordan_scan_normed(lam, c, b, w, bias, initial_state=h0, backend="triton"),
           lambda lam, c, b, w, bias, h0: jordan_scan_normed_reference(lam, c, b, w, bias, initial_state=h0),
           _low(dtype, lam, c, b, w, bias, h0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gka(dtype):
    B, T, H, d = 1, 37, 2, 16
    q = F.normalize(torch.randn(B, T, H, d), dim=-1)
    beta = torch.rand(B, T, H, 1) * 0.8 + 0.2
    k, v = F.normalize(torch.randn(B, T, H, d), dim=-1) * beta, torch.randn(B, T, H, d) * beta
    g, alpha = -torch.rand(B, T, H) * 0.3, torch.rand(B, T, H)
    _check(lambda *a: gka(*a, chunk_size=16, num_iter=30, backend="triton")[0],
           lambda *a: gka_reference(*a, num_iter=30)[0], _low(dtype, q, k, v, g, alpha), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slot_memory(dtype):
    """bf16 / fp16 inputs through the Triton slot memory, against the fp32 reference, returned in the input dtype."""
    B, T, H, M, K, dv = 1, 9, 2, 16, 3, 8
    write_idx, read_idx = (torch.stack([torch.randperm(M)[:K] for _ in range(B * T * H)]).view(B, T, H, K).to(DEVICE)
                           for _ in range(2))
    write_w, read_w = torch.rand(B, T, H, K) * 0.98 + 0.01, torch.rand(B, T, H, K)
    v, gamma = torch.randn(B, T, H, dv), torch.rand(H) * 1.5 + 0.25
    reference = _slot_reference(M)
    # d gamma sums one signed term per write and can cancel to a small fraction of its terms: its tolerance
    # is scaled by how much they cancel on the draw (gamma given per token and slot, as the harness expands it)
    _check(lambda ww, rw, v, gamma: slot_memory(write_idx, ww, read_idx, rw, v, gamma, M, backend="triton")[0],
           lambda ww, rw, v, gamma: reference(write_idx, ww, read_idx, rw, v, gamma)[0],
           _low(dtype, write_w, read_w, v, gamma), dtype, shared={3: (B, T, M, H)})
