"""Recipes: extends, overrides, pattern expansion, and one-line errors for every kind of mistake."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zoo.errors import UserError
from zoo.recipes import resolve

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
    path.write_text(TINY.read_text().replace("layers: [attention, mamba2]",
                                             "pattern: [mamba2, mamba2, attention]\n  n_layers: 5"))
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
def test_bad_recipe_is_one_line_with_place_and_suggestion(tmp_path, capsys, old, new, expect):
    path, line = _broken(tmp_path, old, new)
    msg = check_fails(capsys, path)   # in this process: the command's own process is tested below
    assert f"{path}:{line}:" in msg, msg
    for text in expect:
        assert text in msg, msg


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
def test_bad_override_is_one_line(capsys, override, expect):
    msg = check_fails(capsys, TINY, override)
    assert f"override {override!r}" in msg and expect in msg, msg


def test_missing_file_and_extends_cycle(tmp_path):
    assert zoo("check", tmp_path / "nope.yaml").returncode == 2
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("extends: b.yaml\n")
    b.write_text("extends: a.yaml\n")
    with pytest.raises(UserError, match="cycle"):
        resolve(a)


def test_check_accepts_every_shipped_recipe(capsys):
    root = Path(__file__).parents[2] / "recipes"
    recipes = sorted(p for p in root.rglob("*.yaml") if not p.name.startswith("_"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        if (yaml.safe_load(path.read_text()).get("task") or {}).get("source") == "hf":
            # a Hugging Face corpus is checked once it is downloaded and prepared (zoo data prepare): until
            # then (here: offline, set before the hub library is imported, so in a process of its own), one line
            # that says which step is missing
            result = subprocess.run([sys.executable, "-m", "zoo", "check", str(path)], capture_output=True, text=True,
                                    env={**os.environ, "HF_HUB_OFFLINE": "1"})
            assert result.returncode in (0, 2) and len(result.stderr.strip().splitlines()) <= 1, result.stderr
            assert result.returncode == 0 or "cannot load" in result.stderr or "not prepared" in result.stderr
            continue
        # in this process (the command's process start is tested above): a recipe is checked in a fraction of it
        code = main(["check", str(path)])
        assert code == 0, f"{path}: {capsys.readouterr().err}"


# --------------------------------------------------------------------------------------- one-line refusals, in-process
from zoo.cli import main  # noqa: E402


def check_fails(capsys, *args) -> str:
    """``zoo check *args`` in this process: exit 2 and one line on stderr, returned."""
    code = main(["check", *map(str, args)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("zoo: error: "), err
    return lines[0]


@pytest.mark.parametrize("override,expect", [
    ("model.d_model=63", "not divisible"),  # only the mixer's constructor knows
    ("train.batch_size=0", "train.batch_size: 0 is out of range: must be >= 1"),
    ("train.lr=-1", "train.lr: -1.0 is out of range: must be > 0"),
    ("train.steps=0", "train.steps: 0 is out of range"),
    ("train.warmup_steps=-5", "train.warmup_steps: -5 is out of range"),
    ("model.n_layers=-2", "model.n_layers: -2 is out of range"),
    ("eval.seq_lens=[0]", "eval.seq_lens.0: 0 is out of range"),
    ("model.d_model=-1", "model.d_model: -1 is out of range"),
    # the training task (2 pairs) is also tested at every eval.seq_lens length; 6 cannot hold them
    ("eval.seq_lens=[32,6]", "eval.seq_lens: mqar: seq_len 6 is too short for 2 pairs (needs >= 8)"),
])
def test_bad_values_are_refused_at_check(capsys, override, expect):
    line = check_fails(capsys, TINY, override)
    assert expect in line, line
    if override != "model.d_model=63":  # a constructor's refusal names the layer, not the override
        assert f"override {override!r}" in line, line


def test_self_referencing_alias_and_alias_bomb_are_one_line(tmp_path, capsys):
    path = tmp_path / "self.yaml"
    path.write_text(TINY.read_text() + "a: &a [*a]\n")
    assert "refers to itself" in check_fails(capsys, path)
    bomb = ["x0: &x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    bomb += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 values
    path.write_text("\n".join(bomb) + "\n" + TINY.read_text())
    assert "expands to more than" in check_fails(capsys, path)


def test_extending_an_ablation_does_not_inherit_its_grid(tmp_path, capsys):
    ablation = tmp_path / "ablation.yaml"
    ablation.write_text(f"extends: {TINY}\ngrid:\n  seed: [1, 2, 3]\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: ablation.yaml\ntrain: {steps: 2}\n")
    assert len(resolve(ablation).cells) == 3
    recipe = resolve(child)
    assert recipe.cells == [] and recipe.config.grid is None and recipe.train.steps == 2
    assert main(["check", str(child)]) == 0
    assert "grid cells" not in capsys.readouterr().out
    # `zoo train` on the ablation itself trains the base recipe only, and says so on stderr
    assert main(["train", str(ablation), "--no-progress", "train.steps=2"]) == 0
    err = capsys.readouterr().err
    assert "has a grid of 3 cells; training the base recipe only" in err
