"""The final state of every state-carrying kernel, on every backend that runs here, follows one rule
(:func:`kernels.common.state_dtype`): it comes back in ``torch.promote_types(input dtype, torch.float32)`` (fp32
for 16-bit inputs, fp64 for fp64) while the output keeps the input dtype, and an fp32 initial state is read
without rounding. A user who runs a sequence as several calls (chunked prefill, streaming) hands the state of one
call to the next, so a state rounded to 16 bits at a boundary would cost a 16-bit rounding per call.

- the dtypes: fp16 inputs with an fp32 and with an fp16 initial state, fp64 inputs (not the Triton kernels);
- chaining: ``T`` tokens as two calls (split inside a chunk), the second from the first's final state, against
  one call; both against the fp64 reference on the same (rounded) inputs. The chained error must stay within a
  small multiple of the single call's own. The kernels whose state pass keeps the state in fp32 from exact
  16-bit inputs (all but those in :data:`ROUNDED_OPERANDS`) compute the single call's state to about fp32's
  rounding, far below what rounding it to 16 bits costs; for them the chained state must also stay below a
  fraction of that cost (a 16-bit state at the boundary or at the end could not);
- gradients from a loss on the final state (its upstream gradient fp32), on the output and on both, against
  autograd through the fp64 reference: :func:`tests.kernels.test_state_gradients.check_state_gradients`, whose
  operator table, tolerances and helpers these checks share.

On a CPU the Triton kernels run through the interpreter (tests/conftest.py): fp16 only, tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.harness import needs_triton, rel_err
from tests.kernels.test_state_gradients import OPS, T_RAGGED, _steps, _unavoidable, check_state_gradients

F64 = torch.float64
#: the chained error may be this many times the single call's (their ratio stays within 0.4 .. 1.9 over draws)
CHAIN_FACTOR = 3.0
#: below this the errors are fp32 rounding noise (the single call's errors are about 1e-7 relative)
FP32_FLOOR = 2.0 ** -20
#: (op, backend) pairs whose state pass takes 16-bit product operands: their single call's state is itself
#: about one 16-bit rounding off, so only the relative check applies to them
ROUNDED_OPERANDS = {("delta_rule", "triton"), ("delta_product", "triton"), ("ssd", "triton"), ("gla", "triton"),
                    ("slot_memory", "triton")}
#: what the chained state's error must stay below, as a fraction of one rounding of the exact state to 16 bits
ROUNDING_FRACTION = 1 / 8


def _cases(with_triton: bool = True):
    """Every op of the table on ``reference`` and on each of its backends (one reference per public op)."""
    seen = set()
    for op in OPS:
        reference = () if op.call in seen else ("reference",)
        seen.add(op.call)
        for backend in reference + op.backends:
            if backend == "triton" and not with_triton:
                continue
            marks = [needs_triton] if backend == "triton" else []
            yield pytest.param(op, backend, id=f"{op.name}-{backend}", marks=marks)


def _call(op, backend, x, consts):
    """``op.call``, except that the chunk scan's ``reference`` goes through the public op (the table's calls the
    bare loop, the fp64 oracle)."""
    if op.name == "chunk_scan" and backend == "reference":
        from kernels.scan import chunk_scan
        starts, final = chunk_scan(x["a"], x["X"], x["S0"], backend="reference")
        return starts, [final]
    return op.call(backend, x, consts)


def _inputs(op, T, dtype, state_dtype):
    x, consts = op.make(T)
    return {n: t.to(state_dtype if n in op.state else dtype) for n, t in x.items()}, consts


def _check_dtypes(op, backend, dtype, state_dtype, T=5):
    x, consts = _inputs(op, T, dtype, state_dtype)
    out, states = _call(op, backend, x, consts)
    want = torch.promote_types(dtype, torch.float32)
    what = f"{op.name} {backend} T={T} {dtype} inputs, {state_dtype} initial state"
    assert out.dtype == dtype, f"{what}: output {out.dtype}, must keep the input dtype"
    for name, s in zip(op.state, states):
        assert s.dtype == want, f"{what}: final state ({name}) {s.dtype}, must be {want}"
        assert torch.isfinite(s).all(), f"{what}: final state ({name}) not finite"


@pytest.mark.parametrize("T", [5, 0])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["state32", "state16"])
@pytest.mark.parametrize("op,backend", list(_cases()))
def test_final_state_dtype_fp16(op, backend, state_dtype, T):
    """fp16 inputs: the output fp16, the final state fp32 whatever the initial state's dtype; also for an empty
    sequence, whose final state is the initial one."""
    _check_dtypes(op, backend, torch.float16, state_dtype, T)


@pytest.mark.parametrize("op,backend", list(_cases(with_triton=False)))
def test_final_state_dtype_fp64(op, backend):
    """fp64 inputs and initial state: both fp64 (the Triton kernels compute in 32 and 16 bits)."""
    _check_dtypes(op, backend, F64, F64)


def _piece(op, x, consts, part, T, state):
    """The inputs and constants of the tokens ``part``, the initial state ``state`` (the layout of
    :func:`tests.kernels.test_state_gradients.test_state_passed_between_two_calls`)."""
    per_step = {n: t.shape[1] for n, t in x.items()   # inputs with a time axis (T or T * n_h rows)
                if n not in op.state and t.dim() >= 2 and t.shape[1] >= T and t.shape[1] % T == 0}
    out = {n: (t[:, _steps(part, per_step[n], T)] if n in per_step else t) for n, t in x.items()}
    out.update(zip(op.state, state))
    return out, {n: t[:, part] for n, t in consts.items()}


@pytest.mark.parametrize("op,backend", list(_cases()))
def test_two_chained_calls_match_one_call(op, backend):
    """fp16 inputs, fp32 initial state: the tokens as two calls, split inside a chunk, the second from the first's
    final state, against one call. Errors against the fp64 reference on the same inputs: the chained one within
    :data:`CHAIN_FACTOR` of the single call's (plus fp32 noise), for the output and every part of the state."""
    T, split = T_RAGGED, 11
    x, consts = _inputs(op, T, torch.float16, torch.float32)
    out_ref, st_ref = op.call("reference", {n: t.to(F64) for n, t in x.items()}, consts)
    out_one, st_one = _call(op, backend, x, consts)
    outs, state = [], [x[n] for n in op.state]
    for part in (slice(0, split), slice(split, T)):
        o, state = _call(op, backend, *_piece(op, x, consts, part, T, state))
        outs.append(o)
    out_two = torch.cat(outs, 1)
    pairs = [("output", out_two, out_one, out_ref)] + [
        (f"final state {n}", s2, s1, e) for n, s2, s1, e in zip(op.state, state, st_one, st_ref)]
    for what, two, one, exact in pairs:
        e_two, e_one = rel_err(two, exact), rel_err(one, exact)
        assert e_two <= CHAIN_FACTOR * e_one + FP32_FLOOR, (
            f"{op.name} {backend} {what}: two calls {e_two:.2e} against one call {e_one:.2e}")
        if what != "output" and (op.name, backend) not in ROUNDED_OPERANDS:
            bound = ROUNDING_FRACTION * _unavoidable(exact, torch.float16)
            assert e_two <= bound, (f"{op.name} {backend} {what}: two calls {e_two:.2e}, above {bound:.2e}: the state "
                                    f"was rounded to 16 bits on the way")


@pytest.mark.parametrize("op,backend", list(_cases()))
def test_gradients_from_the_final_state_fp16(op, backend):
    """fp16 inputs, fp32 initial state, one partial chunk: the output, the fp32 final state and the gradients of a
    loss on the output, on the final state (an fp32 upstream) and on both, against the fp64 reference."""
    check_state_gradients(op, backend, 5, torch.float16, torch.float32)
