"""The public kernel entry points called directly, as a model that keeps its own layers calls
flash-linear-attention's ops: what a caller may pass besides the inputs the mixers build.

- ``chunk_size``: a value that is not a positive integer is refused in one line naming the op, by every backend
  (the chunked paths of GLA, GKA, SSD and the slot memory divided or reshaped by it, failing in a
  ``ZeroDivisionError`` or a shape error; the delta rule's reference and Triton paths took any value; SKA's
  reference computed its chunk-causal visibility from a negative one), while every positive one, a divisor of
  ``T`` or not, gives the reference's result.
- The outside backends on a CUDA machine where their packages import (faked here: the real choice of ``auto``
  with the device and the packages faked): fla's ``chunk_simple_gla`` reads every tensor with the head count of
  ``k``, so GLA with one query/key head shared by the value heads is passed over by ``auto`` and refused by name;
  fla and mamba-ssm keep their gates and states in fp32, so fp64 inputs are passed over for a backend that keeps
  fp64 (the result matches the fp64 reference to fp64 accuracy) and refused by name.
- Mixed dtypes: attention's ``q``, ``k`` and ``v`` of different dtypes are refused in one line on every backend
  (the reference failed inside a matmul), and taken inside autocast, which casts them to one; SKA's reference
  takes ``k`` and ``v`` of another dtype than ``q`` as its other backends do (computed in ``q``'s dtype).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.delta as delta_family
import kernels.gla as gla_family
import kernels.ssd as ssd_family
from kernels import backend as kb
from kernels.attention import attention, attention_reference
from kernels.backend import BackendUnavailable, package_importable
from kernels.delta import delta_rule
from kernels.delta.reference import delta_product_reference
from kernels.gka import gka
from kernels.gla import gla, gla_reference
from kernels.ska import ska
from kernels.ska.reference import ska_reference
from kernels.slots import slot_memory
from kernels.slots.reference import slot_memory_reference
from kernels.ssd import ssd, ssd_reference
from tests.kernels.harness import DEVICE, assert_rel_close, needs_triton, rel_err

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]
B, H, K, V = 2, 2, 16, 16
#: SKA's ridge here: at the default 1e-3 a position that sees one or two keys solves a system of condition number
#: ~1e3 / ||k||^2, whose fp32 rounding alone exceeds any fixed tolerance on some draws (tests/kernels/test_ska.py)
SKA_RIDGE = 0.1


def _draw(T, dtype=torch.float32):
    """Fresh inputs of every op here, ``(B, T, H, .)``; the batch items differ."""
    return dict(q=torch.randn(B, T, H, K, dtype=dtype), k=F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1),
                v=torch.randn(B, T, H, V, dtype=dtype), g=-0.3 * torch.rand(B, T, H, dtype=dtype),
                beta=torch.rand(B, T, H, dtype=dtype), A=-0.5 - torch.rand(H, dtype=dtype))


def _slot_args(x, M=8, Kw=2):
    T = x["v"].shape[1]
    wi, ri = (torch.rand(B, T, H, M).argsort(-1)[..., :Kw].contiguous() for _ in range(2))
    return wi, torch.rand(B, T, H, Kw, dtype=x["v"].dtype), ri, torch.rand(B, T, H, Kw, dtype=x["v"].dtype), x["v"], \
        torch.rand(H, dtype=x["v"].dtype) + 0.5, M


#: op -> (call(x, chunk_size, backend), its fp64 oracle on the same inputs); each returns the output
CHUNKED = {
    "delta_product": (lambda x, c, be: delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], chunk_size=c, backend=be)[0],
                      lambda x: delta_product_reference(x["q"], x["k"], x["v"], x["beta"], x["g"], 1)[0]),
    "gla": (lambda x, c, be: gla(x["q"], x["k"], x["v"], x["g"], chunk_size=c, backend=be)[0],
            lambda x: gla_reference(x["q"], x["k"], x["v"], x["g"])[0]),
    "gka": (lambda x, c, be: gka(x["q"], x["k"], x["v"], x["g"], num_iter=0, chunk_size=c, backend=be)[0],
            lambda x: gla_reference(x["q"], x["k"], x["v"], x["g"])[0]),          # num_iter = 0 is GLA exactly
    "ssd": (lambda x, c, be: ssd(x["v"], x["beta"], x["A"], x["k"], x["q"], chunk_size=c, backend=be)[0],
            lambda x: ssd_reference(x["v"], x["beta"], x["A"], x["k"], x["q"])[0]),
    "ska": (lambda x, c, be: ska(x["q"], x["k"], x["v"], ridge=SKA_RIDGE, chunk_size=c, backend=be),
            lambda x: ska_reference(x["q"], x["k"], x["v"], ridge=SKA_RIDGE, chunk_size=x["chunk"])),
    "slot_memory": (lambda x, c, be: slot_memory(*x["slots"], chunk_size=c, backend=be)[0],
                    lambda x: slot_memory_reference(*x["slots"])[0]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(CHUNKED))
def test_a_chunk_size_that_is_not_a_positive_integer_is_refused_by_every_backend(op, backend):
    call, _ = CHUNKED[op]
    x = _draw(int(torch.randint(1, 6, ())))
    x["slots"] = _slot_args(x)
    for bad in (0, -int(torch.randint(1, 64, ())), 16.0, 2.5, True):
        with pytest.raises(ValueError, match=rf"^{op}: chunk_size must be a positive integer, got {bad!r}$"):
            call(x, bad, backend)


@pytest.mark.parametrize("op", sorted(CHUNKED))
def test_every_positive_chunk_size_gives_the_reference(op):
    """The chunked path at chunk sizes that divide ``T`` and that do not (one, a prime, longer than ``T``), ``T``
    drawn, against the fp64 reference (SKA's chunk size is its semantics: its reference takes the same one)."""
    call, oracle = CHUNKED[op]
    T = int(torch.randint(2, 12, ()))
    x = _draw(T)
    x["slots"] = _slot_args(x)
    x64 = {name: t.double() for name, t in x.items() if torch.is_tensor(t)}
    x64["slots"] = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in x["slots"])
    for chunk in (1, 3, T + 5):
        x64["chunk"] = x["chunk"] = chunk
        truth = oracle(x64)
        # SKA's readout C L^-T A^2 L^-1 q is ~1e-3 of its inputs on these short draws, so fp32 alone (its reference
        # in fp32) costs up to ~1e-4 on 1% of them: its chunked path is held to twice that error (measured over 3000
        # draws: within 2x + 7e-6); every other op to a fixed tolerance
        reference_error = rel_err(oracle(x), truth) if op == "ska" else 0.0
        assert reference_error < 1e-3, f"ska's reference in fp32 is itself {reference_error:.1e} off at chunk_size={chunk}"
        tol = 2e-5 + 2 * reference_error
        assert_rel_close(call(x, chunk, "torch"), truth, tol, f"{op} chunk_size={chunk}")


