"""A hybrid's test-time context that one layer refuses leaves every layer as it was.

``HybridLM.test_time(values)`` hands one mapping to every layer; a value one layer refuses (out of its
range) must not stay set on the layers that accepted theirs before it: after the refusal, evaluation
uses each layer's own options again.
"""
import pytest
import torch

from mixers.options import OptionError
from zoo.model import HybridLM
from zoo.recipes import resolve

TASK = {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 64, "num_test": 16}


def test_a_refused_knob_leaves_the_layers_before_it_with_their_own_options():
    powers = [int(p) for p in torch.randint(0, 4, (2,))]
    iters = [int(n) for n in torch.randint(1, 6, (2,))]
    layers = [{"ska": {"power": powers[0]}}, {"gka": {"num_iter": iters[0]}},
              {"ska": {"power": powers[1]}}, {"gka": {"num_iter": iters[1]}}]
    recipe = resolve({"model": {"d_model": 16, "layers": layers,
                                "mixer_options": {"ska": {"n_heads": 2, "rank": 4}, "gka": {"n_heads": 2}}},
                      "task": TASK})
    model = HybridLM.from_recipe(recipe, 32).eval()
    others = [p for p in range(6) if p not in powers]
    new_power = others[int(torch.randint(0, len(others), ()))]
    with pytest.raises(OptionError, match="num_iter"):
        with model.test_time({"power": new_power, "num_iter": -1}):   # the ska layers accept, gka refuses
            pass
    # every layer reads its own option again (independent expectation: the written layers)
    assert [model.blocks[0].mixer.knob("power"), model.blocks[2].mixer.knob("power")] == powers
    assert [model.blocks[1].mixer.knob("num_iter"), model.blocks[3].mixer.knob("num_iter")] == iters
    # and a valid context still sets, then restores, every layer
    with model.test_time({"power": new_power, "num_iter": 7}):
        assert [model.blocks[i].mixer.knob("power") for i in (0, 2)] == [new_power] * 2
        assert [model.blocks[i].mixer.knob("num_iter") for i in (1, 3)] == [7, 7]
    assert [model.blocks[0].mixer.knob("power"), model.blocks[2].mixer.knob("power")] == powers
