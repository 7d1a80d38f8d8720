"""Gradients through the recurrent state, for every kernel that takes an initial state ``h0`` and returns a final
state ``hT``, on every backend that has one (the fast torch path, the Triton path; both layouts of the slot
memory's torch path), against autograd through the fp64 reference (the family's token loop) on the same inputs.

Chunked training and truncated BPTT / state passing backpropagate into ``h0`` and from a loss on ``hT``: each
case checks, from one forward,

- (a) a loss on the output alone, the gradient of ``h0`` (and of every other input),
- (b) a loss on the final state alone: every input's gradient, and exactly zero for the inputs that reach only
  the output (``q``, ``C``, the read weights: a gradient leaking from the output path would show there),
- (c) a loss on both, with independent random upstream gradients,

at ``T = 1`` and at a ``T`` that is not a multiple of the chunk (two full chunks and a partial one for the
chunked paths), in fp32 and, for the Triton paths, with fp16 inputs under the interpreter (``h0`` fp32, as a
mixer carries it, and fp16). Beside them: two calls chained through the state against one call over the whole
sequence (the state passing of truncated BPTT), and ``h0`` as the only leaf. Every gradient has its leaf's dtype,
and neither the inputs nor the upstream gradients are written to.

The upstream gradients are drawn in fp64, rounded to the dtype of the output they belong to and given to both
sides, so the error measured is the kernel's own (not the rounding of the upstream gradient). The decays stay
near 1 (``h0`` still counts after ``T`` steps): with strong decays the gradient of ``h0`` after ``T`` steps is
vanishingly small (a check of it tells nothing, and in fp16 it underflows), and the gate's gradient in the
chunked paths becomes a difference of O(1) terms, right only to an absolute fp32 rounding (as for SSD's ``A``
in tests/kernels/test_ssd.py); both are out of scope here.

Tolerances (relative Frobenius error over the whole tensor, ``rel_err`` of tests/kernels/harness.py):

- fp32: :data:`FP32_TOL` = 1e-5 for outputs, final states and gradients: the kernels compute in fp32 with no
  16-bit operand, a few roundings (``u`` = 6e-8) through at most 21 contracting steps. Over 25 draws of every case
  the errors stayed below 0.08 of it, except where the conditioning varies with the draw (below): the slot
  memory's read weights (0.35) and the LayerNorm scan (0.27). GKA: :data:`GKA_FP32_TOL` = 3e-5 (as in
  tests/kernels/test_gka.py): its gradients pass through a ridge solve whose conditioning varies with the draw;
  over 200 draws the gate's gradient at T = 1 of the fp32 reference itself reached 1.2e-5 (99th percentile
  1.0e-5), the torch path's 6.2e-6.
- fp16 (``u`` = 2^-11 = 4.9e-4), per family, ``(forward, gradients)`` in units of ``u``: the chunked
  matmul families (delta, SSD, GLA, GKA) round every product operand to fp16 once from an fp32 value and an
  output row sees at most four such roundings in sequence, the gradients their own as well: (4, 8), the budget
  derived in tests/kernels/test_delta_low_precision.py; the scans compute in fp32 and round the result once:
  (2, 4); the LayerNorm scan's Jacobian amplifies the rounding of the upstream gradient by about 1 / std of the
  normalised block: (2, 8);
  the slot memory rounds its coefficient tile once: (2, 4) (tests/kernels/test_slots.py). To each is added the
  error that rounding the exact result to the tensor's own dtype costs (an fp16 ``dh0`` cannot be closer).
  Over 25 draws of every case the largest error was 0.42 of its tolerance (delta product, ``dg``).
- A gradient that sums one term per token and can cancel (SSD's ``A (H,)``, the slot memory's ``gamma (H,)``)
  has its tolerance multiplied by ``||sum |terms||| / ||sum terms||``, the terms taken from the fp64 reference
  with that input given per token (as :func:`tests.kernels.harness.cancellation` does) and the upstream gradient
  given one value channel at a time (the channels cancel too: at ``T = 1`` the slot memory's ``dgamma`` from
  the output alone is ``<u, w (S0 - z0 v)> / z^2`` summed over 5 channels, and in a rare draw it fell to 3e-4 of
  its terms, where the fp32 kernels' relative error of 2e-4 was an absolute 5e-8).
- The LayerNorm scan and the slot memory read through ``1 / std`` and ``1 / (z + eps)``, whose conditioning
  varies from draw to draw: their tolerances are also at least 4x what rounding costs the reference itself
  run in the inputs' dtype on the draw (as in their own test files).

On a CPU the Triton kernels run through the Triton interpreter (tests/conftest.py): tiny shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.harness import DEVICE, needs_triton, rel_err, ssd_reference_any_A

F64 = torch.float64
FP16_U = 2.0 ** -11
#: fp32: outputs, final states and gradients (module docstring)
FP32_TOL = 1e-5
#: fp32, GKA: its gradients pass through a ridge solve whose conditioning varies with the draw (module docstring)
GKA_FP32_TOL = 3e-5
#: T not a multiple of the chunk: two full chunks of 8 or 16 and a partial one
T_RAGGED = 21


@dataclass(frozen=True)
class Op:
    """One state-carrying op.

    ``make(T)`` draws the float inputs by name (fp32; the initial state's among them) and the non-float ones;
    ``call(backend, x, consts)`` returns ``(output, [final state parts])``, ``backend`` ``"reference"`` being the
    fp64 oracle. ``state``: the names of the initial state's parts; ``output_only``: the inputs that reach the
    output alone (a loss on the final state gives them exactly zero); ``fp16``: ``(forward, gradient)``
    tolerances in units of ``u``; ``shared``: ``{name: per-token call}`` for the inputs shared across tokens,
    ``shared``: ``{name: (shape_of, per_token)}`` for the inputs shared across tokens, ``per_token(x, consts)``
    the fp64 reference with ``x[name]`` given per token, expanded to ``shape_of(x)``; ``rounding``: every
    tolerance at least 4x the reference's own error in the working dtype; ``fp32``: the fp32 tolerance."""
    name: str
    make: Callable
    call: Callable
    backends: tuple
    state: tuple
    output_only: tuple = ()
    fp16: tuple = (4, 8)
    shared: dict = field(default_factory=dict)
    rounding: bool = False
    fp32: float = FP32_TOL


def _on(device, **xs):
    return {k: v.to(device) for k, v in xs.items()}


# ------------------------------------------------------------------------------------------------------ delta
def _delta(n):
    def make(T):
        B, H, K, V = 2, 2, 16, 16
        return _on(DEVICE, q=torch.randn(B, T, H, K), k=F.normalize(torch.randn(B, T * n, H, K), dim=-1),
                   v=torch.randn(B, T * n, H, V), beta=2 * torch.rand(B, T * n, H),   # (0, 2): reflections too
                   g=F.logsigmoid(torch.randn(B, T, H) + 4), h0=torch.randn(B, H, K, V)), {}

    def call(backend, x, c):
        from kernels.delta import delta_product
        o, S = delta_product(x["q"], x["k"], x["v"], x["beta"], g=x["g"], num_householder=n, initial_state=x["h0"],
                             chunk_size=16, backend=backend)
        return o, [S]
    return make, call


# ------------------------------------------------------------------------------------------------------ ssd
def _ssd_make(T):
    b, H, P, N = 2, 2, 8, 16
    return _on(DEVICE, x=torch.randn(b, T, H, P), dt=F.softplus(torch.randn(b, T, H) - 1.0),
               A=-(torch.rand(H) * 0.4 + 0.1), B=torch.randn(b, T, H, N), C=torch.randn(b, T, H, N),
               h0=torch.randn(b, H, N, P)), {}


def _ssd_call(backend, x, c):
    from kernels.ssd import ssd
    y, h = ssd(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=16, initial_state=x["h0"], backend=backend)
    return y, [h]


def _ssd_per_token_A(x, c):
    """The token loop with ``A (B, T, H)``: one exponent per token."""
    y, h = ssd_reference_any_A(x["x"], x["dt"], x["A"], x["B"], x["C"], initial_state=x["h0"])
    return y, [h]


# ------------------------------------------------------------------------------------------------------ gla, gka
def _gla_make(T):
    B, H, dk, dv = 2, 2, 16, 16
    return _on(DEVICE, q=torch.randn(B, T, H, dk) / dk ** 0.5, k=torch.randn(B, T, H, dk) / dk ** 0.5,
               v=torch.randn(B, T, H, dv), g=-torch.rand(B, T, H) * 0.2, h0=torch.randn(B, H, dv, dk)), {}


def _gla_call(backend, x, c):
    from kernels.gla import gla
    o, U = gla(x["q"], x["k"], x["v"], x["g"], chunk_size=16, initial_state=x["h0"], backend=backend)
    return o, [U]


def _gka_make(T):
    B, H, d = 2, 2, 16
    beta = torch.rand(B, T, H, 1) * 0.8 + 0.2
    root = torch.randn(B, H, d, d) * 0.1
    return _on(DEVICE, q=F.normalize(torch.randn(B, T, H, d), dim=-1),
               k=F.normalize(torch.randn(B, T, H, d), dim=-1) * beta, v=torch.randn(B, T, H, d) * beta,
               g=-torch.rand(B, T, H) * 0.3, alpha=torch.rand(B, T, H),
               H0=root @ root.transpose(-1, -2), U0=torch.randn(B, H, d, d) * 0.3), {}


def _gka_call(backend, x, c):
    from kernels.gka import gka
    o, (Hs, Us) = gka(x["q"], x["k"], x["v"], x["g"], x["alpha"], num_iter=4, chunk_size=16,
                      initial_state=(x["H0"], x["U0"]), backend=backend)
    return o, [Hs, Us]


# ------------------------------------------------------------------------------------------------------ block scans
def _block_make(T):
    B, N, m = 2, 2, 4
    mix = torch.randint(0, 2, (B, T, N, m, m)) * 2 - 1.0
    mix = mix * torch.softmax(torch.randn(B, T, N, m, m), -1)          # rows of l1 norm 1, random signs
    A = (0.7 * torch.eye(m) + 0.3 * mix) * (0.85 + 0.15 * torch.rand(B, T, N, m, 1))   # ||A||_inf < 1, near 1
    return _on(DEVICE, A=A, b=torch.randn(B, T, N, m), h0=torch.randn(B, N, m)), {}


def _block_call(backend, x, c):
    from kernels.blockscan import block_scan
    h, last = block_scan(x["A"], x["b"], x["h0"], chunk_size=8, backend=backend)
    return h, [last]


def _jordan_make(T, N=2, m=4):
    B = 2
    return _on(DEVICE, lam=0.7 + 0.3 * torch.rand(B, T, N), c=torch.rand(B, T, N) - 0.5, b=torch.randn(B, T, N, m),
               h0=torch.randn(B, N, m)), {}


def _jordan_call(backend, x, c):
    from kernels.blockscan import jordan_scan
    h, last = jordan_scan(x["lam"], x["c"], x["b"], x["h0"], chunk_size=8, backend=backend)
    return h, [last]


def _normed_make(T):
    N, m = 2, 4
    x, _ = _jordan_make(T, N, m)
    return dict(x, weight=(1 + 0.3 * torch.randn(N, m)).to(DEVICE), bias=(0.3 * torch.randn(N, m)).to(DEVICE)), {}


def _normed_call(backend, x, c):
    from kernels.blockscan import jordan_scan_normed
    h, last = jordan_scan_normed(x["lam"], x["c"], x["b"], x["weight"], x["bias"], initial_state=x["h0"],
                                 backend=backend)
    return h, [last]


# ------------------------------------------------------------------------------------------------------ chunk scan
def _scan_make(T):
    return _on(DEVICE, a=0.7 + 0.3 * torch.rand(2, T), X=torch.randn(2, T, 3, 20), S0=torch.randn(2, 3, 20)), {}


def _scan_call(backend, x, c):
    from kernels.scan import chunk_scan, chunk_scan_reference
    if backend == "reference":   # the plain loop through autograd
        starts, fin = chunk_scan_reference(x["a"], x["X"], x["S0"])
    else:
        starts, fin = chunk_scan(x["a"], x["X"], x["S0"], backend=backend)
    return starts, [fin]


# ------------------------------------------------------------------------------------------------------ slot memory
def _slots(M):
    def make(T):
        B, H, K, dv = 2, 2, 3, 5
        idx = [torch.rand(B, T, H, M, device=DEVICE).argsort(-1)[..., :K].contiguous() for _ in range(2)]
        return _on(DEVICE, w=torch.rand(B, T, H, K) * 0.9 + 0.05, r=torch.rand(B, T, H, K), v=torch.randn(B, T, H, dv),
                   gamma=torch.rand(H) * 1.5 + 0.25, S0=torch.randn(B, H, M, dv),
                   z0=torch.rand(B, H, M) + 0.1), dict(wi=idx[0], ri=idx[1])

    def call(backend, x, c):
        from kernels.slots import slot_memory
        kw = {"triton": dict(chunk_size=16), "dense": dict(layout="dense", chunk_size=8),
              "sparse": dict(layout="sparse")}.get(backend, {})
        o, (S, z) = slot_memory(c["wi"], x["w"], c["ri"], x["r"], x["v"], x["gamma"], M,
                                initial_state=(x["S0"], x["z0"]),
                                backend="torch" if backend in ("dense", "sparse") else backend, **kw)
        return o, [S, z]

    def per_token_gamma(x, c):
        from tests.kernels.test_slots import _dense_formula
        o, S, z = _dense_formula(c["wi"], x["w"], c["ri"], x["r"], x["v"], x["gamma"], M, x["S0"], x["z0"])
        return o, [S, z]
    return make, call, per_token_gamma


_slots_chunked, _slots_sparse = _slots(16), _slots(300)   # the Triton chunk-parallel kernels; the sparse scan
OPS = [
    Op("delta_rule", *_delta(1), ("torch", "triton"), ("h0",), ("q",)),
    Op("delta_product", *_delta(2), ("torch", "triton"), ("h0",), ("q",)),
    Op("ssd", _ssd_make, _ssd_call, ("torch", "triton"), ("h0",), ("C",),
       shared={"A": (lambda x: x["dt"].shape, _ssd_per_token_A)}),
    Op("gla", _gla_make, _gla_call, ("torch", "triton"), ("h0",), ("q",)),
    Op("gka", _gka_make, _gka_call, ("torch", "triton"), ("H0", "U0"), ("q", "alpha"), fp32=GKA_FP32_TOL),
    Op("block_scan", _block_make, _block_call, ("torch", "triton"), ("h0",), fp16=(2, 4)),
    Op("jordan_scan", _jordan_make, _jordan_call, ("torch", "triton"), ("h0",), fp16=(2, 4)),
    Op("jordan_scan_normed", _normed_make, _normed_call, ("triton",), ("h0",), fp16=(2, 8), rounding=True),
    Op("chunk_scan", _scan_make, _scan_call, ("torch", "triton"), ("S0",), fp16=(2, 4)),
    Op("slot_memory", *_slots_chunked[:2], ("dense", "sparse", "triton"), ("S0", "z0"), ("r",), fp16=(2, 4),
       shared={"gamma": (lambda x: (*x["w"].shape[:2], 16, x["w"].shape[2]), _slots_chunked[2])}, rounding=True),
    Op("slot_memory_large", *_slots_sparse[:2], ("triton",), ("S0", "z0"), ("r",), fp16=(2, 4),
       shared={"gamma": (lambda x: (*x["w"].shape[:2], 300, x["w"].shape[2]), _slots_sparse[2])}, rounding=True),
]


def _cases(backends):
    for op in OPS:
        for backend in op.backends:
            if backend in backends:
                marks = [needs_triton] if backend == "triton" else []
                yield pytest.param(op, backend, id=f"{op.name}-{backend}", marks=marks)


# ------------------------------------------------------------------------------------------------------ machinery
def _grads(outs, leaves, ups):
    """The gradients of ``sum <out, up>`` over the outputs whose ``up`` is not None (None where unreached)."""
    pairs = [(o, u) for o, u in zip(outs, ups) if u is not None]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [u for _, u in pairs], retain_graph=True,
                               allow_unused=True)


