"""Accuracy of the delta family's Triton kernels with 16-bit inputs, measured against the fp64 reference.

With bf16 / fp16 inputs every product in the kernels takes 16-bit operands (tensor cores) and accumulates
in fp32; the state, the gates and the accumulators stay fp32 (:mod:`kernels.delta.triton`). Measured here:

- under the interpreter (CPU), fp16 inputs, tiny shapes: outputs, final state and the gradient of every
  input against :func:`kernels.delta.reference.delta_product_reference` in fp64, n_h 1 and 2 (the query-
  strided output pass and the interleaved fallback), with and without the gate, chunks of 16 to 64
  (one to two merge levels of the blocked triangular inverse); the blocked inverse itself against
  ``torch.linalg.inv`` in fp64;
- on a GPU (``gpu`` marker), bf16 inputs at real sizes (K = V = 128): the same against the fp64 reference,
  and against flash-linear-attention's ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` /
  ``chunk_gated_delta_product`` (both measured against the fp64 reference).

Tolerances (norm-wise relative error; ``u`` = unit roundoff of the input dtype: fp16 2^-11, bf16 2^-8).
The reference runs on the same 16-bit values in fp64, so what is measured is the kernels' own rounding.
Every operand of a product is rounded to 16 bits once from an fp32 value (relative error <= u), and
the result is accumulated in fp32. An output row depends on at most four such roundings in sequence
(``Tm`` with ``beta`` -> ``U``, ``W`` -> ``D = U - W h`` with ``h`` rounded -> ``D`` and ``P = QK^T * M``
rounded in ``P D``), and the state recursion is a product of contractions (Householder factors of norm
<= 1, gates <= 1), so errors do not grow from chunk to chunk: forward error <= 4u. The gradients pass
through the same roundings and their own (``dD``, ``dh``, ``dTm``, ``dA`` as operands): <= 8u. Measured
(fp16, T <= 100, head dim 32): 0.8u to 1.8u forward, up to 2.2u for gradients; bf16 through an
emulation of bf16 rounding in the interpreter: 0.8u to 1.8u.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_importable, triton_interpreting
from kernels.delta import delta_product
from kernels.delta.reference import delta_product_reference
from tests.kernels.harness import assert_rel_close, compare_backends, rel_err
from tests.kernels.test_delta import make_inputs

triton = pytest.importorskip("triton")
tl = triton.language
from kernels.delta.triton import _unit_lower_inverse  # noqa: E402 - needs triton

FP16_U, BF16_U = 2.0 ** -11, 2.0 ** -8
#: forward / gradient tolerances in units of u (module docstring)
FWD_U, GRAD_U = 4, 8

needs_triton = pytest.mark.skipif(
    not triton_importable() or not (torch.cuda.is_available() or triton_interpreting()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1",
)


def _run(n, gate, dtype, B, T, H, D, chunk, device="cpu"):
    """Inputs in ``dtype`` (``g`` and the initial state fp32, as a mixer passes them) and the two functions."""
    q, k, v, beta, g, s0 = (None if x is None else x.to(device) for x in make_inputs(B, T, H, D, D, n, gate))
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))

    def fn(q, k, v, b, g, s0):
        return delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0, chunk_size=chunk, backend="triton")

    def ref(q, k, v, b, g, s0):
        return delta_product_reference(q, k, v, b, g, n, initial_state=s0)

    return fn, ref, [q, k, v, beta, g, s0]


@needs_triton
@pytest.mark.parametrize("n, chunk, T", [(1, 64, 70), (2, 32, 24), (2, 16, 20)],
                         ids=["n1-chunk64", "n2-query-strided", "n2-interleaved"])
@pytest.mark.parametrize("gate", [False, True])
def test_fp16_matches_fp64_reference(n, chunk, T, gate):
    """fp16 inputs (tensor-core operands on a GPU) within 4u forward and 8u for gradients of the fp64 reference."""
    fn, ref, inputs = _run(n, gate, torch.float16, 1, T, 2, 32, chunk)
    compare_backends(fn, ref, inputs, tol=FWD_U * FP16_U, grad_tol=GRAD_U * FP16_U)


@triton.jit
def _inverse_kernel(A_ptr, T_ptr, BT: tl.constexpr, LOWP: tl.constexpr):
    rows = tl.arange(0, BT)
    A = tl.load(A_ptr + rows[:, None] * BT + rows[None, :])
    tl.store(T_ptr + rows[:, None] * BT + rows[None, :], _unit_lower_inverse(A, BT, LOWP))


@needs_triton
@pytest.mark.parametrize("BT", [16, 32, 64])
@pytest.mark.parametrize("lowp", [False, True], ids=["fp32", "fp16-merges"])
def test_blocked_unit_lower_inverse(BT, lowp):
    """(I + tril(A, -1))^{-1} by 16 x 16 substitution and merges, against torch.linalg.inv in fp64.

    A is what the kernels invert: beta_r k_r.k_i below the diagonal (unit keys, beta in (0, 2)), any values
    on and above it (ignored). The diagonal 16 x 16 blocks are solved in fp32 in both modes: within 64 fp32
    roundoffs (2^-24) of their norm. The merged blocks -Q^-1 C P^-1 take four operands rounded to fp16 per
    level (Tm and C, then Tm and the product), two levels at BT = 64: within 8 fp16 roundoffs of their norm;
    with fp32 operands within 64 fp32 roundoffs.
    """
    if not torch.cuda.is_available() and not triton_interpreting():
        pytest.skip("needs a GPU or the interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k = torch.nn.functional.normalize(torch.randn(BT, 32, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(BT, 1, dtype=torch.float64)
    A = beta * (k @ k.T) + torch.triu(torch.randn(BT, BT, dtype=torch.float64))   # junk on and above the diagonal
    exact = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A.tril(-1))
    out = torch.empty(BT, BT, dtype=torch.float32, device=dev)
    _inverse_kernel[(1,)](A.float().to(dev), out, BT=BT, LOWP=lowp)
    out = out.cpu().double()
    blk = torch.arange(BT) // 16
    diag = blk[:, None] == blk[None, :]
    assert_rel_close(out * diag, exact * diag, 64 * 2.0 ** -24, "diagonal blocks")
    assert torch.equal(out.triu(1), torch.zeros_like(out)), "upper triangle not zero"
    if BT > 16:
        off = ~diag
        assert_rel_close(out * off, exact * off, 8 * FP16_U if lowp else 64 * 2.0 ** -24, "merged blocks")


# --------------------------------------------------------------------------------------------------
# GPU: bf16 at real sizes
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("gate", [False, True])
def test_bf16_gpu_matches_fp64_reference(n, gate):
    """bf16 inputs, K = V = 128, chunk 64, 1024 positions: within 4u / 8u (bf16) of the fp64 reference."""
    fn, ref, inputs = _run(n, gate, torch.bfloat16, 2, 1024 // n, 4, 128, 64, device="cuda")
    compare_backends(fn, ref, inputs, tol=FWD_U * BF16_U, grad_tol=GRAD_U * BF16_U)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("gate", [False, True])
def test_bf16_gpu_against_fla(n, gate):
    """Against flash-linear-attention's chunk kernels (``chunk_delta_rule`` without a gate, ``chunk_gated_delta_rule``
    with one, ``chunk_gated_delta_product`` at n_h 2) on the same bf16 inputs: the two outputs and gradients
    agree within the sum of their tolerances (8u / 16u), and ours are at most 1.5x fla's error + u against the
    fp64 reference."""
    pytest.importorskip("fla")
    from kernels.backend import fla_gated_problem
    fn, ref, inputs = _run(n, gate, torch.bfloat16, 1, 2048 // n, 4, 128, 64, device="cuda")
    if gate and fla_gated_problem(inputs[0]):
        pytest.skip(fla_gated_problem(inputs[0]))

    def fla(q, k, v, b, g, s0):
        return delta_product(q, k, v, b, g=g, num_householder=n, initial_state=s0, backend="fla")

    results = {}
    for name, f, dt in (("ours", fn, None), ("fla", fla, None), ("ref", ref, torch.float64)):
        xs = [x.detach().clone().to(dt or x.dtype).requires_grad_(x.is_floating_point()) if torch.is_tensor(x) else x
              for x in inputs]
        o, s = f(*xs)
        torch.manual_seed(0)                           # the same upstream gradient for all three
        do, ds = torch.randn_like(o, dtype=torch.float64), torch.randn_like(s, dtype=torch.float64)
        torch.autograd.backward([o, s], [do.to(o.dtype), ds.to(s.dtype)])
        results[name] = [o, s] + [x.grad for x in xs if torch.is_tensor(x) and x.requires_grad]
    for i, (ours, theirs, exact) in enumerate(zip(results["ours"], results["fla"], results["ref"])):
        tol = (FWD_U if i < 2 else GRAD_U) * BF16_U
        assert_rel_close(ours, theirs, 2 * tol, f"tensor {i}: ours vs fla")
        e_ours, e_fla = rel_err(ours, exact), rel_err(theirs, exact)
        assert e_ours <= 1.5 * e_fla + BF16_U, f"tensor {i}: error {e_ours:.2e} vs fla's {e_fla:.2e}"


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreting(), reason="the dry run is the CPU pipeline")
def test_gpu_delta_check_dry_run():
    """``scripts/gpu_delta_check.py --dry-run``: the timing pipeline runs end to end on the CPU (interpreter) and
    reports a positive ratio for every rule, length and pass, as JSON."""
    import importlib.util
    import json
    import math
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_delta_check.py"
    spec = importlib.util.spec_from_file_location("gpu_delta_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = json.loads(json.dumps(script.measure_delta(lengths=(48,), dry_run=True)))
    for table in (out["kernel_vs_fla_fwd_and_fwd_bwd"], out["deltaproduct_n2_vs_n1"]):
        assert set(table) == {"delta_rule", "gated_delta_rule"}
        for per_length in table.values():
            assert set(per_length) == {"48"}
            for ratios in per_length.values():
                assert set(ratios) == {"fwd", "fwd_bwd"} and all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert out["kernel_vs_fla"]["delta_rule"]["48"] == out["kernel_vs_fla_fwd_and_fwd_bwd"]["delta_rule"]["48"]["fwd_bwd"]
    assert set(out["meets"]) == {"kernel_vs_fla <= 1.2", "n2_vs_n1 <= 2.4"}
