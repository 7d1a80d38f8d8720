"""``zoo check`` of a recipe with a grid builds every cell's model: a cell whose layer or state mixer cannot be built
with its options (a size no option range catches) is refused naming that cell (its label, as ``zoo ablate`` shows
it), the recipe key that holds the options and the cell's own key that set them. Before, the line named the key
only, so a grid of many cells left the user to find the one that failed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoo.cli import main

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers [attention, mamba2], mamba2 defaults set
HUGE = 10 ** 17   # a size whose weights cannot be allocated: refused at once, nothing is allocated


def _grid_recipe(tmp_path: Path, bad_key: str, bad_value) -> tuple[Path, str]:
    """A copy of the tiny recipe with a grid of fine cells and, at a random place among them, one cell (also at a
    random name) whose ``bad_key`` is ``bad_value``; the path and the bad cell's label."""
    count = int(torch.randint(2, 5, ()))
    bad = int(torch.randint(0, count, ()))
    label = f"cell{int(torch.randint(100, 1000, ()))}"
    cells = [f"  - {{label: {label}, {bad_key}: {bad_value}}}" if i == bad else f"  - {{label: fine{i}, seed: {i}}}"
             for i in range(count)]
    path = tmp_path / "grid.yaml"
    path.write_text(TINY.read_text() + "grid:\n" + "\n".join(cells) + "\n")
    return path, label


def _check(capsys, path: Path) -> tuple[int, str]:
    code = main(["check", str(path)])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("bad_key, bad_value, options_key", [
    ("model.mixer_options.mamba2.d_state", HUGE, "model.mixer_options.mamba2"),
    ("model.state_mixer_options.mult", "1.0e+17", "model.state_mixer_options"),
])
def test_a_cell_whose_model_cannot_be_built_is_named(tmp_path, capsys, bad_key, bad_value, options_key):
    path, label = _grid_recipe(tmp_path, bad_key, bad_value)
    code, err = _check(capsys, path)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"grid cell '{label}'" in err, err                  # the cell
    assert f"{options_key}: " in err and "cannot be built" in err, err   # the key holding the options
    assert f"this cell sets {bad_key}=" in err, err            # the cell's own key to change


def test_a_cell_that_builds_passes(tmp_path, capsys):
    path, _label = _grid_recipe(tmp_path, "model.mixer_options.mamba2.d_state", 4)
    code, err = _check(capsys, path)
    assert code == 0, err