def _flat(result):
    """``(output, [state parts])`` -> ``[output, *state parts]``."""
    return [result[0], *result[1]]


def _one_channel_at_a_time(ups):
    """``ups`` split into pieces that each keep one index of one upstream's last dimension (the value channel)."""
    for i, u in enumerate(ups):
        if u is None:
            continue
        for j in range(u.shape[-1]):
            piece = [None] * len(ups)
            piece[i] = torch.zeros_like(u)
            piece[i][..., j] = u[..., j]
            yield piece


def _cancellation(op, name, ref_x, consts, ups):
    """``||sum |terms||| / ||sum terms||`` (at least 1) of the shared input ``name``'s gradient for ``ups``.

    A term is one token's (and slot's) contribution from one value channel of one upstream gradient: the
    channels are summed inside the gradient too (``<u_t, do_t / dgamma>`` over the value width), and with a
    few channels that sum can cancel to a small fraction of its terms as well."""
    shape_of, per_token = op.shared[name]
    # on the CPU: a side computation in fp64 (tests/kernels/test_slots.py's dense formula builds CPU tensors)
    full = {n: t.detach().cpu() for n, t in ref_x.items()}
    full[name] = full[name].expand(shape_of(full)).clone().requires_grad_()
    o, st = per_token(full, {n: t.cpu() for n, t in consts.items()})
    size = tuple(ref_x[name].shape)
    total, magnitude = 0.0, 0.0
    for piece in _one_channel_at_a_time([None if u is None else u.cpu() for u in ups]):
        (terms,) = _grads([o, *st], [full[name]], piece)
        if terms is not None:
            total, magnitude = total + terms, magnitude + terms.abs()
    if not torch.is_tensor(total):
        return 1.0
    return max(1.0, (magnitude.sum_to_size(size).norm() / total.sum_to_size(size).norm().clamp_min(1e-300)).item())


