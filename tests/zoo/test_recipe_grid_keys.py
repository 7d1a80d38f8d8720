"""Grid keys whose values are not layers, and grid keys a cell cannot set.

- A cell's label is made from its values (``key=value``); a list of mappings that are not layers (``eval.tasks``
  entries) or a malformed layer (``{mamba2: 4}``) gets a label too, so that the grid resolves or validation names
  the problem in one line (labelling them raised a bare ValueError or AttributeError, a traceback);
- a grid mapping with a ``seeds`` or ``grid`` key is refused: a cell runs once, so the cell's own seeds list (or
  grid) would never be expanded and the cell would silently run the recipe's one seed.
"""
import copy
from pathlib import Path

import pytest
import torch
import yaml

from zoo.cli import main
from zoo.errors import UserError
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # seed 3, layers [attention, mamba2]
FEW = {"name": "mqar", "label": "few", "num_kv_pairs": 1}


def _with_grid(grid) -> dict:
    recipe = yaml.safe_load(TINY.read_text())
    recipe["grid"] = copy.deepcopy(grid)
    return recipe


def test_a_product_grid_over_eval_tasks_resolves(tmp_path, capsys):
    cells = resolve(_with_grid({"eval.tasks": [[FEW], []]})).cells
    assert [[(label, spec.options.num_kv_pairs) for label, spec in c.recipe.eval_tasks] for c in cells] == \
        [[("few", 1)], []]
    assert len({c.label for c in cells}) == 2
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump(_with_grid({"eval.tasks": [[FEW], []]})))
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "2 grid cells" in captured.out


def test_listed_cells_without_labels_over_eval_tasks_resolve():
    cells = resolve(_with_grid([{"eval.tasks": [FEW]}, {"train.lr": 0.01}])).cells
    assert [len(c.recipe.eval_tasks) for c in cells] == [1, 0]
    assert cells[0].label.startswith("eval.tasks=") and cells[1].label == "train.lr=0.01"


def test_a_malformed_layer_in_a_grid_is_named_not_a_traceback():
    with pytest.raises(UserError, match=r"model\.layers\.1\.mamba2: per-layer options must be a mapping"):
        resolve(_with_grid({"model.layers": [["attention", {"mamba2": 4}]]}))


@pytest.mark.parametrize("grid, key", [({"seeds": [[0, 1]]}, "seeds"),
                                       ({"grid": [[{"train.lr": 0.1}]], "train.lr": [0.001]}, "grid")])
def test_a_grid_key_a_cell_cannot_set_is_refused(grid, key):
    # before: the cell ran once with the recipe's seed 3, its seeds [0, 1] never expanded
    with pytest.raises(UserError, match=rf"grid\.{key}: a grid cell cannot set"):
        resolve(_with_grid(grid))
    # the top-level seeds do what the cell meant
    seeded = _with_grid({"train.lr": [0.001]})
    seeded["seeds"] = [0, 1]
    assert [c.recipe.seed for c in resolve(seeded).cells] == [0, 1]


def test_labels_differing_only_by_a_seed_word_must_be_seeds_of_one_cell():
    """The tables read a ``seed=N`` word in a label as a seed of the cell named by the rest: cells so labelled that
    differ in more than ``seed`` would be averaged as one cell, and are refused; true seed replicates pass."""
    from zoo.recipes.grids import expand_grid

    lr = float(torch.empty(()).uniform_(1e-4, 1e-2))
    with pytest.raises(UserError, match=r"differ in more than their seed.* seed of the cell 'attn'"):
        expand_grid([{"label": "attn seed=1", "train.lr": lr}, {"label": "attn seed=2", "train.lr": 2 * lr}])
    cells = expand_grid([{"label": "attn seed=1", "seed": 1, "train.lr": lr},
                         {"label": "attn seed=2", "seed": 2, "train.lr": lr},
                         {"label": "gla seed=1", "seed": 1, "train.lr": 2 * lr}])
    assert [label for label, _ in cells] == ["attn seed=1", "attn seed=2", "gla seed=1"]


def test_a_label_of_zero_is_kept_and_an_empty_label_is_refused():
    """``label: 0`` names its cell "0" (it was replaced by the cell's overrides, as a missing label is); an empty
    label is refused."""
    from zoo.recipes.grids import expand_grid

    n = int(torch.randint(2, 5, ()))
    cells = expand_grid([{"label": i, "train.lr": 0.1 * (i + 1)} for i in range(n)])
    assert [label for label, _ in cells] == [str(i) for i in range(n)]
    with pytest.raises(UserError, match="label is empty"):
        expand_grid([{"label": "", "train.lr": 0.1}])
