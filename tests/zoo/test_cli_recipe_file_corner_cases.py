"""A recipe file (or an ``extends:`` base) whose whole document is a YAML null (``null``, ``~``, ``Null``, a
comment then ``null``) reads as an empty recipe, as an empty file does: never a traceback."""
import random

import pytest

from tests.zoo.cli_errors import one_line_error
from zoo.cli import main

NULLS = ["null", "~", "Null", "NULL", "# nothing here yet\nnull", "--- ~", "null\n..."]
LAYERS = ["attention", "mamba2", "gla"]


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


def test_a_null_recipe_is_refused_like_an_empty_one(tmp_path, capsys, rng):
    empty, null = tmp_path / "empty.yaml", tmp_path / "null.yaml"
    empty.write_text("")
    null.write_text(rng.choice(NULLS) + "\n")
    expected = one_line_error(capsys, "check", empty).replace(str(empty), "<recipe>")
    assert one_line_error(capsys, "check", null).replace(str(null), "<recipe>") == expected


def test_a_null_base_adds_nothing_to_the_recipe_that_extends_it(tmp_path, capsys, rng):
    base = tmp_path / "base.yaml"
    base.write_text(rng.choice(NULLS) + "\n")
    layers = [rng.choice(LAYERS) for _ in range(rng.randint(1, 2))]
    body = (f"model: {{d_model: 16, layers: [{', '.join(layers)}]}}\n"
            "task: {name: mqar, vocab_size: 16, seq_len: 16, num_kv_pairs: 2}\n")
    child, alone = tmp_path / "child.yaml", tmp_path / "alone.yaml"
    child.write_text(f"extends: {base.name}\n{body}")
    alone.write_text(body)
    assert main(["check", str(child)]) == 0
    with_base = capsys.readouterr().out
    assert main(["check", str(alone)]) == 0
    recipe_key = capsys.readouterr().out.rsplit("recipe ", 1)[1]
    assert with_base.rsplit("recipe ", 1)[1] == recipe_key
