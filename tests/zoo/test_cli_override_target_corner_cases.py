"""Overrides whose path runs through a value that is neither a mapping nor a list (``model=1.5`` then
``model.layers.1=mamba2``, ``seed.x=1``): one line naming the key that holds that value, never a traceback."""
import random
from pathlib import Path

import pytest

from tests.zoo.cli_errors import one_line_error

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
SCALARS = {"float": "1.5", "int": "7", "str": "word", "bool": "true"}


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


def test_a_layer_override_after_the_model_became_a_scalar_names_the_model(capsys, rng):
    for type_name, text in rng.sample(sorted(SCALARS.items()), 2):
        layer = f"model.layers.{rng.randrange(2)}=mamba2"
        err = one_line_error(capsys, "check", TINY, f"model={text}", layer)
        assert f"override {layer!r}: model is a {type_name}, not a mapping or list" in err, err


def test_a_layer_option_override_after_the_model_became_a_scalar_names_the_model(capsys, rng):
    text = rng.choice(sorted(SCALARS.values()))
    err = one_line_error(capsys, "check", TINY, f"model={text}", "model.layers.1.mamba2.d_state=4")
    assert ": model is a " in err and "no key 'layers'" in err, err


def test_a_key_below_a_scalar_names_the_scalar_not_the_key(capsys, rng):
    section, child = rng.choice([("seed", "x"), ("model.d_model", "y"), ("task.seq_len", "z")])
    err = one_line_error(capsys, "check", TINY, f"{section}.{child}.deeper={rng.randrange(100)}")
    assert f": {section} is a int, not a mapping or list, so it has no key {child!r}" in err, err
