"""A decode state keeps one layout from start to end of a decode: ``init_state(batch)`` without a device or
dtype lays it out for the mixer's own (a 16-bit mixer steps from it as from ``init_state(batch, dtype=...)``),
and attention's KV cache after a prefill under autocast is in the module's dtype, as ``init_state`` and ``step``
hold it (the first step's concatenation once promoted a bf16 cache to fp32 mid-decode)."""
import pytest
import torch

from mixers import MIXERS

from .contract import D_MODEL, make


def _dtypes(state):
    return {key: value.dtype for key, value in state.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", MIXERS.names())
def test_init_state_without_a_dtype_is_laid_out_for_the_mixers_dtype(name, dtype):
    """Before, a bf16 / fp16 mixer got fp32 buffers from ``init_state(batch)``: ``step`` from them failed on mixed
    operands (attention, GLA, GKA, Mamba-2) or turned the short-convolution buffers to fp32 (the delta rules)."""
    m = make(name, dtype)
    x = torch.randn(2, 3, D_MODEL, dtype=dtype)
    with torch.no_grad():
        default, explicit = m.init_state(2), m.init_state(2, dtype=dtype)
        assert _dtypes(default) == _dtypes(explicit), f"{name} ({dtype}): {_dtypes(default)} != {_dtypes(explicit)}"
        states = {"default": default, "explicit": explicit}
        outputs = {how: [] for how in states}
        for t in range(x.shape[1]):
            for how in states:
                y, states[how] = m.step(x[:, t], states[how])
                outputs[how].append(y)
    assert _dtypes(states["default"]) == _dtypes(explicit), f"{name} ({dtype}): the state changed dtype"
    for a, b in zip(outputs["default"], outputs["explicit"]):
        assert a.dtype == dtype and torch.equal(a, b), f"{name} ({dtype}): steps from init_state(batch) differ"


def test_init_state_without_a_device_is_on_the_mixers_device():
    """The meta device stands for a GPU here: a CUDA mixer's ``init_state(batch)`` once gave CPU tensors."""
    for name in MIXERS.names():
        m = make(name).to("meta")
        state = m.init_state(2)
        assert {t.device.type for t in state.values()} == {"meta"}, f"{name}: {[t.device for t in state.values()]}"


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_attention_kv_cache_keeps_the_module_dtype_after_an_autocast_prefill(autocast_dtype):
    m = make("attention")
    x = torch.randn(2, 7, D_MODEL)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype):
        fresh = m.init_state(2, dtype=torch.float32)
        _, state = m.prefill(x[:, :5])
        seen = {"init_state": _dtypes(fresh), "prefill": _dtypes(state)}
        for t in (5, 6):
            _, state = m.step(x[:, t], state)
            seen[f"step {t}"] = _dtypes(state)
    assert all(s == seen["init_state"] for s in seen.values()), f"attention: KV cache dtypes {seen}"
