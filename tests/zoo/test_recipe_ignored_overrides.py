"""Overrides that would change nothing are refused instead of being accepted silently.

- ``zoo ablate RECIPE key=value`` where every cell of the grid sets that key (or a mapping above it, or gives
  the model's layers the other way) itself: each cell replaces the override, so no run of the ablation sees it;
- ``train.steps=N`` as an override of a recipe whose ``train.tokens`` sets the step count: the token budget
  derives the steps and N is dropped.
"""
import json
from pathlib import Path

import pytest

from zoo.cli import main
from zoo.errors import UserError
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers: [attention, mamba2], batch 16, seq_len 16

GRID = """
grid:
  - {label: a, model.layers: [attention, attention], train.lr: 1.0e-3}
  - {label: b, model.layers: [mamba2, attention], train.lr: 2.0e-3}
"""


def _grid_recipe(tmp_path) -> Path:
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(TINY.read_text() + GRID)
    return recipe


@pytest.mark.parametrize("override, key", [("train.lr=5e-3", "train.lr"), ("model.layers.1=mamba2", "model.layers"),
                                           ("model.pattern=[mamba2]", "model.layers")])
def test_ablate_refuses_an_override_that_every_cell_replaces(tmp_path, capsys, override, key):
    recipe = _grid_recipe(tmp_path)
    # what the cells would run: the override is nowhere in them
    plain = [c.recipe.plain for c in resolve(recipe, [override, "model.n_layers=2"] if "pattern" in override
                                             else [override]).cells]
    assert [p["train"]["lr"] for p in plain] == [1e-3, 2e-3]
    assert [p["model"]["layers"] for p in plain] == [["attention", "attention"], ["mamba2", "attention"]]
    extra = ["model.n_layers=2"] if "pattern" in override else []
    out = tmp_path / "out"
    code = main(["ablate", str(recipe), "--out", str(out), "--no-progress", "--no-plot", override, *extra])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert override.split("=")[0] in err and key in err and "every cell" in err, err
    assert not (out / "results.jsonl").exists()


def test_ablate_keeps_an_override_that_reaches_some_cell(tmp_path, capsys):
    recipe = tmp_path / "partial.yaml"
    recipe.write_text(TINY.read_text() + """
grid:
  - {label: a, train.lr: 1.0e-3}
  - {label: b, model.layers: [mamba2, mamba2]}
""")
    out = tmp_path / "out"
    argv = ["ablate", str(recipe), "--out", str(out), "--no-progress", "--no-plot", "model.layers.1=attention",
            "train.steps=2", "train.warmup_steps=0"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = {r["label"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows["a"]["recipe"]["model"]["layers"] == ["attention", "attention"]   # the override reached cell a
    assert rows["b"]["recipe"]["model"]["layers"] == ["mamba2", "mamba2"]


def test_a_steps_override_under_a_token_budget_is_refused():
    tokens = 16 * 16 * 7   # batch 16 x seq_len 16: 7 steps
    assert resolve(TINY, [f"train.tokens={tokens}"]).train.steps == 7
    with pytest.raises(UserError, match=r"override 'train\.steps=3'.*train\.tokens=1792 sets the steps \(7"):
        resolve(TINY, [f"train.tokens={tokens}", "train.steps=3"])
    # the same count, or tokens=0, is what was written: accepted
    assert resolve(TINY, [f"train.tokens={tokens}", "train.steps=7"]).train.steps == 7
    assert resolve(TINY, [f"train.tokens={tokens}", "train.tokens=0", "train.steps=3"]).train.steps == 3


def test_a_grid_cells_steps_under_a_token_budget_is_refused(tmp_path):
    recipe = tmp_path / "budget.yaml"
    recipe.write_text(TINY.read_text().replace("steps: 6,", "steps: 6, tokens: 1792,") + """
grid:
  - {label: short, train.steps: 3}
  - {label: long, train.steps: 5}
""")
    with pytest.raises(UserError, match=r"grid cell 'short' \(train\.steps=3\).*has no effect"):
        resolve(recipe)
    # a recorded recipe (steps derived from tokens, both written) resolves as it was recorded
    plain = resolve(TINY, ["train.tokens=1792"]).plain
    assert plain["train"]["steps"] == 7 and resolve(plain).train.steps == 7
