"""The Mixer contract as plain check functions, one per invariant, each taking a registered mixer name.

``tests/mixers/test_contract.py`` runs every check on every registered mixer; the checks read the
mixer's declarations (``state_grows_with_seq_len``, ``chunk_size_changes_output``, ``uses_mask``,
``test_time_knobs``), never its name, so a mixer with a missing or wrong declaration fails, and
``tests/mixers/test_contract_catches.py`` shows that deliberately broken mixers do.
Each mixer is built with its ``contract_options`` (small, strictly causal).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from mixers import MIXERS, build_mixer
from mixers.base import Mixer
from tests.mixers.gpu_path import ROUNDING_SAMPLES, rounding_copies

D_MODEL = 32


def unzero(mixer):
    """Give zero-initialised output projections (and zero scalars) random values: at exactly zero every
    comparison is trivially 0 == 0 and no gradient passes them."""
    with torch.no_grad():
        for module in mixer.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.abs().sum() == 0:
                module.weight.normal_(0, 0.2)
        for _, p in mixer.named_parameters():
            if p.ndim == 0 and p.abs().sum() == 0:
                p.fill_(1.0)
    return mixer


def make(name, dtype=torch.float32, **extra):
    options = {**MIXERS.get(name).contract_options, **extra}
    return unzero(build_mixer(name, D_MODEL, options).to(dtype)).eval()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tolerance(name, dtype):
    return MIXERS.get(name).contract_fp32_rtol if dtype == torch.float32 else 1e-9


def state_elements(state, batch):
    return sum(t.numel() for t in state.values()) // batch


def has_option(name, option):
    return option in {f.name for f in dataclasses.fields(MIXERS.get(name).Options)}


def check_declarations(name):
    cls = MIXERS.get(name)
    assert cls.prefill is not Mixer.prefill, f"{name}: no parallel prefill(x, mask) -> (y, state)"
    for attr in ("init_state", "step", "state_size"):
        assert getattr(cls, attr) is not getattr(Mixer, attr), f"{name}: {attr} is not implemented"
    assert cls.description and cls.state_formula, f"{name}: declare a description and a state_formula"
    for knob in cls.test_time_knobs:
        assert has_option(name, knob), f"{name}: test-time knob {knob!r} is not an option"
    if cls.chunk_size_changes_output:
        assert has_option(name, "chunk_size"), f"{name}: declares chunk_size_changes_output without a chunk_size option"
    m = make(name)
    assert m.is_causal, f"{name}: contract_options must be causal, but {m.non_causal_reason}"
    assert m.dead_at(9) is None, f"{name}: contract_options must contribute at T = 9, but {m.dead_at(9)}"


def check_prefill_is_parallel(name):
    """prefill and forward never fall back to the token-by-token step."""
    m = make(name)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{name}: prefill/forward ran the token loop (step) instead of a parallel form")

    m.step = refuse
    x = torch.randn(2, 9, D_MODEL)
    with torch.no_grad():
        m.prefill(x)
        m(x)


#: check_causal's bound on how far an output before the changed suffix may move, in units of the dtype's eps
#: times the largest magnitude among those outputs. Outputs that only see the unchanged prefix are the same
#: arithmetic on the same numbers, so every mixer here reproduces them bit for bit; the slack admits a
#: kernel whose summation order or chunk-wide stabiliser depends on the later tokens. Such a reordering moves
#: a sum of n terms by at most about n * eps * sum|term|, and the outputs here reduce over at most
#: T * d_model = 768 terms, so 1024 eps (2.3e-13 in fp64) covers it, while a leak of relative size 1e-6
#: stays more than six orders of magnitude above the bound. Relative, so it is neither blind for large
#: outputs nor stricter than rounding for tiny ones.
CAUSAL_EPS_MULTIPLE = 1024
#: check_causal's floor on how much the outputs from the changed suffix on must move (relative), so that a
#: mixer that ignores its input fails whatever its output scale
CAUSAL_MIN_RESPONSE = 1e-5


def causal_bound(past: torch.Tensor, past_changed: torch.Tensor) -> float:
    """The largest change of the outputs before the changed suffix that rounding explains (see
    CAUSAL_EPS_MULTIPLE): a multiple of eps times the largest of those outputs in either run."""
    scale = torch.maximum(past.abs().max(), past_changed.abs().max()).item()
    return CAUSAL_EPS_MULTIPLE * torch.finfo(past.dtype).eps * scale


def check_causal(name):
    m = make(name, torch.float64)
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    t0 = 13
    x2 = x.clone()
    x2[:, t0:] = torch.randn_like(x2[:, t0:])
    with torch.no_grad():
        y, y2 = m(x), m(x2)
    moved, bound = (y[:, :t0] - y2[:, :t0]).abs().max().item(), causal_bound(y[:, :t0], y2[:, :t0])
    assert moved <= bound, f"{name}: output before t={t0} changed by {moved:.2e} > {bound:.2e} (rounding)"
    response = rel(y2[:, t0:], y[:, t0:])
    assert response > CAUSAL_MIN_RESPONSE, f"{name}: output ignores its inputs (moved by {response:.2e}, relative)"


#: fp32 paths that disagree (assert_paths_agree) are each held to the fp64 token loop within the tolerance or this
#: many times the spread of the fp32 token loop under one rounding of the input: on the ill-conditioned draws
#: measured the parallel form was up to 3.5x that spread from fp64, and the token loop up to 0.8x
SPREAD_RATIO = 10


def assert_paths_agree(m, x, got, y, tol, label):
    """``got`` (another path's output for ``x``) equals ``y = m(x)`` within ``tol``, relative. In fp32 a draw
    outside it is looked at again: ``y`` and ``got`` must each be within ``tol`` of the fp64 token loop of the
    same weights, or within SPREAD_RATIO times what fp32 rounding moves on this draw: the largest distance of the
    fp32 token loop on ROUNDING_SAMPLES copies of ``x`` perturbed by one rounding from it on ``x``
    (tests/mixers/gpu_path.py's copies). A spread, not an error against fp64: a path that is off by the same
    amount on every copy does not widen its own bound. Some draws are ill-conditioned (GKA's regularised solve,
    kappa up to 51, then a per-head RMSNorm on a token with a small readout; a LayerNorm over a block that lands
    almost flat), and there every fp32 path is far from fp64: GKA's parallel and recurrent outputs differed by
    up to 0.61 of its tolerance over 3000 draws (median 0.013)."""
    err = rel(got, y)
    if err < tol:
        return
    message = f"{label}: rel err {err:.2e} > {tol:.0e}"
    assert x.dtype == torch.float32, message
    with torch.no_grad():
        exact = copy.deepcopy(m).double().forward_recurrent(x.double())[0]
        loops = [m.forward_recurrent(xs)[0] for xs in rounding_copies(x)]
    spread = max(rel(loop, loops[0]) for loop in loops[1:])
    bound = max(tol, SPREAD_RATIO * spread)
    for what, value in (("the parallel form", y), ("the other path", got)):
        off = rel(value, exact)
        assert off < bound, (f"{message}, and {what} is {off:.2e} from the fp64 token loop, more than "
                             f"{SPREAD_RATIO}x the fp32 token loop's spread {spread:.2e} over {ROUNDING_SAMPLES} "
                             f"copies of the input perturbed by one rounding")


def check_parallel_equals_recurrent(name, dtype):
    m = make(name, dtype)
    x = torch.randn(2, 21, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        y_rec, _ = m.forward_recurrent(x)
    assert_paths_agree(m, x, y_rec, y, tolerance(name, dtype), f"{name}: parallel vs recurrent")


def check_prefill_then_decode(name, dtype):
    m = make(name, dtype)
    x = torch.randn(2, 23, D_MODEL, dtype=dtype)
    split = 14
    with torch.no_grad():
        y = m(x)
        y_pre, state = m.prefill(x[:, :split])
        ys = [y_pre]
        for t in range(split, x.shape[1]):
            y_t, state = m.step(x[:, t], state)
            ys.append(y_t[:, None])
    y_dec = torch.cat(ys, dim=1)
    tol = tolerance(name, dtype)
    assert rel(y_dec, y) < tol, f"{name}: prefill+decode vs forward rel err {rel(y_dec, y):.2e} > {tol:.0e}"


def check_state_size(name):
    """state_size(T) is the state step carries, and it grows with T exactly when the mixer declares so."""
    m = make(name)
    sizes = {}
    for T in (5, 17):
        with torch.no_grad():
            _, state = m.prefill(torch.randn(3, T, D_MODEL))
        sizes[T] = state_elements(state, 3)
        assert sizes[T] == m.state_size(T), (f"{name}: state_size({T}) = {m.state_size(T)} but the state prefill "
                                             f"returns holds {sizes[T]} elements per sequence")
        assert m.active_state_size(T) <= m.state_size(T), f"{name}: active state larger than the state"
    grows = sizes[17] != sizes[5] or m.state_size(1000) != m.state_size(10)
    declared = type(m).state_grows_with_seq_len
    assert grows == declared, (f"{name}: the decode state {'grows' if grows else 'does not grow'} with T but "
                               f"state_grows_with_seq_len = {declared}")


def check_chunk_size(name):
    """Without the declaration, every chunk size gives the same output; with it, some chunk size changes it."""
    if not has_option(name, "chunk_size"):
        return
    x = torch.randn(2, 29, D_MODEL, dtype=torch.float64)
    ref = make(name, torch.float64)
    declared = MIXERS.get(name).chunk_size_changes_output
    with torch.no_grad():
        y_ref = ref(x)
        errs = []
        for chunk in (1, 4, 16):
            m = make(name, torch.float64, chunk_size=chunk)
            m.load_state_dict(ref.state_dict())
            errs.append(rel(m(x), y_ref))
    if declared:
        assert max(errs) > 1e-9, f"{name}: declares chunk_size_changes_output but every chunk size agrees"
    else:
        assert max(errs) < 1e-9, f"{name}: chunk_size changes the output (errors {errs}); declare " \
                                 f"chunk_size_changes_output or make it an implementation detail"


def check_mask_declaration(name):
    """A mixer that does not declare uses_mask ignores the mask."""
    m = make(name, torch.float64)
    x = torch.randn(2, 12, D_MODEL, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.float64)
    mask[:, 7:] = 0
    with torch.no_grad():
        same = torch.allclose(m(x, mask=mask), m(x), atol=1e-12, rtol=0)
    if not type(m).uses_mask:
        assert same, f"{name}: the mask changes the output but uses_mask is False"


def check_batch_independence(name):
    m = make(name, torch.float64)
    x = torch.randn(3, 16, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
        for i in range(3):
            assert rel(m(x[i:i + 1]), y[i:i + 1]) < 1e-10, f"{name}: example {i} depends on the batch"


DEGENERATE = {
    "zeros": lambda: torch.zeros(2, 12, D_MODEL),
    "repeated": lambda: torch.randn(1, 1, D_MODEL).expand(2, 12, D_MODEL).contiguous(),
    "single_token": lambda: torch.randn(2, 1, D_MODEL),
    "long": lambda: torch.randn(1, 300, D_MODEL),
}


def check_finite(name, case):
    m = make(name).train()
    x = DEGENERATE[case]().requires_grad_(True)
    y = m(x)
    assert torch.isfinite(y).all(), f"{name}/{case}: non-finite output"
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all(), f"{name}/{case}: non-finite input gradient"
    for pname, p in m.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"{name}/{case}: non-finite gradient of {pname}"


def check_dtype_round_trip(name, dtype):
    m = make(name, dtype)
    x = torch.randn(1, 9, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        y_t, _ = m.step(x[:, 0], m.init_state(1, dtype=dtype))
    assert y.dtype == dtype and y_t.dtype == dtype


def check_test_time_knobs(name):
    """Setting a declared knob for evaluation changes nothing while training and is undone on restore."""
    m = make(name)
    for knob in type(m).test_time_knobs:
        own = getattr(m.options, knob)
        previous = m.set_test_time({knob: own})
        assert m.knob(knob) == own
        m.train()
        assert m.knob(knob) == own
        m.restore_test_time(previous)


def check_autocast(name):
    """Inside a bf16 autocast region (mixed-precision training) the mixer runs, forward and backward, and
    stays close to fp32: scans and solves must not mix bf16 matmuls with fp32 decays."""
    m = make(name).train()
    x = torch.randn(2, 12, D_MODEL)
    with torch.no_grad():
        ref = m(x)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(xg)
    (y.float() * torch.randn_like(ref)).sum().backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(xg.grad).all(), f"{name}: non-finite under autocast"
    assert rel(y.float(), ref) < 0.1, f"{name}: bf16 autocast output far from fp32 ({rel(y.float(), ref):.2e})"


# --- the input boundary (mixers.boundary) -----------------------------------------------------------------
def _call(m, method, *args):
    with torch.no_grad():
        return getattr(m, method)(*args)


def boundary_probes(m):
    """``[(what, call, error type, fragments its message must hold)]``: malformed tensors at every method."""
    D, x, state = D_MODEL, torch.randn(2, 5, D_MODEL), m.init_state(2)
    other_batch = m.init_state(3)
    key = sorted(state)[0]
    probes = []
    for method in ("forward", "prefill"):
        probes += [
            (f"{method}: d_model + 1", lambda f=method: _call(m, f, torch.randn(2, 5, D + 1)), ValueError,
             ["x", f"d_model={D}", "(2, 5, 33)"]),
            (f"{method}: (B, D) input", lambda f=method: _call(m, f, torch.randn(2, D)), ValueError, ["x", "(2, 32)"]),
            (f"{method}: rank 4", lambda f=method: _call(m, f, torch.randn(2, 5, 1, D)), ValueError, ["(2, 5, 1, 32)"]),
            (f"{method}: int64 ids", lambda f=method: _call(m, f, torch.randint(0, 9, (2, 5, D))), TypeError,
             ["x", "torch.int64"]),
            (f"{method}: bool", lambda f=method: _call(m, f, torch.ones(2, 5, D, dtype=torch.bool)), TypeError,
             ["torch.bool"]),
            (f"{method}: float64 into fp32", lambda f=method: _call(m, f, x.double()), TypeError,
             ["torch.float64", "torch.float32"]),
            (f"{method}: a list", lambda f=method: _call(m, f, x.tolist()), TypeError, ["x", "list"]),
            (f"{method}: batch 0", lambda f=method: _call(m, f, torch.randn(0, 5, D)), ValueError, ["batch size 0"]),
            (f"{method}: mask (B, T - 1)", lambda f=method: _call(m, f, x, torch.ones(2, 4)), ValueError,
             ["mask", "(2, 5)", "(2, 4)"]),
            (f"{method}: mask rank 3", lambda f=method: _call(m, f, x, torch.ones(2, 5, 1)), ValueError,
             ["mask", "(2, 5, 1)"]),
            (f"{method}: mask rank 1", lambda f=method: _call(m, f, x, torch.ones(5)), ValueError, ["mask", "(5,)"]),
        ]
    probes += [
        ("step: (B, T, D) input", lambda: _call(m, "step", x, state), ValueError, ["x_t", "(2, 5, 32)", "prefill"]),
        ("step: d_model - 1", lambda: _call(m, "step", torch.randn(2, D - 1), state), ValueError, ["x_t", "(2, 31)"]),
        ("step: int64", lambda: _call(m, "step", torch.randint(0, 9, (2, D)), state), TypeError, ["torch.int64"]),
        ("step: float64 into fp32", lambda: _call(m, "step", torch.randn(2, D, dtype=torch.float64), state), TypeError,
         ["torch.float64"]),
        ("step: batch 0", lambda: _call(m, "step", torch.randn(0, D), m.init_state(1)), ValueError, ["batch size 0"]),
        ("step: state of batch 3", lambda: _call(m, "step", torch.randn(2, D), other_batch), ValueError,
         ["state[", "batch 2", "another batch size"]),
        ("step: empty state", lambda: _call(m, "step", torch.randn(2, D), {}), ValueError, ["state", "empty"]),
        ("step: a key renamed", lambda: _call(m, "step", torch.randn(2, D),
                                               {**{k: v for k, v in state.items() if k != key}, "renamed": state[key]}),
         ValueError, ["state", repr(key), "'renamed'"]),
        ("step: tensor as state", lambda: _call(m, "step", torch.randn(2, D), torch.zeros(2, 4)), TypeError, ["state"]),
        ("step: a state tensor reshaped", lambda: _call(m, "step", torch.randn(2, D), {**state, key: state[key][..., None]}),
         ValueError, [f"state[{key!r}]"]),
    ]
    return probes


def check_boundary(name):
    """Every malformed call is refused with one line that starts with the mixer and method and names the
    argument and the shapes or dtypes involved, never with an error from inside the computation."""
    m = make(name)
    for what, call, error, fragments in boundary_probes(m):
        try:
            call()
        except (ValueError, TypeError, RuntimeError, KeyError, IndexError) as err:
            message = str(err)
            assert isinstance(err, error), f"{name} / {what}: {type(err).__name__} instead of {error.__name__}: {message}"
            assert message.startswith(f"{name}.") and "\n" not in message, f"{name} / {what}: {message!r}"
            missing = [f for f in fragments if f not in message]
            assert not missing, f"{name} / {what}: the message lacks {missing}: {message!r}"
        else:
            raise AssertionError(f"{name} / {what}: accepted")


def check_empty_time(name):
    """T = 0: an empty output from forward and prefill, and prefill's state is init_state's (nothing consumed),
    so decoding from it equals decoding from init_state."""
    m = make(name)
    x = torch.randn(2, 0, D_MODEL)
    with torch.no_grad():
        y = m(x, torch.ones(2, 0))
        y_pre, state = m.prefill(x)
        fresh = m.init_state(2)
        assert y.shape == (2, 0, D_MODEL) and y_pre.shape == (2, 0, D_MODEL), f"{name}: {y.shape}, {y_pre.shape}"
        assert set(state) == set(fresh) and all(torch.equal(state[k], fresh[k]) for k in fresh), f"{name}: T=0 state"
        x_t = torch.randn(2, D_MODEL)
        assert torch.equal(m.step(x_t, state)[0], m.step(x_t, m.init_state(2))[0])


def check_large_finite_input(name):
    """A single huge but finite input (+-1e30) at position t leaves every output before t finite, for the
    contract chunk size and for one chunk holding the whole sequence (t mid-chunk both times)."""
    T, t = 20, 13
    variants = [{}] + ([{"chunk_size": 32}] if has_option(name, "chunk_size") else [])
    for extra in variants:
        m = make(name, **extra)
        assert m.is_causal, f"{name} {extra}: not causal ({m.non_causal_reason})"
        for value in (1e30, -1e30):
            x = torch.randn(2, T, D_MODEL)
            x[:, t] = value
            with torch.no_grad():
                y = m(x)
            bad = (~torch.isfinite(y[:, :t])).any(-1).any(0).nonzero().flatten().tolist()
            assert not bad, f"{name} {extra}: input {value:g} at t={t} made the outputs at {bad} non-finite"


#: bf16 autocast: decode (prefill + step) within this relative distance (norm of the difference over the
#: norm of the output) of forward under the same autocast, and of the fp32 forward. bf16 keeps 8 mantissa
#: bits (unit roundoff 2^-8 = 3.9e-3); forward itself lands 0.4-1.2e-2 from fp32 here, so 5e-2 (about 13
#: roundoffs) passes rounding and fails a decode that computes its state update in bf16 (0.34 for GKA).
#: Over 16 sequences: over 2, GKA's ridge solve (a = 0.02) turned a bf16 prefill's state error (0.5 %) into up to
#: 0.91 of the bound on a few weight draws (820 seeds; the bf16 forward's own error moves with it, but not in a
#: fixed ratio); over 16 its worst of 240 seeds was 0.43 of the bound (median 0.27), DeltaNet's 0.31 (over 8)
AUTOCAST_DECODE_RTOL = 5e-2
AUTOCAST_DECODE_BATCH = 16


def check_autocast_decode(name):
    """Under bf16 autocast, decoding token by token (from init_state, and after a short prefill) gives the
    outputs of forward under the same autocast, and of the fp32 forward, within AUTOCAST_DECODE_RTOL on the
    decoded positions."""
    m = make(name)
    x = torch.randn(AUTOCAST_DECODE_BATCH, 24, D_MODEL)
    split = 4
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x).float()
            y_rec = m.forward_recurrent(x)[0].float()
            _, state = m.prefill(x[:, :split])
            ys = []
            for t in range(split, x.shape[1]):
                y_t, state = m.step(x[:, t], state)
                ys.append(y_t.float())
    decoded = {"from init_state": (y_rec, slice(None)),
               f"after a prefill of {split}": (torch.stack(ys, 1), slice(split, None))}
    for how, (y_dec, positions) in decoded.items():
        for against, label in ((y, "bf16 forward"), (ref, "fp32 forward")):
            err = rel(y_dec, against[:, positions])
            assert err < AUTOCAST_DECODE_RTOL, f"{name}: bf16 autocast decode {how} vs {label}: rel err {err:.2e}"


#: d_model of the default-option checks (every default divides it)
D_SMALL = 16


def first_live_length(m, longest: int = 1 << 16) -> int:
    return next(T for T in range(1, longest) if m.dead_at(T) is None)


def check_gradients_reach_every_parameter(name):
    """At its default options, at the shortest length a recipe may use (``dead_at`` is None), every parameter
    gets a gradient (at T >= 3); below that length (where ``dead_at`` names the option) nothing does, and the output
    ignores the input. T = 1 is skipped on the live side: the state before the first token is zero, so no
    transition (decay, coupling, slot forgetting) can matter there."""
    m = unzero(build_mixer(name, D_SMALL, {})).train()
    live = first_live_length(m)
    for T in sorted({1, live - 1} - {0}) if live > 1 else []:
        reason = m.dead_at(T)
        assert reason is not None and "=" in reason, f"{name}: dead_at({T}) = {reason!r} (below the first live length)"
        m.zero_grad()
        x = torch.randn(4, T, D_SMALL, requires_grad=True)
        y = m(x)
        (y * torch.randn_like(y)).sum().backward()
        moved = [n for n, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
        assert not moved and x.grad.abs().sum() == 0, f"{name}: dead_at({T}) says dead but {moved} get gradients"
    # T >= 3 and 256 sequences: a sparse memory's forgetting acts only where one slot is written twice in a
    # sequence, which at T = 2 is rare enough that kronecker_slots' gamma got no gradient in 9 % of draws of
    # 32 sequences and in 0.3 % of draws of 256 (none in 300 draws at T = 3)
    T = max(live, 3)
    m.zero_grad()
    x = torch.randn(256, T, D_SMALL)
    y = m(x)
    (y * torch.randn_like(y)).sum().backward()
    frozen = [n for n, p in m.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not frozen, f"{name}: at T={T} (first live length {live}) no gradient reaches {frozen}"
