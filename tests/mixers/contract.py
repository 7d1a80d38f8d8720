"""The Mixer contract as plain check functions, one per invariant, each taking a registered mixer name.

``tests/mixers/test_contract.py`` runs every check on every registered mixer; the checks read the
mixer's declarations (``state_grows_with_seq_len``, ``chunk_size_changes_output``, ``uses_mask``,
``test_time_knobs``), never its name, so a mixer with a missing or wrong declaration fails, and
``tests/mixers/test_contract_catches.py`` shows that deliberately broken mixers do.
Each mixer is built with its ``contract_options`` (small, strictly causal).
"""
from __future__ import annotations

import dataclasses

import torch

from mixers import MIXERS, build_mixer
from mixers.base import Mixer

D_MODEL = 32


def make(name, dtype=torch.float32, **extra):
    options = {**MIXERS.get(name).contract_options, **extra}
    mixer = build_mixer(name, D_MODEL, options).to(dtype)
    # zero-initialised output projections would make every comparison trivially 0 == 0
    with torch.no_grad():
        for module in mixer.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.abs().sum() == 0:
                module.weight.normal_(0, 0.2)
        for _, p in mixer.named_parameters():
            if p.ndim == 0 and p.abs().sum() == 0:
                p.fill_(1.0)
    return mixer.eval()


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


def check_causal(name):
    m = make(name, torch.float64)
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    t0 = 13
    x2 = x.clone()
    x2[:, t0:] = torch.randn_like(x2[:, t0:])
    with torch.no_grad():
        y, y2 = m(x), m(x2)
    assert torch.allclose(y[:, :t0], y2[:, :t0], atol=1e-10, rtol=0), f"{name}: output before t={t0} changed"
    assert not torch.allclose(y[:, t0:], y2[:, t0:]), f"{name}: output ignores its inputs"


def check_parallel_equals_recurrent(name, dtype):
    m = make(name, dtype)
    x = torch.randn(2, 21, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        y_rec, _ = m.forward_recurrent(x)
    tol = tolerance(name, dtype)
    assert rel(y_rec, y) < tol, f"{name}: parallel vs recurrent rel err {rel(y_rec, y):.2e} > {tol:.0e}"


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
        assert sizes[T] == m.state_size(T), f"{name}: state_size({T}) != elements in the state prefill returns"
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