def _unavoidable(exact, dtype):
    """What rounding the exact value to ``dtype`` costs, relative (an fp16 gradient cannot be closer)."""
    return rel_err(exact.to(dtype), exact) if dtype != F64 else 0.0


def check_state_gradients(op, backend, T, dtype=torch.float32, state_dtype=None, only_state=False):
    """Outputs, final state and the gradients of losses (a), (b), (c) of the module docstring, one forward each
    side, against autograd through the fp64 reference."""
    state_dtype = dtype if state_dtype is None else state_dtype
    x, consts = op.make(T)
    xs = {n: t.to(state_dtype if n in op.state else dtype).requires_grad_(n in op.state or not only_state)
          for n, t in x.items()}
    rs = {n: t.detach().to(F64).requires_grad_(t.requires_grad) for n, t in xs.items()}   # the rounded inputs
    kept = {n: t.detach().clone() for n, t in xs.items()}
    outs, refs = _flat(op.call(backend, xs, consts)), _flat(op.call("reference", rs, consts))
    own = None
    if op.rounding:   # the reference itself in the working dtypes, for the rounding floor
        ws = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in xs.items()}
        own = ws, _flat(op.call("reference", ws, consts))
    fwd_u, grad_u = op.fp16 if dtype == torch.float16 else (None, None)

    def tolerance(base_u, got, exact, mine=None):
        tol = op.fp32 if base_u is None else base_u * FP16_U + _unavoidable(exact, got.dtype)
        return tol if mine is None else max(tol, 4 * rel_err(mine, exact))

    what = f"{op.name} {backend} T={T} {str(dtype)[6:]} state {str(state_dtype)[6:]}"
    for i, (a, e) in enumerate(zip(outs, refs)):
        assert a.shape == e.shape and torch.isfinite(a).all(), f"{what}: output {i}"
        err, tol = rel_err(a, e), tolerance(fwd_u, a, e, None if own is None else own[1][i])
        assert err <= tol, f"{what}: {'output' if i == 0 else f'final state {i - 1}'} error {err:.2e} > {tol:.1e}"

    names = [n for n in xs if xs[n].requires_grad]
    n_st = len(outs) - 1
    for loss, chosen in (("(a) loss on the output", [True] + [False] * n_st),
                         ("(b) loss on the final state", [False] + [True] * n_st),
                         ("(c) loss on both", [True] * (1 + n_st))):
        ups = [torch.randn(e.shape, dtype=F64, device=e.device).to(a.dtype) if c else None
               for a, e, c in zip(outs, refs, chosen)]
        up_kept = [None if u is None else u.clone() for u in ups]
        got = _grads(outs, [xs[n] for n in names], ups)
        exact = _grads(refs, [rs[n] for n in names], [None if u is None else u.to(F64) for u in ups])
        mine = [None] * len(names) if own is None else _grads(
            own[1], [own[0][n] for n in names], [None if u is None else u.to(w.dtype) for u, w in zip(ups, own[1])])
        assert all(u is None or torch.equal(u, k) for u, k in zip(ups, up_kept)), f"{what} {loss}: upstream written"
        for n, g, e, m in zip(names, got, exact, mine):
            if e is None:   # unreached by this loss (or only through the output, by (b)): nothing, or exact zeros
                assert g is None or not g.any(), f"{what} {loss}: d{n} must be zero, max |d{n}| = {g.abs().max():.2e}"
                continue
            assert g is not None, f"{what} {loss}: no gradient for {n}"
            assert g.dtype == xs[n].dtype and g.shape == xs[n].shape, f"{what} {loss}: d{n} {g.dtype} {g.shape}"
            assert torch.isfinite(g).all(), f"{what} {loss}: d{n} not finite"
            tol = tolerance(grad_u, g, e, m)
            if n in op.shared:
                tol *= _cancellation(op, n, rs, consts, [None if u is None else u.to(F64) for u in ups])
            err = rel_err(g, e)
            assert err <= tol, f"{what} {loss}: d{n} relative error {err:.2e} > {tol:.1e}"
        if loss.startswith("(b)"):
            for n in op.output_only:
                if n in names:
                    assert exact[names.index(n)] is None, f"{op.name}: {n} reaches the final state"
    for n, t in xs.items():
        assert torch.equal(t.detach(), kept[n]), f"{what}: input {n} written"


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("T", [1, T_RAGGED])
@pytest.mark.parametrize("op,backend", list(_cases(("torch", "dense", "sparse", "triton"))))
def test_state_gradients_fp32(op, backend, T):
    """(a), (b), (c) at T = 1 and at a T of two full chunks and a partial one, fp32."""
    check_state_gradients(op, backend, T)


