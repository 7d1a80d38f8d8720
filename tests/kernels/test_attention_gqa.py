"""Grouped-query attention (GQA; Ainslie et al. 2023, arXiv 2305.13245) in the attention kernels: ``k`` and ``v``
with ``Hkv`` heads, a divisor of the ``H`` query heads, query head ``h`` reading key/value head ``h // (H / Hkv)``.

Every backend against an fp64 reference written here, independently of :mod:`kernels.attention.reference`: the
explicit ``softmax(q k^T / sqrt(d) + causal mask) v`` with each key/value head repeated ``H / Hkv`` times, and the
gradients of ``q``, ``k``, ``v`` from autograd through it (the gradient of a shared head is then the sum over the
query heads that read it). The Triton kernel indexes the shared head instead of copying it and sums those
gradients in its dK/dV programs: it runs here through the interpreter at tiny shapes (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU), in fp32 and fp16; tests/kernels/test_attention.py runs it at real size in bf16
on a GPU, GQA included.

Tolerances. fp32: the Triton kernel's relative error against the fp64 reference was at most 2.8e-7 (outputs)
and 3.6e-7 (gradients) over 200 fresh draws of every fp32 shape here, so 1e-5 leaves a factor of 27 while a
key/value head read or summed wrongly is off by O(1). fp16: inputs are rounded to fp16 first (the reference runs on
the rounded values), so the error is the kernel's own fp16 rounding of P, dS and the outputs (unit roundoff
2^-11 = 4.9e-4): at most 2.4e-4 (outputs) and 4.5e-4 (gradients) over 200 draws of the fp16 shapes here, held to
2e-3 and 4e-3 (8x and 9x).
"""
from __future__ import annotations

import pytest
import torch

import kernels.attention as attention_module
from kernels.attention import _sdpa, attention
from tests.kernels.harness import DEVICE, assert_rel_close, attention_backend_refused, needs_triton

FP32_TOL = 1e-5
FP16_TOL, FP16_GRAD_TOL = 2e-3, 4e-3
#: (H, Hkv): groups of 2 and 3, multi-query (Hkv = 1) and the plain multi-head case (Hkv = H)
GROUPS = [(4, 2), (6, 2), (3, 1), (2, 2)]


