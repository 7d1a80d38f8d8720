"""Recipes: extends, overrides, pattern expansion, and one-line errors for every kind of mistake."""
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.recipes import RecipeError, resolve

HERE = Path(__file__).parent / "recipes"
TINY = HERE / "tiny.yaml"


def zoo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "zoo", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_extends_merges_and_replaces_lists():
    recipe = resolve(HERE / "child.yaml")
    plain = recipe.plain
    assert plain["model"]["layers"] == ["mamba2", "mamba2"]
    assert recipe.train.steps == 4 and recipe.train.batch_size == 16  # merged, not replaced
    assert recipe.model.mixer_options["attention"]["n_heads"] == 2


def test_overrides_index_lists_and_parse_yaml_values():
    recipe = resolve(TINY, ["model.layers.1=attention", "train.lr=1e-2", "task.random_fill=false"])
    assert recipe.plain["model"]["layers"] == ["attention", "attention"]
    assert recipe.train.lr == 0.01 and recipe.task.options.random_fill is False
    plain = resolve(TINY, ["model.layers=[mamba2,mamba2,attention]"]).plain
    assert plain["model"]["layers"] == ["mamba2", "mamba2", "attention"]


def test_pattern_expands_and_can_be_indexed(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(TINY.read_text().replace("layers: [attention, mamba2]", "pattern: [mamba2, mamba2, attention]\n  n_layers: 5"))
    plain = resolve(path).plain
    assert plain["model"]["layers"] == ["mamba2", "mamba2", "attention", "mamba2", "mamba2"]
    plain = resolve(path, ["model.layers.4=attention"]).plain
    assert plain["model"]["layers"] == ["mamba2", "mamba2", "attention", "mamba2", "attention"]


def _broken(tmp_path, old, new):
    text = TINY.read_text()
    assert old in text
    path = tmp_path / "broken.yaml"
    path.write_text(text.replace(old, new))
    line = next(i + 1 for i, l in enumerate(path.read_text().splitlines()) if new in l)
    return path, line


@pytest.mark.parametrize("old,new,expect", [
    ("num_kv_pairs: 2", "num_kv_pair: 2", ["task.num_kv_pair", "did you mean 'num_kv_pairs'"]),
    ("layers: [attention, mamba2]", "layers: [atention, mamba2]", ["model.layers.0", "did you mean 'attention'"]),
    ("steps: 6", "steps: six", ["train.steps", "expected an integer"]),
    ("d_model: 32", "d_modl: 32", ["model.d_modl", "did you mean 'd_model'"]),
    ("n_heads: 2", "n_head: 2", ["model.mixer_options.attention.n_head", "did you mean 'n_heads'"]),
    ("name: mqar", "name: mqr", ["task.name", "did you mean 'mqar'"]),
])
def test_bad_recipe_is_one_line_with_place_and_suggestion(tmp_path, old, new, expect):
    path, line = _broken(tmp_path, old, new)
    result = zoo("check", path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{path}:{line}:" in lines[0], lines[0]
    for text in expect:
        assert text in lines[0], lines[0]


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "syntax.yaml"
    path.write_text("model:\n  d_model: 32\n  layers: [attention, mamba2\ntrain: {steps: 3}\n")
    result = zoo("check", path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    msg = result.stderr.strip()
    assert len(msg.splitlines()) == 1 and "YAML syntax error" in msg and f"{path}:" in msg


@pytest.mark.parametrize("override,expect", [
    ("train.lr", "expected key.path=value"),
    ("model.layers.7=attention", "index out of range"),
    ("model.layers.1=mamba3", "did you mean 'mamba2'"),
    ("trian.steps=3", "did you mean 'train'"),
    ("train.lr=fast", "expected a number"),
])
def test_bad_override_is_one_line(override, expect):
    result = zoo("check", TINY, override)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    msg = result.stderr.strip()
    assert len(msg.splitlines()) == 1 and f"override {override!r}" in msg and expect in msg, msg


def test_missing_file_and_extends_cycle(tmp_path):
    assert zoo("check", tmp_path / "nope.yaml").returncode == 2
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("extends: b.yaml\n")
    b.write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        resolve(a)


def test_check_accepts_every_shipped_recipe():
    root = Path(__file__).parents[2] / "recipes"
    recipes = sorted(p for p in root.rglob("*.yaml") if not p.name.startswith("_"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        result = zoo("check", path)
        assert result.returncode == 0, f"{path}: {result.stderr}"
