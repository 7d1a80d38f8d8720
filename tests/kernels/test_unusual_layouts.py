"""Inputs and upstream gradients of unusual layouts through the kernels' autograd Functions, against the
references: views whose strides the kernels read in place, one-token sequences, batches of different rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.delta import delta_product
from kernels.delta.reference import delta_product_reference
from kernels.ssd import ssd, ssd_reference
from tests.kernels.harness import compare_backends, needs_triton


@needs_triton
def test_delta_triton_one_token_heads_first_view():
    """A one-token query cut from a heads-first tensor, ``(B, H, 1, K).transpose(1, 2)``, counts as contiguous to
    PyTorch (the time stride of a size-1 dimension is free) but has no token stride the kernels can use: batch
    ``b`` must still be read at its own rows."""
    B, H, K, V = 2, 2, 16, 16
    q = torch.randn(B, H, 1, K).transpose(1, 2)
    k = F.normalize(torch.randn(B, H, 1, K), dim=-1).transpose(1, 2)
    v = torch.randn(B, 1, H, V)
    beta = torch.rand(B, 1, H)
    g = F.logsigmoid(torch.randn(B, 1, H) + 2)
    s0 = torch.randn(B, H, K, V)
    compare_backends(lambda q, k, v, b, g, s0: delta_product(q, k, v, b, g=g, initial_state=s0, backend="triton"),
                     lambda q, k, v, b, g, s0: delta_product_reference(q, k, v, b, g, initial_state=s0),
                     [q, k, v, beta, g, s0], tol=2e-5, grad_tol=5e-5)


@needs_triton
def test_ssd_triton_one_token_b_and_c_of_different_layouts():
    """``B`` cut from a heads-first tensor and ``C`` contiguous, one token: both count as contiguous to PyTorch but
    their strides differ along the size-1 time axis, and the backward reads both at one set of strides."""
    bsz, H, P, N = 2, 2, 16, 16
    x = torch.randn(bsz, 1, H, P)
    dt = F.softplus(torch.randn(bsz, 1, H))
    A = -torch.rand(H) - 0.5
    Bm = torch.randn(bsz, H, 1, N).transpose(1, 2)
    Cm = torch.randn(bsz, 1, H, N)
    s0 = torch.randn(bsz, H, N, P)
    compare_backends(lambda x, dt, A, B, C, s0: ssd(x, dt, A, B, C, initial_state=s0, backend="triton"),
                     lambda x, dt, A, B, C, s0: ssd_reference(x, dt, A, B, C, initial_state=s0),
                     [x, dt, A, Bm, Cm, s0], tol=2e-5, grad_tol=5e-5)
