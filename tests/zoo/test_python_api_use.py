"""The Python API used as a notebook uses it: ``zoo.load`` takes overrides as a list, one string, a mapping or
None, and a Recipe again; ``zoo.build_model`` / ``build_task`` / ``train`` take a Recipe or a recipe file or
mapping; ``zoo.build_model`` leaves the caller's random state alone; and an argument of the wrong kind (a
TrainResult where a checkpoint path goes, a number as an override) is named in one line that is a UserError
and a TypeError."""
from pathlib import Path

import pytest
import torch
import yaml

import zoo
from zoo.training.loop import TrainResult

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _mapping() -> dict:
    return yaml.safe_load(TINY.read_text())


def _lr() -> float:
    return float(torch.empty(()).uniform_(1e-4, 1e-2))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    one, two = a.state_dict(), b.state_dict()
    return one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_overrides_as_one_string_a_list_a_mapping_or_none():
    lr = _lr()
    listed = zoo.load(TINY, [f"train.lr={lr!r}"])
    assert listed.train.lr == lr
    assert zoo.load(TINY, f"train.lr={lr!r}").key == listed.key
    assert zoo.load(TINY, {"train.lr": lr}).key == listed.key
    assert zoo.load(TINY, None).key == zoo.load(TINY).key != listed.key


def test_a_recipe_given_again_takes_more_overrides():
    first = zoo.load(_mapping())
    assert zoo.load(first) is first
    lr = _lr()
    assert zoo.load(first, [f"train.lr={lr!r}"]).key == zoo.load(TINY, [f"train.lr={lr!r}"]).key
    gridded = zoo.load(TINY, ["grid={train.lr: [0.001, 0.002]}"])
    with pytest.raises(zoo.UserError, match="grid cells"):
        zoo.load(gridded, ["train.steps=2"])


def test_a_file_and_its_mapping_give_the_same_recipe_and_weights(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(TINY.read_text())
    recipe = zoo.load(_mapping())
    assert zoo.load(path).key == zoo.load(str(path)).key == recipe.key
    model = zoo.build_model(recipe)
    for source in (recipe, str(path), path, _mapping()):
        assert _same_weights(zoo.build_model(source), model)
        assert zoo.build_task(source).vocab_size == model.embed.num_embeddings


def test_build_model_leaves_the_callers_random_state_alone():
    recipe = zoo.load(TINY)
    state = torch.get_rng_state()
    expected = torch.rand(4)
    torch.set_rng_state(state)
    zoo.build_model(recipe)
    assert torch.equal(torch.rand(4), expected)


def test_extends_in_a_mapping_is_pointed_to_the_file():
    with pytest.raises(zoo.UserError, match="recipe file") as err:
        zoo.load({**_mapping(), "extends": "tiny.yaml"})
    assert "\n" not in str(err.value)


def _wrong_calls(recipe, result):
    return {
        "override 20 is an int": lambda: zoo.load(TINY, [20]),
        "override key 3 is an int": lambda: zoo.load(TINY, {3: 4}),
        "overrides must be": lambda: zoo.load(TINY, 20),
        "zoo.load: expected a recipe file": lambda: zoo.load(3),
        "result.recipe": lambda: zoo.build_model(result),
        "zoo.build_task: expected a Recipe": lambda: zoo.build_task(None),
        "zoo.train: expected a Recipe": lambda: zoo.train(7, progress=False),
        "checkpoint_dir must be a folder path": lambda: zoo.train(recipe, progress=False, checkpoint_dir=3),
        "a TrainResult is not a checkpoint": lambda: zoo.load_checkpoint(result),
        "zoo.evaluate_checkpoint: a TrainResult": lambda: zoo.evaluate_checkpoint(result),
        "a Recipe is not a checkpoint": lambda: zoo.evaluate(recipe),
        "a model alone carries no recipe": lambda: zoo.evaluate(result.model),
        "pass its folder or file path": lambda: zoo.evaluate({"recipe": recipe.plain}),
        "zoo.load_checkpoint: expected a checkpoint folder": lambda: zoo.load_checkpoint(None),
    }


def test_arguments_of_the_wrong_kind_are_named_in_one_line():
    recipe = zoo.load(TINY)
    result = TrainResult({}, zoo.build_model(recipe), [], recipe)
    for expected, call in _wrong_calls(recipe, result).items():
        with pytest.raises(zoo.UserError) as err:
            call()
        assert isinstance(err.value, TypeError), expected
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_grid_recipe_trains_its_base_with_a_warning_and_evaluates_from_any_path(tmp_path):
    recipe = zoo.load(TINY, ["train.steps=2", "task.num_test=16", "grid={train.lr: [0.001, 0.002]}"])
    with pytest.warns(UserWarning, match="base recipe only"):
        result = zoo.train(recipe, progress=False, checkpoint_dir=str(tmp_path))
    assert result.recipe.key == recipe.key
    again = zoo.evaluate(result, "eval.seq_lens=[24]")
    for location in (tmp_path, str(tmp_path), tmp_path / "checkpoint.pt"):
        metrics = zoo.evaluate(location, "eval.seq_lens=[24]")
        assert metrics["test_accuracy@24"] == again["test_accuracy@24"]
        assert metrics["test_accuracy"] == result.metrics["test_accuracy"]
        assert list(metrics) == list(again), "a TrainResult and its checkpoint evaluate to different keys"
        assert metrics["steps"] == again["steps"] == 2 and metrics["device"] == again["device"] == "cpu"
    assert zoo.load_checkpoint(str(tmp_path))["recipe_key"] == recipe.key