# ----------------------------------------------------------------------------- outside backends on CUDA, faked
@pytest.fixture
def cuda_with_outside_packages(monkeypatch):
    """``auto`` and the outside backends as on a CUDA machine where fla and mamba-ssm import: the real rule
    (:func:`kernels.backend.auto_choice`, the family's ``unsupported``), the device and packages faked. A backend
    that still reached fla or mamba-ssm here would fail on the CPU tensors instead of returning."""
    monkeypatch.setattr(kb, "package_importable", lambda module: True)
    monkeypatch.setattr(kb, "outside_usable_for", lambda backend, tensor: True)
    real = kb.resolve_backend

    def resolve(backend, tensor, op, available=kb.BACKENDS, unsupported=None, order=None):
        if backend == "auto":
            usable = {**(unsupported or {})}
            if kb.triton_refusal(tensor):
                usable.setdefault("triton", kb.triton_refusal(tensor))
            return kb.auto_choice(available, True, usable, order)[0]
        return real(backend, tensor, op, available, unsupported, order)
    for family in (delta_family, gla_family, ssd_family):
        monkeypatch.setattr(family, "resolve_backend", resolve)


def test_gla_with_one_query_key_head_for_every_value_head_is_not_given_to_fla(cuda_with_outside_packages):
    x = _draw(int(torch.randint(1, 20, ())))
    q, k = x["q"][:, :, :1], x["k"][:, :, :1]
    U0 = torch.randn(B, H, V, K)
    with pytest.raises(BackendUnavailable, match=r"backend 'fla': needs q and k with one head per value head"):
        gla(q, k, x["v"], x["g"], initial_state=U0, backend="fla")
    o, U = gla(q, k, x["v"], x["g"], initial_state=U0, chunk_size=16)
    o_ref, U_ref = gla_reference(q.double(), k.double(), x["v"].double(), x["g"].double(), initial_state=U0.double())
    assert_rel_close(o, o_ref, 2e-5, "o")
    assert_rel_close(U, U_ref, 2e-5, "final state")


#: fp64 op -> (call(x, backend), its reference, the outside backend that rounds fp64)
FP64 = {
    "delta_rule": (lambda x, be: delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], initial_state=x["S0"],
                                            backend=be),
                   lambda x: delta_product_reference(x["q"], x["k"], x["v"], x["beta"], x["g"], 1,
                                                     initial_state=x["S0"]), "fla"),
    "gla": (lambda x, be: gla(x["q"], x["k"], x["v"], x["g"], initial_state=x["S0"], backend=be),
            lambda x: gla_reference(x["q"], x["k"], x["v"], x["g"], initial_state=x["S0"]), "fla"),
    "ssd": (lambda x, be: ssd(x["v"], x["beta"], x["A"], x["k"], x["q"], initial_state=x["S0"], backend=be),
            lambda x: ssd_reference(x["v"], x["beta"], x["A"], x["k"], x["q"], initial_state=x["S0"]), "mamba_ssm"),
}


