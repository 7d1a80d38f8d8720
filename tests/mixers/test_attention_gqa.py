"""The attention mixer's ``n_kv_heads`` option: grouped-query attention (GQA; Ainslie et al. 2023, arXiv 2305.13245).

- Unset, the layer is the multi-head layer it was: the qkv projection keeps its ``(3 H d, d_model)`` shape, so an
  existing checkpoint's state_dict loads, and ``n_kv_heads = n_heads`` computes the same thing bit for bit.
- A divisor of ``n_heads`` is taken; anything else is refused with one line naming both and the fix.
- Outputs and gradients (input and weights) of every backend against an fp64 reference written here: the
  projection split into ``H d | Hkv d | Hkv d`` features, RoPE on q and k (its own few lines), then the explicit
  ``softmax(q k^T / sqrt(d) + causal mask) v`` with each key/value head repeated ``H / Hkv`` times.
- Prefill then decode, and token-by-token decode from ``init_state``, equal the full forward on every backend; the
  KV cache holds ``2 T Hkv d`` elements, as ``state_size`` says.
- The whole Mixer contract (tests/mixers/contract.py) holds with GQA options, as ``test_contract.py`` runs it
  with the default ones; and the GPU path (Triton rotary and attention through the interpreter) equals the CPU
  path.

Tolerances: fp32 paths against the fp64 reference within 1e-5: over 100 fresh draws the largest error of output,
input and weight gradients was 3.1e-7 (reference, torch and Triton backends alike), while a key/value head read or
summed wrongly is off by O(1). The fp16 Triton layer (fp16 weights, projections and kernel) against fp64 on the
same weights and inputs: at most 4.9e-4 over 100 draws (fp16 unit roundoff 4.9e-4), held to 4e-3 (8x).
"""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.backend import triton_usable_for
from mixers import MIXERS, build_mixer
from mixers.options import OptionError
from tests.kernels.harness import assert_rel_close, needs_triton
from tests.mixers.gpu_path import assert_gpu_path_matches

from . import contract
from .test_contract import BY_DTYPE, SIMPLE

D_MODEL = 32
Attention = MIXERS.get("attention")
#: (n_heads, n_kv_heads): groups of two, of three and multi-query attention
GQA = [(4, 2), (6, 2), (4, 1)]
BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]


def make(n_heads, n_kv_heads=None, dtype=torch.float32, **extra):
    options = {"n_heads": n_heads, "head_dim": 8, **extra}
    if n_kv_heads is not None:
        options["n_kv_heads"] = n_kv_heads
    return build_mixer("attention", D_MODEL, options).to(dtype)


# --- the option ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 3), (2, 4), (6, 4)])
def test_kv_heads_that_do_not_divide_the_heads_are_refused(n_heads, n_kv_heads):
    with pytest.raises(OptionError, match=rf"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}.*set "
                                          rf"n_kv_heads to a divisor of n_heads") as err:
        make(n_heads, n_kv_heads)
    assert "\n" not in str(err.value)


def test_zero_kv_heads_is_out_of_range():
    with pytest.raises(OptionError, match="n_kv_heads: 0 is out of range: must be >= 1"):
        make(4, 0)


def test_an_options_object_changed_after_validation_is_still_refused():
    options = Attention.Options(n_heads=4)
    options.n_kv_heads = 3
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        Attention(D_MODEL, options)


def test_unset_keeps_the_multi_head_layout_and_an_old_checkpoint_loads():
    """Unset: the projection is (3 H d, d_model) as before the option, a state_dict saved at the default loads into
    n_kv_heads = n_heads and back, and the two compute the same thing bit for bit."""
    default, explicit = make(4), make(4, 4)
    assert default.n_kv_heads == 4 and default.qkv.weight.shape == (3 * 4 * 8, D_MODEL)
    assert {k: v.shape for k, v in default.state_dict().items()} == \
        {k: v.shape for k, v in explicit.state_dict().items()}
    explicit.load_state_dict(default.state_dict())
    x = torch.randn(2, 11, D_MODEL)
    with torch.no_grad():
        assert torch.equal(default(x), explicit(x))
    assert default.state_size(7) == 2 * 7 * 4 * 8
    gqa = make(4, 2)
    assert gqa.qkv.weight.shape == ((4 + 2 * 2) * 8, D_MODEL) and gqa.out.weight.shape == (D_MODEL, 4 * 8)
    with pytest.raises(RuntimeError, match="size mismatch"):
        gqa.load_state_dict(default.state_dict())


