"""GKA's Triton kernels with 16-bit products against fp64: the within-chunk solve alone (the kernels' own
error, fp32 outputs) and the whole op (fp16 inputs under the interpreter, bf16 at real sizes on a GPU).

The inputs are rounded to the 16-bit dtype first and the fp64 reference runs on exactly those values, so
what is measured is the kernels' arithmetic. Tolerances (relative Frobenius error):

- the solve alone, fp16 operands, fp32 outputs: two 16-bit pieces per operand leave ~u^2 (u = 2^-11 for
  fp16) times GKA's amplification (up to kappa ~ 51): measured 3e-7..6e-7 for x, 4e-7..2.5e-6 for the
  gradients (d 16, C 16, r 30); one piece gives 3e-4 for x. Tolerance 5e-5 for x and dq; 1e-4 for dH0, dK, dG,
  dn2 (the solve stage takes ``n2 = ||H_t||_F^2`` and applies the ridge itself).
  The reverse mode takes fp32's products (three pieces) for its reconstruction and runs at r = 12 here:
  at r = 30 its dK has the fp32 test's heavy tail (reversing 30 iterations amplifies rounding ~1e4-1e6;
  tests/kernels/test_gka.py judges it by the median over heads), which would hide the 16-bit products.
- the whole op, fp16 inputs: the output and every gradient is rounded to fp16 once (rms relative error
  u / sqrt(3) ~ 2.8e-4); measured 1.7e-4..2.4e-4. Tolerance 1e-3. The reverse mode's gradients add the
  rounding its 12 reversed iterations amplify: dk's error has a tail, 1.2e-3 at worst and above 1e-3 in 3 of
  300 draws; tolerance 3e-3 for the reverse mode's gradients.
- bf16 (GPU): u = 2^-8 (rms 2.3e-3 after rounding); tolerance 1e-2 forward, 2e-2 gradients.
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_importable, triton_usable_for
from kernels.gka import gka
from kernels.gka.chebyshev import ChunkOp, decay_mask, iterative_solve
from kernels.gka.chunked import chunk_states, frob_norm_sq
from kernels.gka.reference import ridge
from tests.kernels.harness import assert_rel_close, rel_err
from tests.kernels.test_gka import grads_of, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    not (triton_importable() and triton_usable_for(torch.empty(0, device=DEVICE))),
    reason="triton cannot run here (no CUDA and no TRITON_INTERPRET=1)")


def _systems(dtype, b=1, h=2, n=2, C=16, d=16, decay=0.3):
    """Heads-first solve inputs ``(H0, K, G, n2, Q)`` built as GKA builds them, fp64, from keys and queries
    rounded to ``dtype`` (the keys must be exact in the operand dtype)."""
    q, k, v, g, _ = make_inputs(b, n * C, h, d, dtype=torch.float64, decay=decay)
    q, k = q.to(dtype).double(), k.to(dtype).double()
    hf = lambda t: t.reshape(b, n, C, h, *t.shape[3:]).movedim(3, 1)  # noqa: E731
    Q, K, V = hf(q), hf(k), hf(v)
    G = hf(g).cumsum(-1)
    zeros = torch.zeros(b, h, d, d, dtype=torch.float64)
    # chunk-start states from the previous chunks; the first chunk starts from a random state
    H_init = torch.randn(b, h, d, d, dtype=torch.float64) * 0.1
    H0, _, _, _ = chunk_states(K, V, G, H_init @ H_init.transpose(-1, -2), zeros)
    return H0.contiguous(), K, G, frob_norm_sq(H0, K, G), Q


def _solve_grads(solve, inputs, w):
    xs = [t.detach().clone().requires_grad_(True) for t in inputs]
    x = solve(*xs)
    (x * w).sum().backward()
    return x.detach(), [xs[i].grad for i in (4, 0, 1, 2, 3)]   # dq, dH0, dK, dG, dn2


def _reference_solve(H0, K, G, n2, Q, r, grad="implicit"):
    """The solve stage's reference: ridge and bounds from ``n2``, ``iterative_solve`` with ``ChunkOp``."""
    lam, mu, L = ridge(n2, 0.02, 1e-6)
    op = ChunkOp(decay_mask(G), G.exp().unsqueeze(-1))
    return iterative_solve(op, (H0, K, G, lam), Q, mu, L, num_iter=r, grad=grad)


@pytest.mark.parametrize("grad,r", [("implicit", 30), ("reverse_chebyshev", 12)])
def test_solve_fp16_operands_against_fp64(grad, r):
    from kernels.gka.triton import chunk_solve_heads_first
    heads = 3
    inputs = _systems(torch.float16, h=heads)
    w = torch.randn_like(inputs[-1])

    def ours(H0, K, G, n2, Q):
        return chunk_solve_heads_first(H0, K, G, n2, Q, num_iter=r, grad=grad, operand=torch.float16)

    x, grads = _solve_grads(ours, [t.float() for t in inputs], w.float())
    x_ref, grads_ref = _solve_grads(lambda *a: _reference_solve(*a, r, grad), inputs, w)
    assert x.dtype == torch.float32
    assert_rel_close(x, x_ref, 5e-5, "x")
    for name, a, b in zip(("q", "H0", "K", "G", "n2"), grads, grads_ref):
        assert_rel_close(a, b, 5e-5 if name == "q" else 1e-4, f"d{name}")