@pytest.mark.parametrize("op", sorted(FP64))
def test_fp64_is_not_given_to_an_outside_backend_that_computes_in_fp32(op, cuda_with_outside_packages):
    call, reference, outside = FP64[op]
    x = _draw(int(torch.randint(1, 20, ())), torch.float64)
    x["S0"] = torch.randn(B, H, K, V, dtype=torch.float64)
    with pytest.raises(BackendUnavailable, match=rf"backend '{outside}': computes in fp32 and 16-bit, not fp64"):
        call(x, outside)
    (o, S), (o_ref, S_ref) = call(x, "auto"), reference(x)
    assert o.dtype == S.dtype == torch.float64
    assert_rel_close(o, o_ref, 1e-12, "output")
    assert_rel_close(S, S_ref, 1e-12, "final state")


@pytest.mark.gpu
@pytest.mark.skipif(not package_importable("fla"), reason="flash-linear-attention not installed")
def test_gla_shared_query_key_head_on_cuda_matches_the_reference():
    """On a CUDA machine with fla installed (``auto`` prefers fla there): the shared head still gives the
    reference's output and final state."""
    x = {name: t.to(DEVICE) for name, t in _draw(100).items()}
    q, k, U0 = x["q"][:, :, :1], x["k"][:, :, :1], torch.randn(B, H, V, K, device=DEVICE)
    o, U = gla(q, k, x["v"], x["g"], initial_state=U0)
    o_ref, U_ref = gla_reference(q.double(), k.double(), x["v"].double(), x["g"].double(), initial_state=U0.double())
    assert_rel_close(o, o_ref, 2e-3, "o")
    assert_rel_close(U, U_ref, 2e-3, "final state")


# ----------------------------------------------------------------------------------------------- mixed dtypes
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_of_mixed_dtypes_is_refused_in_one_line(backend):
    x = _draw(int(torch.randint(1, 9, ())))
    q, k, v = x["q"], x["k"], x["v"]
    for other in ("k", "v"):
        args = dict(q=q, k=k, v=v)
        args[other] = args[other].half()
        with pytest.raises(ValueError, match=r"^attention: q, k and v must share one dtype, got .*k.to\(q.dtype\)"):
            attention(**args, backend=backend)


def test_attention_of_mixed_dtypes_inside_autocast_is_computed_in_the_autocast_dtype():
    x = _draw(int(torch.randint(1, 9, ())))
    q, k, v = x["q"], x["k"].bfloat16(), x["v"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = attention(q, k, v, backend="torch")
    expected = attention_reference(*(t.bfloat16().double() for t in (q, k, v)))
    assert_rel_close(o, expected, 2e-2, "autocast output")


@pytest.mark.parametrize("other", [torch.float16, torch.float64])
def test_ska_reference_takes_keys_and_values_of_another_dtype_as_its_other_backends(other):
    x = _draw(int(torch.randint(2, 9, ())))
    q, k, v = x["q"], x["k"].to(other), x["v"].to(other)
    chunk = int(torch.randint(1, 4, ()))
    expected = ska_reference(q.double(), k.double(), v.double(), ridge=SKA_RIDGE, chunk_size=chunk)
    for backend in ("reference", "torch"):
        y = ska(q, k, v, ridge=SKA_RIDGE, chunk_size=chunk, backend=backend)
        assert y.dtype == q.dtype
        # computed in q's dtype: the very numbers of the call with k and v cast to it first
        assert torch.equal(y, ska(q, k.to(q.dtype), v.to(q.dtype), ridge=SKA_RIDGE, chunk_size=chunk, backend=backend))
        # and fp32's rounding of the fp64 result: the readout C L^-T A^2 L^-1 q is ~1e-3 of its inputs on these
        # short draws, so its cancellation costs up to ~2e-4 (median 6e-7) over 6000 draws
        assert_rel_close(y, expected, 1e-3, backend)


# ------------------------------------------------------------------------------------------------ no forget gate
def _linear_attention(q, k, v, U0, scale):
    """Causal linear attention, the explicit formula: ``o_t = scale (U0 q_t + sum_{s <= t} (k_s . q_t) v_s)``."""
    T = q.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * torch.ones(T, T, dtype=q.dtype).tril()
    return scale * (torch.einsum("bhts,bshv->bthv", scores, v) + torch.einsum("bhvk,bthk->bthv", U0, q))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["gla", "gka"])
def test_no_forget_gate_is_causal_linear_attention(op, backend):
    """``g=None``, as fla's ``chunk_simple_gla`` takes it (GKA with ``num_iter = 0`` is GLA): no decay."""
    x = _draw(int(torch.randint(1, 20, ())))
    U0 = torch.randn(B, H, V, K)
    scale = float(torch.rand(())) + 0.1
    if op == "gla":
        o, U = gla(x["q"], x["k"], x["v"], None, scale=scale, chunk_size=16, initial_state=U0, backend=backend)
    else:
        o, (_, U) = gka(x["q"], x["k"], x["v"], None, num_iter=0, scale=scale, chunk_size=16,
                        initial_state=(torch.zeros(B, H, K, K), U0), backend=backend)
    q, k, v, U0 = (t.double() for t in (x["q"], x["k"], x["v"], U0))
    assert_rel_close(o, _linear_attention(q, k, v, U0, scale), 2e-5, "output")
    assert_rel_close(U, U0 + torch.einsum("bthv,bthk->bhvk", v, k), 2e-5, "final state")
