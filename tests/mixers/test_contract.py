"""The Mixer contract (``tests/mixers/contract.py``), applied to every registered mixer.

Registering a mixer is enough to put it under these tests: declarations, a parallel prefill, causality,
parallel == step-by-step recurrence (fp32 and fp64), prefill-then-decode == full forward, chunk-size
invariance unless declared otherwise, mask use as declared, batch independence, an honest
``state_size`` that grows with T exactly when declared, finite outputs and gradients on degenerate
inputs, dtype round trip and test-time knobs; the input boundary (every malformed tensor refused with one
line naming the argument, T = 0 empty), a huge finite input never turning earlier outputs non-finite, bf16
autocast decode == forward, and gradients reaching every parameter at the first length ``dead_at`` allows.
"""
import pytest
import torch

from mixers import MIXERS

from . import contract
from .contract import D_MODEL, DEGENERATE, make, rel

NAMES = MIXERS.names()
SIMPLE = ("declarations", "prefill_is_parallel", "causal", "state_size", "chunk_size", "mask_declaration",
          "batch_independence", "test_time_knobs", "autocast", "boundary", "empty_time", "large_finite_input",
          "autocast_decode", "gradients_reach_every_parameter")
BY_DTYPE = ("parallel_equals_recurrent", "prefill_then_decode", "dtype_round_trip")


@pytest.mark.parametrize("check", SIMPLE)
@pytest.mark.parametrize("name", NAMES)
def test_contract(name, check):
    getattr(contract, f"check_{check}")(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("check", BY_DTYPE)
@pytest.mark.parametrize("name", NAMES)
def test_contract_in_dtype(name, check, dtype):
    getattr(contract, f"check_{check}")(name, dtype)


@pytest.mark.parametrize("case", DEGENERATE)
@pytest.mark.parametrize("name", NAMES)
def test_finite_on_degenerate_inputs(name, case):
    contract.check_finite(name, case)


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
