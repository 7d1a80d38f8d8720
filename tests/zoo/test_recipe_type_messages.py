"""A value of the wrong type is refused in a recipe's words: the key, the kind of value expected with an example,
the value given and, where the given text reads as the expected kind, how to write it; that example, used instead,
is accepted."""
from dataclasses import dataclass
from typing import Literal

import pytest

from mixers.options import OptionError, build_options, opt
from zoo.errors import UserError
from zoo.recipes import resolve

from .test_recipe_errors_more import TINY, _line, _recipe
from .test_recipes import check_fails

# (override, its key, the value given as the message shows it, the example the message gives, that example as
# an override that is accepted)
CASES = [
    ("train.steps=six", "train.steps", "the string 'six'", "an integer such as 1000", "train.steps=1000"),
    ('train.steps="6"', "train.steps", "the string '6'", "write train.steps=6", "train.steps=6"),
    ("train.lr=fast", "train.lr", "the string 'fast'", "a number such as 0.001", "train.lr=0.001"),
    ('train.compile="false"', "train.compile", "the string 'false'", "write train.compile=false",
     "train.compile=false"),
    ("model.use_mask=1", "model.use_mask", "got 1", "true or false", "model.use_mask=true"),
    ("name=3", "name", "got 3", "write name='3'", "name='3'"),
    ('eval.seq_lens="[16]"', "eval.seq_lens", "the string '[16]'", "write eval.seq_lens=[16]", "eval.seq_lens=[16]"),
    ('seeds="0,1"', "seeds", "the string '0,1'", "write seeds=[0, 1]", "seeds=[0, 1]"),
    ("seeds=true", "seeds", "got true", "a list such as [0, 1] or nothing (null)", "seeds=[0, 1]"),
    ("model.layers=attention", "model.layers", "the string 'attention'", "write model.layers=[attention]",
     "model.layers=[attention]"),
    ('model.state_mixer_options="{}"', "model.state_mixer_options", "the string '{}'",
     "write model.state_mixer_options={}", "model.state_mixer_options={}"),
    ('model.mixer_options.attention="{n_heads: 4}"', "model.mixer_options.attention", "the string '{n_heads: 4}'",
     "write model.mixer_options.attention={n_heads: 4}", "model.mixer_options.attention={n_heads: 4}"),
    ("train.device=3", "train.device", "got 3", "a string such as auto", "train.device=auto"),
    ("train.device=gpu", "train.device", "'gpu'", "'cuda'", "train.device=cuda"),
    ("train=3", "train", "got 3", "a mapping of options such as {steps: 1000}", "train={steps: 1000}"),
    ('model.layers.0.attention.n_heads="4"', "model.layers.0.attention.n_heads", "the string '4'",
     "write model.layers.0.attention.n_heads=4", "model.layers.0.attention.n_heads=4"),
]


@pytest.mark.parametrize("override,key,given,example,accepted", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_type_names_the_key_the_value_and_a_valid_example(capsys, override, key, given, example, accepted):
    line = check_fails(capsys, TINY, override)
    assert line.startswith(f"zoo: error: override {override!r}: {key}: "), line
    assert given in line and example in line, line
    assert "NoneType" not in line and "expected list" not in line, line
    resolve(TINY, [accepted])   # the example, used instead, is accepted


def test_a_suggestion_the_choices_refuse_is_left_out(capsys):
    line = check_fails(capsys, TINY, "train.device=3")
    assert "write" not in line, line   # '3' is a string, but not one of the devices


def test_a_recipe_file_is_told_how_to_write_the_key_there(tmp_path, capsys):
    path = _recipe(tmp_path, "seeds.yaml", TINY.read_text().replace("seed: 3", 'seeds: "0,1"'))
    line = check_fails(capsys, path)
    written = "seeds: [0, 1]"
    assert line.startswith(f"zoo: error: {path}:{_line(path, 'seeds:')}: seeds: expected a list such as [0, 1] "
                           f"or nothing (null), got the string '0,1'; write {written}"), line
    resolve(_recipe(tmp_path, "fixed.yaml", path.read_text().replace('seeds: "0,1"', written)))
    nested = _recipe(tmp_path, "steps.yaml", TINY.read_text().replace("steps: 6,", 'steps: "6",'))
    line = check_fails(capsys, nested)
    assert f"{nested}:{_line(nested, 'steps:')}: train.steps: " in line and line.endswith("; write steps: 6"), line


def test_a_grid_cell_is_told_how_to_write_its_key(tmp_path, capsys):
    path = _recipe(tmp_path, "cell.yaml", TINY.read_text() + "grid:\n  - {label: one, model.layers: attention}\n")
    line = check_fails(capsys, path)
    assert f"{path}:{_line(path, 'label: one')}: grid cell 'one' (model.layers=attention): model.layers: " in line, line
    assert line.endswith("got the string 'attention'; write model.layers: [attention]"), line
    resolve(_recipe(tmp_path, "fixed.yaml", path.read_text().replace("model.layers: attention",
                                                                      "model.layers: [attention]")))


def test_an_item_of_a_list_is_named_by_its_place():
    with pytest.raises(UserError, match=r"override 'seeds=\[0, \"1\"\]': seeds.1: expected an integer such as 1, "
                                        r"got the string '1'; write seeds.1=1"):
        resolve(TINY, ['seeds=[0, "1"]'])


@dataclass
class _Shape:
    kind: Literal["square", "circle"] = opt("square", "the shape")


def test_a_literal_names_its_values():
    with pytest.raises(OptionError) as err:
        build_options(_Shape, {"kind": "triangle"})
    assert str(err.value) == "kind: expected one of square, circle, got the string 'triangle'", err.value
    assert build_options(_Shape, {"kind": "circle"}).kind == "circle"