@pytest.mark.parametrize("T,state_dtype", [(T_RAGGED, torch.float32), (1, torch.float16)],
                         ids=[f"T{T_RAGGED}-state32", "T1-state16"])
@pytest.mark.parametrize("op,backend", list(_cases(("triton",))))
def test_state_gradients_fp16_triton(op, backend, T, state_dtype):
    """fp16 inputs through the Triton kernels (under the interpreter on a CPU): over several chunks with the
    initial state fp32 (as the mixers carry it), and at T = 1 with an fp16 initial state (read in fp16, its
    gradient returned in fp16). Tolerances from fp16's unit roundoff (module docstring)."""
    check_state_gradients(op, backend, T, torch.float16, state_dtype)


@pytest.mark.parametrize("op,backend", list(_cases(("triton",))))
def test_only_the_initial_state_is_a_leaf(op, backend):
    """Truncated BPTT's carried state: ``h0`` the only input that asks for a gradient (the others constants);
    its gradient from (a), (b) and (c) must still come back. The Triton paths only: their autograd Functions
    decide what to return from what was asked (the torch paths are differentiated by autograd itself). T = 5, one
    partial chunk (the gradient's way through several chunks is checked above)."""
    check_state_gradients(op, backend, 5, only_state=True)


@pytest.mark.parametrize("op,backend", list(_cases(("torch", "dense", "sparse", "triton"))))
def test_state_passed_between_two_calls(op, backend):
    """State passing: the sequence in two calls, the first call's final state the second's initial state (split
    inside a chunk), a loss on both calls' outputs and the last final state; every gradient, the initial
    state's included, equals that of one fp64 reference call over the whole sequence."""
    T, split = T_RAGGED, 11
    x, consts = op.make(T)
    per_step = {n: t.shape[1] for n, t in x.items()   # inputs with a time axis (T or T * n_h rows)
                if n not in op.state and t.dim() >= 2 and t.shape[1] >= T and t.shape[1] % T == 0}
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    exact = {n: t.detach().to(F64).requires_grad_() for n, t in x.items()}

    def piece(d, c, part, state):
        """Inputs and constants of the part ``part`` of the time axis, the initial state given."""
        out = {n: (t[:, _steps(part, per_step[n], T)] if n in per_step else t) for n, t in d.items()}
        out.update(zip(op.state, state))
        cs = {n: t[:, part] for n, t in c.items()}
        return out, cs

    outs, state = [], [leaves[n] for n in op.state]
    for part in (slice(0, split), slice(split, T)):
        o, state = op.call(backend, *piece(leaves, consts, part, state))
        outs.append(o)
    o = torch.cat(outs, 1)
    o_ref, st_ref = op.call("reference", exact, consts)
    ups = [torch.randn(e.shape, dtype=F64, device=e.device) for e in (o_ref, *st_ref)]
    got = _grads([o, *state], list(leaves.values()), [u.to(a.dtype) for u, a in zip(ups, (o, *state))])
    want = _grads([o_ref, *st_ref], list(exact.values()), ups)
    assert rel_err(o, o_ref) <= op.fp32 and all(rel_err(a, b) <= op.fp32 for a, b in zip(state, st_ref))
    for n, g, e in zip(leaves, got, want):
        tol = op.fp32 * (_cancellation(op, n, exact, consts, ups) if n in op.shared else 1.0)
        tol = max(tol, 4 * _own_error(op, exact, consts, ups, n)) if op.rounding else tol
        assert g is not None and rel_err(g, e) <= tol, f"{op.name} {backend}: d{n} {rel_err(g, e):.2e} > {tol:.1e}"


def _steps(part, rows, T):
    """The rows of an input with ``rows`` rows per sequence of ``T`` tokens (``n_h`` sub-steps a token) in ``part``."""
    n = rows // T
    return slice(part.start * n, part.stop * n)


def _own_error(op, exact, consts, ups, name):
    """The error of the fp32 reference's gradient of ``name`` (the rounding floor of the ops with ``rounding``)."""
    ws = {n: t.detach().float().requires_grad_() for n, t in exact.items()}
    w = _flat(op.call("reference", ws, consts))
    es = {n: t.detach().requires_grad_() for n, t in exact.items()}
    e = _flat(op.call("reference", es, consts))
    mine = _grads(w, [ws[name]], [u.to(a.dtype) for u, a in zip(ups, w)])[0]
    want = _grads(e, [es[name]], ups)[0]
    return rel_err(mine, want)