def test_one_16_bit_piece_is_not_enough():
    """Why the solve takes two pieces: with one the solve's own error is the 16-bit rounding, ~30x above
    two pieces (measured 3e-4 against 3e-7..6e-7 in fp16), and GKA's readout amplifies it up to ~1/a."""
    import kernels.gka.triton as kt
    from kernels.gka.triton import chunk_solve_heads_first
    H0, K, G, n2, Q = _systems(torch.float16, h=4)
    x_ref = _reference_solve(H0, K, G, n2, Q, 30)
    errors = {}
    for pieces in (1, 2):
        old, kt.SOLVE_PIECES = kt.SOLVE_PIECES, pieces
        try:
            x = chunk_solve_heads_first(*(t.float() for t in (H0, K, G, n2, Q)), num_iter=30, operand=torch.float16)
        finally:
            kt.SOLVE_PIECES = old
        errors[pieces] = rel_err(x, x_ref)
    assert errors[2] <= 5e-5 and errors[1] >= 10 * errors[2], f"relative error of x by pieces: {errors}"


def test_norm_stage_fp16_operands_against_fp64():
    """The closed-form ``||H_t||_F^2`` kernel (two pieces of ``H0``; the keys exact) and its backward against
    autograd through :func:`frob_norm_sq` in fp64: over 8 draws 0.8e-7..1.4e-7 for n2 and 1.0e-7..2.5e-7 for the
    gradients (fp16, d 16, C 16; ~u^2 = 2.4e-7 for two fp16 pieces, plus fp32 accumulation). Tolerance 1e-5:
    one piece of ``H0`` would give ~u = 5e-4."""
    from kernels.gka.triton import frob_norm_sq_heads_first
    H0, K, G, _, _ = _systems(torch.float16, h=3)
    w = torch.randn(G.shape, dtype=torch.float64)
    xs = [t.float().requires_grad_(True) for t in (H0, K, G)]
    n2 = frob_norm_sq_heads_first(*xs, operand=torch.float16)
    (n2 * w.float()).sum().backward()
    rs = [t.clone().requires_grad_(True) for t in (H0, K, G)]
    n2_ref = frob_norm_sq(*rs)
    (n2_ref * w).sum().backward()
    assert_rel_close(n2, n2_ref, 1e-5, "n2")
    for name, a, b in zip(("H0", "K", "G"), xs, rs):
        assert_rel_close(a.grad, b.grad, 1e-5, f"d{name}")


@pytest.mark.parametrize("grad,r", [("implicit", 30), ("reverse_chebyshev", 12)])
def test_gka_fp16_against_fp64(grad, r):
    T, d = 48, 16       # T not a multiple of the chunk: padding
    inputs = [t.half() for t in make_inputs(1, T, 2, d, dtype=torch.float32)]
    w = torch.randn(1, T, 2, d).half()                 # the upstream gradient of a 16-bit output
    o, g = grads_of(lambda *a: gka(*a, chunk_size=32, num_iter=r, grad=grad, backend="triton")[0], inputs, w)
    o_ref, g_ref = grads_of(lambda *a: gka(*a, num_iter=r, grad=grad, backend="reference")[0],
                            [t.double() for t in inputs], w.double())
    assert o.dtype == torch.float16
    assert_rel_close(o, o_ref, 1e-3, "output")
    tol = 3e-3 if grad == "reverse_chebyshev" else 1e-3
    for name, a, b in zip("q k v g alpha".split(), g, g_ref):
        assert_rel_close(a, b, tol, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("grad", ["implicit", "reverse_chebyshev"])
def test_gka_bf16_real_size(grad):
    """bf16 at a real size against the chunked fp64 path on the same bf16 values (heads judged one by one
    for the reverse mode's dk, as in the fp32 test)."""
    B, T, H, d = 1, 2048, 4, 128
    inputs = [t.to(DEVICE, torch.bfloat16) for t in make_inputs(B, T, H, d, dtype=torch.float32, decay=0.05)]
    w = torch.randn(B, T, H, d, device=DEVICE).bfloat16()
    o, g = grads_of(lambda *a: gka(*a, chunk_size=64, grad=grad, backend="triton")[0], inputs, w)
    o_ref, g_ref = grads_of(lambda *a: gka(*a, chunk_size=64, grad=grad, backend="torch")[0],
                            [t.double() for t in inputs], w.double())
    assert o.dtype == torch.bfloat16
    assert_rel_close(o, o_ref, 1e-2, "output")
    for name, a, b in zip("q k v g alpha".split(), g, g_ref):
        if grad == "reverse_chebyshev" and name == "k":
            errors = torch.tensor([rel_err(a[:, :, h], b[:, :, h]) for h in range(H)])
            assert errors.median() <= 2e-2, f"dk per-head relative errors {errors.tolist()}"
        else:
            assert_rel_close(a, b, 2e-2, f"d{name}")
