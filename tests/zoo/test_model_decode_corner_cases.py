"""Decoding from a state in another dtype than the one ``init_state`` lays out for the mixer.

A state kept from before ``model.to(dtype)`` once reached the mixers' step unchecked: an fp64 state in an fp32
mixer failed deep inside some (torch's "expected m1 and m2 to have the same dtype") and was carried on in fp64
by others, and an fp16 state failed SKA's Cholesky ("not implemented for 'Half'") while the other mixers took
it. The step boundary now raises a state in a dtype that converts exactly (what a prefill under autocast may
leave) to the layout's dtype, and refuses any other by its key, both dtypes and the fix.
"""
import pytest
import torch

from mixers import MIXERS
from tests.mixers.contract import D_MODEL, make, rel
from zoo.model import HybridLM
from zoo.recipes import resolve


def _prefilled(name):
    m = make(name)
    x = torch.randn(2, 4, D_MODEL)
    with torch.no_grad():
        _, state = m.prefill(x[:, :3])
    return m, x, state


@pytest.mark.parametrize("name", MIXERS.names())
def test_step_refuses_a_wider_state_and_names_the_key(name):
    m, x, state = _prefilled(name)
    key = sorted(state)[0]
    with torch.no_grad(), pytest.raises(TypeError, match=rf"{name}\.step: state\['{key}'\] is torch\.float64.*init_state"):
        m.step(x[:, 3], {**state, key: state[key].double()})


@pytest.mark.parametrize("name", MIXERS.names())
def test_step_raises_a_half_precision_state_exactly(name):
    m, x, state = _prefilled(name)
    half = {k: v.half() for k, v in state.items()}
    with torch.no_grad():
        y_t, new = m.step(x[:, 3], {k: v.clone() for k, v in half.items()})
        y_ref, ref = m.step(x[:, 3], {k: v.float() for k, v in half.items()})
        fresh = m.init_state(2)
    assert torch.equal(y_t, y_ref), f"{name}: step from an fp16 state differs from the same state raised to fp32"
    assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in fresh.items()}
    assert all(torch.equal(new[k], ref[k]) for k in ref)


def test_a_model_converted_after_its_prefill_refuses_its_wider_states():
    model = HybridLM.from_recipe(resolve({"model": {"d_model": 32, "layers": ["gla", "attention"],
                                                    "mixer_options": {"gla": {"n_heads": 2}, "attention": {"n_heads": 2}}},
                                          "task": {"name": "mqar"}}), vocab_size=20).double().eval()
    ids = torch.randint(20, (2, 6))
    _, states = model.prefill(ids[:, :5])
    model.float()
    with pytest.raises(TypeError, match=r"gla\.step: state\['\w+'\] is torch\.float64.*a gla in torch\.float32"):
        model.step(ids[:, 5], states)
    _, fresh = model.prefill(ids[:, :5])
    logits, _ = model.step(ids[:, 5], fresh)
    assert rel(logits, model(ids)[:, 5]) < 1e-5