def gqa_reference(q, k, v, causal=True, scale=None):
    """The explicit formula in the inputs' dtype (fp64 in these tests): every key/value head repeated H / Hkv times
    in place, then ``softmax(q k^T * scale + causal mask) v``; queries aligned to the end of the keys."""
    H, Hkv = q.shape[2], k.shape[2]
    group = H // Hkv
    k = torch.stack([k[:, :, h // group] for h in range(H)], dim=2)
    v = torch.stack([v[:, :, h // group] for h in range(H)], dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        T, S = q.shape[1], k.shape[1]
        query_pos = torch.arange(S - T, S)[:, None]
        scores = scores.masked_fill(torch.arange(S)[None, :] > query_pos, float("-inf"))
    return torch.einsum("bhts,bshe->bthe", torch.softmax(scores, dim=-1), v)


def _inputs(B, T, S, H, Hkv, D, dtype=torch.float32, device=DEVICE):
    return (torch.randn(B, T, H, D, dtype=dtype, device=device), torch.randn(B, S, Hkv, D, dtype=dtype, device=device),
            torch.randn(B, S, Hkv, D, dtype=dtype, device=device))


def _value_and_grads(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def assert_matches_reference(fn, q, k, v, tol, grad_tol=None, causal=True, scale=None, label=""):
    """``fn``'s output and its gradients in q, k, v against autograd through :func:`gqa_reference` in fp64."""
    do = torch.randn(q.shape[:3] + v.shape[3:], dtype=q.dtype, device=q.device)
    got = _value_and_grads(fn, q, k, v, do)
    want = _value_and_grads(lambda *a: gqa_reference(*a, causal=causal, scale=scale),
                            q.double().cpu(), k.double().cpu(), v.double().cpu(), do.double().cpu())
    for what, g, w, t in zip(("out", "dq", "dk", "dv"), got, want, (tol, *[grad_tol or tol] * 3)):
        assert g.dtype == q.dtype, f"{label} {what}: dtype {g.dtype}"
        assert_rel_close(g.cpu(), w, t, f"{label} {what}")


# --- the reference itself ---------------------------------------------------------------------------------------


def test_reference_with_one_group_is_sdpa_and_its_dk_sums_the_group():
    """The test's own reference: at Hkv = H it is SDPA; at Hkv < H its dK of a shared head is the sum of the dK of
    the repeated heads (autograd through the repeat)."""
    q, k, v = _inputs(2, 9, 9, 4, 4, 8, torch.float64, "cpu")
    assert_rel_close(gqa_reference(q, k, v), _sdpa(q, k, v, True, None), 1e-12, "Hkv = H")
    q, k, v = _inputs(1, 7, 7, 4, 2, 8, torch.float64, "cpu")
    do = torch.randn(1, 7, 4, 8, dtype=torch.float64)
    _, _, dk, dv = _value_and_grads(gqa_reference, q, k, v, do)
    k_rep, v_rep = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    _, _, dk_rep, dv_rep = _value_and_grads(gqa_reference, q, k_rep, v_rep, do)
    assert_rel_close(dk, dk_rep.view(1, 7, 2, 2, 8).sum(3), 1e-12, "dk")
    assert_rel_close(dv, dv_rep.view(1, 7, 2, 2, 8).sum(3), 1e-12, "dv")


# --- the Triton kernel ------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("H,Hkv", GROUPS)
@pytest.mark.parametrize("T,D,batch", [(17, 16, 2), (40, 8, 1)])
def test_triton_gqa_fp32_causal(H, Hkv, T, D, batch):
    from kernels.attention.triton import attention_triton

    assert_matches_reference(lambda q, k, v: attention_triton(q, k, v, causal=True), *_inputs(batch, T, T, H, Hkv, D),
                             FP32_TOL, label=f"H={H} Hkv={Hkv}")


@needs_triton
@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 1)])
def test_triton_gqa_fp32_decode_alignment_noncausal_and_scale(H, Hkv):
    """Fewer queries than keys (decode against a cache, queries aligned to the end; one query), non-causal with an
    explicit scale."""
    from kernels.attention.triton import attention_triton

    for T, S in ((5, 37), (1, 21)):
        assert_matches_reference(lambda q, k, v: attention_triton(q, k, v, causal=True), *_inputs(2, T, S, H, Hkv, 16),
                                 FP32_TOL, label=f"T={T} S={S}")
    assert_matches_reference(lambda q, k, v: attention_triton(q, k, v, causal=False, scale=0.3),
                             *_inputs(1, 20, 33, H, Hkv, 16), FP32_TOL, causal=False, scale=0.3, label="non-causal")


@needs_triton
@pytest.mark.parametrize("H,Hkv", [(4, 2), (6, 3), (2, 1)])
def test_triton_gqa_fp16(H, Hkv):
    from kernels.attention.triton import attention_triton

    q, k, v = _inputs(2, 33, 33, H, Hkv, 16, torch.float16)
    assert_matches_reference(lambda q, k, v: attention_triton(q, k, v, causal=True), q, k, v, FP16_TOL, FP16_GRAD_TOL,
                             label="fp16")


@needs_triton
def test_triton_gqa_strided_views_of_a_fused_projection():
    """q, k, v as views of one fused ``q | k | v`` projection with fewer key/value heads (what the mixer passes on
    the GPU path): head dim 24 padded to a block of 32; the gradient of the fused tensor."""
    from kernels.attention.triton import attention_triton

    H, Hkv, D = 4, 2, 24
    qkv = torch.randn(2, 25, H + 2 * Hkv, D, device=DEVICE)
    do = torch.randn(2, 25, H, D, device=DEVICE)

    def run(fused, fn):
        fused = fused.detach().requires_grad_()
        q, k, v = fused.split((H, Hkv, Hkv), dim=2)
        out = fn(q, k, v)
        return out.detach(), torch.autograd.grad(out, fused, do.to(fused.dtype))[0]

    out, grad = run(qkv, lambda q, k, v: attention_triton(q, k, v))
    assert not qkv.split((H, Hkv, Hkv), dim=2)[1].is_contiguous()
    ref, ref_grad = run(qkv.double().cpu(), gqa_reference)
    assert_rel_close(out.cpu(), ref, FP32_TOL, "out")
    assert_rel_close(grad.cpu(), ref_grad, FP32_TOL, "grad of qkv")


@needs_triton
def test_triton_gqa_equals_triton_on_repeated_heads_with_summed_gradients():
    """Indexing the shared head computes what repeating it does: the same output and dQ, and the dK, dV of a shared
    head are the sums over its group of those of the repeated heads (both through the kernel)."""
    from kernels.attention.triton import attention_triton

    B, T, H, Hkv, D = 2, 19, 6, 2, 16
    q, k, v = _inputs(B, T, T, H, Hkv, D)
    do = torch.randn(B, T, H, D, device=DEVICE)
    out, dq, dk, dv = _value_and_grads(attention_triton, q, k, v, do)
    rep = [t.repeat_interleave(H // Hkv, dim=2) for t in (k, v)]
    out_r, dq_r, dk_r, dv_r = _value_and_grads(attention_triton, q, *rep, do)
    assert_rel_close(out, out_r, FP32_TOL, "out")
    assert_rel_close(dq, dq_r, FP32_TOL, "dq")
    assert_rel_close(dk, dk_r.view(B, T, Hkv, H // Hkv, D).sum(3), FP32_TOL, "dk")
    assert_rel_close(dv, dv_r.view(B, T, Hkv, H // Hkv, D).sum(3), FP32_TOL, "dv")


@needs_triton
def test_triton_refuses_key_value_heads_that_do_not_divide_the_query_heads():
    from kernels.attention.triton import attention_triton

    for Hkv in (3, 8):
        q, k, v = _inputs(1, 8, 8, 4, Hkv, 16)
        with pytest.raises(ValueError, match="divides q's"):
            attention_triton(q, k, v)


# --- every backend through the dispatcher ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "reference", "torch", "torch_native_gqa", "triton", "flash_attn"])
@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 1)])
def test_dispatcher_every_backend_gqa(backend, H, Hkv, monkeypatch):
    """``torch_native_gqa``: SDPA given the key/value heads as they are (``enable_gqa=True``), the path a CUDA
    FlashAttention kernel takes, forced here on the CPU (PyTorch's math kernel), against the repeated heads SDPA
    gets elsewhere."""
    q, k, v = _inputs(2, 19, 19, H, Hkv, 16)
    if backend == "torch_native_gqa":
        if not attention_module.SDPA_HAS_GQA:
            pytest.skip("this PyTorch's SDPA has no enable_gqa")
        monkeypatch.setattr(attention_module, "_sdpa_native_gqa", lambda q, masked: True)
        backend = "torch"
    if attention_backend_refused(attention, q, k, v, backend):
        return
    if backend == "flash_attn":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    low = q.dtype == torch.bfloat16
    assert_matches_reference(lambda q, k, v: attention(q, k, v, backend=backend), q, k, v,
                             2e-2 if low else FP32_TOL, 5e-2 if low else FP32_TOL, label=backend)


@pytest.mark.parametrize("native", [False, True])
def test_sdpa_gqa_decode_and_noncausal(native, monkeypatch):
    """SDPA's two GQA paths with an explicit mask (fewer queries than keys, causal) and without (one query against
    a cache, non-causal: what the mixer's decode step runs)."""
    if native and not attention_module.SDPA_HAS_GQA:
        pytest.skip("this PyTorch's SDPA has no enable_gqa")
    monkeypatch.setattr(attention_module, "_sdpa_native_gqa", lambda q, masked: native)
    for T, S, causal in ((5, 23, True), (1, 23, False), (9, 9, True)):
        assert_matches_reference(lambda q, k, v: attention(q, k, v, causal=causal, backend="torch"),
                                 *_inputs(2, T, S, 6, 2, 8, device="cpu"), FP32_TOL, causal=causal,
                                 label=f"T={T} S={S}")


def test_sdpa_repeats_the_heads_on_a_cpu():
    """Off CUDA no fused SDPA kernel takes the broadcast (its math kernel would): the heads are repeated."""
    assert not attention_module._sdpa_native_gqa(torch.empty(1, 4, 4, 64, dtype=torch.float16), masked=False)


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("k_heads,v_heads", [(3, 3), (2, 1), (8, 8)])
def test_dispatcher_refuses_heads_that_do_not_group(backend, k_heads, v_heads):
    q = torch.randn(1, 6, 4, 8)
    k, v = torch.randn(1, 6, k_heads, 8), torch.randn(1, 6, v_heads, 8)
    with pytest.raises(ValueError, match=r"attention: k of shape .* and v of shape .* divides q's H = 4"):
        attention(q, k, v, backend=backend)
