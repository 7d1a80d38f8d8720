"""Loading and feeding the transformers model of a zoo language model: a config whose recipe now resolves to
another key than the one it was trained under is refused (the model built would not be the trained one), a config
written before ``test_time`` existed computes with the recipe's ``eval.test_time`` knobs that its layers declare
(a grid's knob that reaches a cell without it is left out, not refused), and a cache of another kind that already
holds tokens is refused instead of silently started over. Tiny untrained models built here; nothing is written or
downloaded."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import zoo
from mixers import MIXERS
from tests.zoo.untrained import wake_zero_initialised
from zoo.hf import ZooConfig, ZooForCausalLM
from zoo.hf.model import CACHE_FIELD

EOS = 256
GKA = {**MIXERS.get("gka").contract_options, "num_iter": 4}


def lm_recipe(layers, **extra):
    return zoo.load({"model": {"d_model": 16, "layers": layers}, "task": {"name": "lm", "seq_len": 16},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}, **extra})


def config_of(recipe, **fields) -> ZooConfig:
    return ZooConfig(**{"recipe": recipe.plain, "recipe_key": recipe.key, "vocab_size": 257, "eos_token_id": EOS,
                        "pad_token_id": EOS, "bos_token_id": EOS, **fields})


def test_a_recipe_that_resolves_to_another_key_than_its_trained_one_is_refused():
    recipe = lm_recipe(["gla"])
    other = "".join(reversed(recipe.key))
    with pytest.raises(ValueError, match="resolves to key"):
        ZooForCausalLM(config_of(recipe, recipe_key=other))


@torch.no_grad()
def test_a_config_without_test_time_computes_with_the_recipes_knobs_its_layers_declare():
    grid = lm_recipe([{"gka": GKA}], eval={"test_time": {"num_iter": 1}},
                     grid=[{"label": "gka"}, {"label": "gla", "model.layers": ["gla"]}])
    ids = torch.randint(0, 257, (1, int(torch.randint(4, 12, ()))))
    for cell in grid.cells:
        hybrid = wake_zero_initialised(zoo.build_model(cell.recipe)).eval()
        with hybrid.test_time({k: v for k, v in cell.recipe.eval.test_time.items() if k in hybrid.test_time_knobs()}):
            want = hybrid(ids)
        model = ZooForCausalLM(config_of(cell.recipe, test_time=None), hybrid=hybrid).eval()
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_filled_cache_of_another_kind_is_refused_and_an_empty_one_is_replaced():
    model = ZooForCausalLM(config_of(lm_recipe(["gla", "attention"]))).eval()
    wake_zero_initialised(model.zoo)
    ids = torch.randint(0, 257, (2, int(torch.randint(3, 8, ()))))
    filled = DynamicCache()
    filled.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="ZooCache"):
        model(ids, use_cache=True, **{CACHE_FIELD: filled})
    out = model(ids, use_cache=True, **{CACHE_FIELD: DynamicCache()})
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits, rtol=0, atol=1e-5)
    assert getattr(out, CACHE_FIELD).get_seq_length() == ids.shape[1]


def test_the_config_names_the_models_width_depth_and_mixers_for_tools_that_read_them():
    layers = [["gla", "attention", "gla"][int(i)] for i in torch.randint(0, 3, (int(torch.randint(1, 5, ())),))]
    recipe = lm_recipe(layers)
    config = ZooConfig.from_dict(config_of(recipe).to_dict())
    assert (config.hidden_size, config.num_hidden_layers, config.mixers) == (16, len(layers), layers)