def test_the_option_is_left_out_of_a_resolved_recipe_at_its_default():
    """Recipes recorded before the option keep their keys (and hashes): unset, it is omitted."""
    from mixers.options import plain_options

    assert "n_kv_heads" not in plain_options(Attention.Options(n_heads=4))
    assert plain_options(Attention.Options(n_heads=4, n_kv_heads=2))["n_kv_heads"] == 2


# --- against an fp64 reference ------------------------------------------------------------------------------------


def rope(x, positions, base):
    """Rotate the two halves of the last dim of ``x (B, T, H, D)`` by the angles ``p * base^(-i / (D/2))``."""
    half = x.shape[-1] // 2
    angle = positions.double()[:, None] * base ** (-torch.arange(half, dtype=torch.float64) / half)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def reference_layer(x, w_qkv, w_out, H, Hkv, d, base):
    """The layer in fp64 from its weights: q | k | v features, RoPE, each key/value head repeated, softmax, out."""
    B, T, _ = x.shape
    qkv = x @ w_qkv.T
    q = qkv[..., :H * d].reshape(B, T, H, d)
    k = qkv[..., H * d:(H + Hkv) * d].reshape(B, T, Hkv, d)
    v = qkv[..., (H + Hkv) * d:].reshape(B, T, Hkv, d)
    pos = torch.arange(T)
    q, k = rope(q, pos, base), rope(k, pos, base)
    group = H // Hkv
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, -1), v)
    return o.reshape(B, T, H * d) @ w_out.T


def _grads_of(y, x, layer_params, dy):
    return torch.autograd.grad(y, (x, *layer_params), dy)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_heads,n_kv_heads", GQA)
def test_output_and_gradients_match_the_fp64_reference(backend, n_heads, n_kv_heads):
    m = make(n_heads, n_kv_heads, backend=backend)
    T = 19
    x = torch.randn(2, T, D_MODEL, requires_grad=True)
    dy = torch.randn(2, T, D_MODEL)
    y = m(x)
    got = [y, *_grads_of(y, x, (m.qkv.weight, m.out.weight), dy)]
    x64 = x.detach().double().requires_grad_()
    w = [m.qkv.weight.detach().double().requires_grad_(), m.out.weight.detach().double().requires_grad_()]
    y64 = reference_layer(x64, *w, n_heads, n_kv_heads, 8, m.options.rope_base)
    want = [y64, *_grads_of(y64, x64, w, dy.double())]
    for what, g, r in zip(("output", "dx", "d qkv.weight", "d out.weight"), got, want):
        assert_rel_close(g, r, 1e-5, f"{backend} H={n_heads} Hkv={n_kv_heads} {what}")


@needs_triton
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 1)])
def test_triton_fp16_layer_close_to_the_fp64_reference(n_heads, n_kv_heads):
    m = make(n_heads, n_kv_heads, torch.float16, backend="triton")
    x = torch.randn(2, 17, D_MODEL, dtype=torch.float16)
    with torch.no_grad():
        y = m(x)
    ref = reference_layer(x.double(), m.qkv.weight.double(), m.out.weight.double(), n_heads, n_kv_heads, 8,
                          m.options.rope_base)
    assert y.dtype == torch.float16
    assert_rel_close(y, ref, 4e-3, "fp16 triton layer")


# --- decode, streaming and the cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("torch", torch.float64)] + [
    pytest.param(b, torch.float32, marks=needs_triton) if b == "triton" else (b, torch.float32)
    for b in ("reference", "torch", "triton")])  # the Triton kernel takes fp32 and 16-bit inputs, not fp64
