"""The Mixer contract (DESIGN.md), applied to every registered mixer.

Registering a mixer is enough to put it under these tests: causality, parallel == step-by-step
recurrence (fp32 and fp64), prefill-then-decode == full forward, chunk-size invariance, batch independence, an honest
``state_size`` (equal to the elements of the state that ``step`` carries), finite outputs and
gradients on degenerate inputs, and dtype round trip. Each mixer is built with its
``contract_options`` (small, strictly causal).
"""
import dataclasses

import pytest
import torch

from mixers import MIXERS, build_mixer

D_MODEL = 32
NAMES = MIXERS.names()


def make(name, dtype=torch.float32, **extra):
    options = {**MIXERS.get(name).contract_options, **extra}
    mixer = build_mixer(name, D_MODEL, options).to(dtype)
    # zero-initialised output projections would make every comparison trivially 0 == 0
    with torch.no_grad():
        for module in mixer.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.abs().sum() == 0:
                module.weight.normal_(0, 0.2)
        for pname, p in mixer.named_parameters():
            if p.ndim == 0 and p.abs().sum() == 0:
                p.fill_(1.0)
    return mixer.eval()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def state_elements(state, batch):
    return sum(t.numel() for t in state.values()) // batch


@pytest.mark.parametrize("name", NAMES)
def test_causal(name):
    m = make(name, torch.float64)
    x = torch.randn(2, 24, D_MODEL, dtype=torch.float64)
    t0 = 13
    x2 = x.clone()
    x2[:, t0:] = torch.randn_like(x2[:, t0:])
    with torch.no_grad():
        y, y2 = m(x), m(x2)
    assert torch.allclose(y[:, :t0], y2[:, :t0], atol=1e-10, rtol=0), f"{name}: output before t={t0} changed"
    assert not torch.allclose(y[:, t0:], y2[:, t0:]), f"{name}: output ignores its inputs"


def tolerance(name, dtype):
    return MIXERS.get(name).contract_fp32_rtol if dtype == torch.float32 else 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_parallel_equals_recurrent(name, dtype):
    m = make(name, dtype)
    x = torch.randn(2, 21, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        y_rec, _ = m.forward_recurrent(x)
    tol = tolerance(name, dtype)
    assert rel(y_rec, y) < tol, f"{name}: parallel vs recurrent rel err {rel(y_rec, y):.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode(name, dtype):
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


@pytest.mark.parametrize("name", NAMES)
def test_state_size_is_the_state_step_carries(name):
    m = make(name)
    for T in (5, 17):
        with torch.no_grad():
            _, state = m.prefill(torch.randn(3, T, D_MODEL))
        assert state_elements(state, 3) == m.state_size(T), f"{name}: state_size({T}) != elements in the state"
    grows = m.state_size(1000) != m.state_size(10)
    assert grows == (name == "attention"), f"{name}: only attention's state may grow with T"


def _chunk_size_is_an_implementation_detail(name):
    # some mixers (SKA chunk-causal) read statistics per chunk: there the chunk size is semantics
    cls = MIXERS.get(name)
    has = "chunk_size" in {f.name for f in dataclasses.fields(cls.Options)}
    return has and not getattr(cls, "chunk_size_changes_output", False)


@pytest.mark.parametrize("name", [n for n in NAMES if _chunk_size_is_an_implementation_detail(n)])
def test_chunk_size_invariance(name):
    x = torch.randn(2, 29, D_MODEL, dtype=torch.float64)
    ref = make(name, torch.float64)
    with torch.no_grad():
        y_ref = ref(x)
        for chunk in (1, 4, 16):
            m = make(name, torch.float64, chunk_size=chunk)
            m.load_state_dict(ref.state_dict())
            assert rel(m(x), y_ref) < 1e-9, f"{name}: chunk_size={chunk} changes the output"


@pytest.mark.parametrize("name", NAMES)
def test_batch_independence(name):
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


@pytest.mark.parametrize("case", DEGENERATE)
@pytest.mark.parametrize("name", NAMES)
def test_finite_on_degenerate_inputs(name, case):
    m = make(name).train()
    x = DEGENERATE[case]().requires_grad_(True)
    y = m(x)
    assert torch.isfinite(y).all(), f"{name}/{case}: non-finite output"
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all(), f"{name}/{case}: non-finite input gradient"
    for pname, p in m.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"{name}/{case}: non-finite gradient of {pname}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_dtype_round_trip(name, dtype):
    m = make(name, dtype)
    x = torch.randn(1, 9, D_MODEL, dtype=dtype)
    with torch.no_grad():
        y = m(x)
        y_t, _ = m.step(x[:, 0], m.init_state(1, dtype=dtype))
    assert y.dtype == dtype and y_t.dtype == dtype


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_bf16_on_cuda(name):
    m = make(name).cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, D_MODEL, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    ref = make(name).cuda()
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert rel(y.float(), ref(x.float())) < 5e-2
