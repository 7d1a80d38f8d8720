"""Causal softmax attention: the Triton flash kernel and the reference against torch SDPA (an outside
oracle), forward and gradients, plus the ``attention()`` dispatcher for every backend.

On a CPU the Triton kernels run through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so shapes are tiny; the gpu-marked test runs at real size in bf16.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import _sdpa, attention, attention_reference, flash_attn_available
from tests.kernels.harness import (
    DEVICE,
    assert_rel_close,
    attention_backend_refused,
    compare_backends,
    needs_triton,
    rel_err,
)


def _qkv(b, t, s, h, d, dtype=torch.float32, device=DEVICE):
    return [torch.randn(b, n, h, d, dtype=dtype, device=device) for n in (t, s, s)]


def _sdpa_fn(causal, scale=None):
    return lambda q, k, v: _sdpa(q, k, v, causal, scale)


@needs_triton
@pytest.mark.parametrize("T,H,D,batch", [(17, 3, 16, 1), (64, 2, 32, 2), (100, 2, 16, 1)])
def test_triton_matches_sdpa_causal(T, H, D, batch):
    from kernels.attention.triton import attention_triton

    compare_backends(lambda q, k, v: attention_triton(q, k, v, causal=True), _sdpa_fn(True),
                     _qkv(batch, T, T, H, D), tol=1e-4)


@needs_triton
def test_triton_single_token():
    """T=1: the output is v and dV is dO exactly in exact arithmetic; dQ and dK are zero in exact
    arithmetic (a softmax over one key is constant), so they are checked in absolute terms."""
    from kernels.attention.triton import attention_triton

    q, k, v = (t.requires_grad_() for t in _qkv(2, 1, 1, 2, 16))
    out = attention_triton(q, k, v)
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert_rel_close(out, v.detach(), 1e-6, "out")
    assert_rel_close(dv, do, 1e-6, "dv")
    assert dq.abs().max() < 1e-5 * do.abs().max() * v.abs().max() * k.abs().max()
    assert dk.abs().max() < 1e-5 * do.abs().max() * v.abs().max() * q.abs().max()


@needs_triton
def test_triton_decode_alignment_and_noncausal_and_scale():
    """T_q < T_k aligns the queries to the end of the keys; non-causal; an explicit scale."""
    from kernels.attention.triton import attention_triton

    compare_backends(lambda q, k, v: attention_triton(q, k, v, causal=True), _sdpa_fn(True),
                     _qkv(2, 5, 37, 2, 16), tol=1e-4)
    compare_backends(lambda q, k, v: attention_triton(q, k, v, causal=False, scale=0.3), _sdpa_fn(False, 0.3),
                     _qkv(1, 20, 33, 2, 16), tol=1e-4)


@needs_triton
def test_triton_head_dim_not_power_of_two_and_strided_inputs():
    from kernels.attention.triton import attention_triton

    # a fused qkv projection gives non-contiguous (not even dense) q, k, v views; head dim 24 is padded
    # to a block of 32. compare_backends would clone the views into dense tensors, so this is by hand.
    qkv = torch.randn(2, 33, 3, 2, 24, device=DEVICE, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous() and q.stride(1) == 3 * 2 * 24
    out = attention_triton(q, k, v)
    do = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, do)
    ref_qkv = qkv.detach().double().requires_grad_()
    ref = _sdpa(*ref_qkv.unbind(2), True, None)
    (ref_grad,) = torch.autograd.grad(ref, ref_qkv, do.double())
    assert_rel_close(out, ref, 1e-4, "out")
    assert_rel_close(grad, ref_grad, 1e-4, "grad of qkv")


@needs_triton
def test_triton_fp16_close_to_fp32_reference():
    from kernels.attention.triton import attention_triton

    q, k, v = _qkv(1, 40, 40, 2, 16)
    out = attention_triton(q.half(), k.half(), v.half())
    assert out.dtype == torch.float16
    assert_rel_close(out.float(), attention_reference(q.double(), k.double(), v.double()).float(), 5e-3, "fp16 fwd")


@needs_triton
def test_triton_rejects_more_queries_than_keys():
    from kernels.attention.triton import attention_triton

    q, k, v = _qkv(1, 8, 4, 1, 16)
    with pytest.raises(ValueError, match="T_q <= T_k"):
        attention_triton(q, k, v, causal=True)


def test_reference_matches_sdpa_fp64():
    for t, s, causal in ((13, 13, True), (3, 11, True), (9, 6, False)):
        q, k, v = _qkv(2, t, s, 3, 8, dtype=torch.float64, device="cpu")
        compare_backends(lambda q, k, v: attention_reference(q, k, v, causal=causal), _sdpa_fn(causal),
                         [q, k, v], tol=1e-12)


def test_reference_is_causal():
    q, k, v = _qkv(1, 10, 10, 2, 8, dtype=torch.float64, device="cpu")
    out = attention_reference(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, 6:] += 1.0
    v2[:, 6:] -= 2.0
    out2 = attention_reference(q, k2, v2)
    assert torch.equal(out[:, :6], out2[:, :6])
    assert not torch.allclose(out[:, 6:], out2[:, 6:])


@pytest.mark.parametrize("backend", ["auto", "reference", "torch", "triton", "flash_attn"])
def test_dispatcher_every_backend(backend):
    q, k, v = _qkv(2, 19, 19, 2, 16)
    expected = attention_reference(q.double(), k.double(), v.double())
    if attention_backend_refused(attention, q, k, v, backend):
        return
    if backend == "flash_attn":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    out = attention(q, k, v, backend=backend)
    assert out.dtype == q.dtype
    assert_rel_close(out.double(), expected, 2e-2 if out.dtype == torch.bfloat16 else 1e-4, backend)


def test_dispatcher_rejects_unknown_backend():
    q, k, v = _qkv(1, 4, 4, 1, 8, device="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        attention(q, k, v, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_gpu_bf16_real_size_vs_sdpa_and_flash_attn(kv_heads):
    """Multi-head and grouped-query attention (8 query heads over ``kv_heads`` key/value heads) at real size."""
    from kernels.attention.triton import attention_triton

    B, T, H, D = 2, 2048, 8, 64
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, T, kv_heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    # the truth: fp32 SDPA on the same bf16 inputs, the key/value heads repeated (autograd sums their gradients)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    group = H // kv_heads
    ref = _sdpa(q32, k32.repeat_interleave(group, 2), v32.repeat_interleave(group, 2), True, None)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    out = attention_triton(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert rel_err(out, ref) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-2
    # bf16 SDPA (with enable_gqa under GQA) is the baseline a user would compare against: no worse than 2x its error
    sd = attention(q.detach(), k.detach(), v.detach(), backend="torch")
    assert rel_err(sd, ref) < 1e-2
    assert rel_err(out, ref) <= 2 * rel_err(sd, ref) + 1e-3
    if flash_attn_available():
        from flash_attn import flash_attn_func  # takes fewer key/value heads natively

        fa = flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
        assert rel_err(out, fa) < 1e-2