@pytest.mark.parametrize("n_heads,n_kv_heads", GQA)
def test_prefill_then_decode_and_token_by_token_equal_the_forward(backend, n_heads, n_kv_heads, dtype):
    m = make(n_heads, n_kv_heads, dtype, backend=backend)
    B, T, split = 2, 21, 13
    x = torch.randn(B, T, D_MODEL, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    with torch.no_grad():
        y = m(x)
        y_pre, state = m.prefill(x[:, :split])
        assert state["k"].shape == state["v"].shape == (B, split, n_kv_heads, 8)
        ys = [y_pre]
        for t in range(split, T):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
        y_rec, final = m.forward_recurrent(x)
        _, full = m.prefill(x)
    assert_rel_close(torch.cat(ys, 1), y, tol, "prefill + decode")
    assert_rel_close(y_rec, y, tol, "decode from init_state")
    for key in ("k", "v"):  # the cache decode builds is the cache a prefill of the whole sequence returns
        assert_rel_close(state[key], full[key], tol, f"decoded cache {key}")
        assert_rel_close(final[key], full[key], tol, f"cache {key} from init_state")


@pytest.mark.parametrize("n_heads,n_kv_heads", GQA + [(4, None)])
def test_the_kv_cache_holds_the_kv_heads_only(n_heads, n_kv_heads):
    m = make(n_heads, n_kv_heads)
    Hkv = n_kv_heads or n_heads
    B = 3
    empty = m.init_state(B)
    assert empty["k"].shape == empty["v"].shape == (B, 0, Hkv, 8)
    for T in (1, 6, 17):
        with torch.no_grad():
            _, state = m.prefill(torch.randn(B, T, D_MODEL))
            _, stepped = m.step(torch.randn(B, D_MODEL), state)
        assert sum(t.numel() for t in state.values()) == B * m.state_size(T) == B * 2 * T * Hkv * 8
        assert sum(t.numel() for t in stepped.values()) == B * m.state_size(T + 1)
    assert m.state_size(1000) * n_heads == make(n_heads).state_size(1000) * Hkv  # H / Hkv times smaller


# --- the contract with GQA options -------------------------------------------------------------------------------

CONTRACT_GQA = [{"n_heads": 4, "n_kv_heads": 2}, {"n_heads": 4, "n_kv_heads": 1}]


@pytest.fixture(params=CONTRACT_GQA, ids=lambda o: f"H{o['n_heads']}-Hkv{o['n_kv_heads']}")
def gqa_contract(request, monkeypatch):
    """The contract suite's attention built with GQA options (contract.make reads ``contract_options``)."""
    monkeypatch.setattr(Attention, "contract_options", {**Attention.contract_options, **request.param})
    assert contract.make("attention").n_kv_heads == request.param["n_kv_heads"]
    return request.param


@pytest.mark.parametrize("check", SIMPLE)
def test_contract_with_gqa(gqa_contract, check):
    getattr(contract, f"check_{check}")("attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("check", BY_DTYPE)
def test_contract_in_dtype_with_gqa(gqa_contract, check, dtype):
    getattr(contract, f"check_{check}")("attention", dtype)


@pytest.mark.parametrize("case", contract.DEGENERATE)
def test_contract_finite_on_degenerate_inputs_with_gqa(gqa_contract, case):
    contract.check_finite("attention", case)


# --- the GPU path -------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 1)])
@pytest.mark.parametrize("T", [1, 19])
def test_gpu_path_equals_cpu_path_with_gqa(n_heads, n_kv_heads, T):
    """The fused projection rotated by the Triton rotary kernel (H + Hkv heads rotated, Hkv copied) and the Triton
    attention kernel, against the CPU path, each judged against fp64 (tests/mixers/gpu_path.py)."""
    layer = build_mixer("attention", D_MODEL, {"n_heads": n_heads, "n_kv_heads": n_kv_heads})
    x, dy = torch.randn(1, T, D_MODEL), torch.randn(1, T, D_MODEL)
    assert_gpu_path_matches(layer, x, dy, 1e-4, f"attention H={n_heads} Hkv={n_kv_heads} T={T}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn"])
def test_bf16_gqa_layer_on_cuda(backend):
    from kernels.attention import flash_attn_available

    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash-attn is not installed")
    m = build_mixer("attention", 256, {"n_heads": 8, "n_kv_heads": 2, "backend": backend}).cuda()
    ref = copy.deepcopy(m)
    m = m.to(torch.bfloat16)
    x = torch.randn(2, 512, 256, device="cuda")
    with torch.no_grad():
        y = m(x.bfloat16())
        y_ref = ref(x)
        _, state = m.prefill(x[:, :500].bfloat16())
        y_500, _ = m.step(x[:, 500].bfloat16(), state)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert state["k"].shape == (2, 500, 2, 32)  # the cache holds the 2 key/value heads
    assert_rel_close(y.float(), y_ref, 5e-2, f"{backend} bf16 layer")
    assert_rel_close(y_500.float(), y_ref[:, 500], 5e-2, f"{backend} bf16 decode step")
