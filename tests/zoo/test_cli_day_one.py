"""What a researcher meets on day one with the `zoo` command line, each once wrong and now checked:

- ``zoo ablate`` refuses, before any cell trains, a cell that cannot start on this machine (a layer's chosen
  backend that cannot run on its device, a device that is not here), instead of training the cells before it and
  then failing it at every re-run; a refused run leaves no new folder behind, and a cell that fails with a problem
  of the recipe is not retried;
- an override of ``model.mixer_options.<mixer>`` that no layer takes (no layer of that mixer in the recipe or in
  any cell of its grid, or every such layer sets the option itself) is refused in one line, as the README promises
  for every key that would be ignored, instead of being recorded in the rows and the recipe hash while training
  nothing differently;
- a folder in place of a file an ablation writes (``results.md``...) is refused before training, not a traceback
  after it;
- the refusal of a changed cell says both ways on: another ``--out``, or the recipe as it was.
"""
import json
from pathlib import Path

import pytest
import torch

from zoo.cli import main
from zoo.errors import UserError
from zoo.experiments.ablate import cells_of
from zoo.experiments.executors import SequentialExecutor
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers [attention, mamba2], 6 steps of batch 16
QUICK = ["train.steps=2", "train.warmup_steps=0", "--no-progress", "--no-plot"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zoo: error: "), err
    return lines[0]


def _grid(tmp_path, *cells: str) -> Path:
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {TINY}\ngrid:\n" + "".join(f"  - {c}\n" for c in cells))
    return recipe


# --------------------------------------------------------------------------------------- cells that cannot start here
def test_ablate_refuses_a_cell_whose_backend_cannot_run_here_before_any_cell_trains(tmp_path, capsys):
    # flash-attn runs CUDA kernels only: on the CPU (train.device=cpu, on any machine) the second cell can never run
    recipe = _grid(tmp_path, "{label: plain}",
                   "{label: flash, model.layers: [{attention: {backend: flash_attn}}, mamba2]}")
    out = tmp_path / "runs" / "out"
    code = main(["ablate", str(recipe), "--out", str(out), "train.device=cpu", *QUICK])
    line = _one_line(capsys)
    assert code == 2
    assert "'flash'" in line and "flash_attn" in line and "nothing was trained" in line, line
    assert not (tmp_path / "runs").exists()   # no cell trained, and no folder left that would read as an ablation's


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_ablate_refuses_a_device_that_is_not_here_before_any_cell_trains(tmp_path, capsys):
    recipe = _grid(tmp_path, "{label: here}", "{label: gpu, train.device: cuda}")
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), *QUICK]) == 2
    line = _one_line(capsys)
    assert "'gpu'" in line and "train.device=cuda" in line and "no CUDA device" in line, line
    assert not out.exists()


def test_a_refused_run_keeps_a_folder_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    recipe = _grid(tmp_path, "{label: flash, model.layers: [{attention: {backend: flash_attn}}, mamba2]}")
    assert main(["ablate", str(recipe), "--out", str(out), "train.device=cpu", *QUICK]) == 2
    assert "flash_attn" in _one_line(capsys)
    assert (out / "notes.txt").read_text() == "mine\n"


def test_a_cell_failing_on_its_recipe_is_not_retried(monkeypatch):
    from zoo.experiments import executors
    calls = []

    def refuse(cell, **_kwargs):
        calls.append(cell.label)
        raise UserError("train.tracking=wandb needs the wandb package")
    monkeypatch.setattr(executors, "run_cell", refuse)
    executor = SequentialExecutor(retries=2, progress=False, echo=lambda *_: None)
    executor.submit(0, cells_of(resolve(TINY))[0])
    (outcome,) = list(executor.finished())
    assert outcome.row is None and outcome.attempts == 1 and calls == ["base"], (outcome, calls)
    assert "wandb" in outcome.error


# --------------------------------------------------------------------------------------- options no layer takes
@pytest.mark.parametrize("override", ["model.mixer_options.ska.rank=4", "model.mixer_options.ska={rank: 4}"])
def test_an_option_of_a_mixer_no_layer_is_is_refused(capsys, override):
    assert main(["check", str(TINY), override]) == 2
    line = _one_line(capsys)
    assert override in line and "no layer" in line and "ska" in line and "attention, mamba2" in line, line


def test_an_option_every_layer_of_its_mixer_sets_itself_is_refused(capsys):
    layers = "model.layers=[{attention: {n_heads: 2}}, mamba2]"
    assert main(["check", str(TINY), layers, "model.mixer_options.attention.n_heads=4"]) == 2
    line = _one_line(capsys)
    assert "n_heads" in line and "itself" in line and "model.layers.<i>.attention.n_heads" in line, line
    # an option that layer does not set reaches it
    assert main(["check", str(TINY), layers, "model.mixer_options.attention.head_dim=8"]) == 0, capsys.readouterr().err


def test_an_option_that_reaches_a_layer_or_a_cell_is_kept(tmp_path, capsys):
    assert main(["check", str(TINY), "model.layers.1=ska", "model.mixer_options.ska.chunk_size=4"]) == 0, \
        capsys.readouterr().err
    recipe = _grid(tmp_path, "{label: a}", "{label: s, model.layers: [ska, attention]}")
    assert main(["check", str(recipe), "model.mixer_options.ska.chunk_size=4"]) == 0, capsys.readouterr().err
    plain = [c.recipe.plain for c in resolve(recipe, ["model.mixer_options.ska.chunk_size=4"]).cells]
    assert plain[1]["model"]["layer_options"][0]["chunk_size"] == 4


def test_a_grid_cell_setting_options_of_a_mixer_it_lacks_is_refused(tmp_path, capsys):
    # (two cells that differ in that option alone are refused as one recipe twice: here they differ in the lr too)
    recipe = _grid(tmp_path, "{label: a, train.lr: 1.0e-3}",
                   "{label: r4, train.lr: 2.0e-3, model.mixer_options.ska.rank: 4}")
    assert main(["check", str(recipe)]) == 2
    line = _one_line(capsys)
    assert "grid cell 'r4'" in line and "no layer of this cell is ska" in line and "grid.yaml:4" in line, line


def test_ablate_with_an_ignored_option_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", str(TINY), "--out", str(out), "model.mixer_options.gka.num_iter=3", *QUICK]) == 2
    assert "gka" in _one_line(capsys)
    assert not out.exists()


def test_ablate_refuses_an_option_only_the_base_recipe_takes(tmp_path, capsys):
    # zoo train trains the base recipe (layers attention + ska here), zoo ablate only the cells, none with ska
    base = tmp_path / "base.yaml"
    base.write_text(TINY.read_text().replace("layers: [attention, mamba2]", "layers: [attention, ska]"))
    recipe = tmp_path / "grid.yaml"
    recipe.write_text("extends: base.yaml\ngrid:\n  model.layers: [[attention, mamba2], [mamba2, mamba2]]\n")
    override = "model.mixer_options.ska.chunk_size=4"
    assert main(["check", str(recipe), override]) == 0, capsys.readouterr().err
    (note,) = capsys.readouterr().err.strip().splitlines()   # zoo check says what zoo ablate will do with it
    assert note.startswith("note:") and "zoo ablate refuses it" in note and "changes no cell of the grid" in note, note
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), override, *QUICK]) == 2
    line = _one_line(capsys)
    assert override in line and "changes no cell of the grid" in line and "ska" in line, line
    assert not out.exists()


# --------------------------------------------------------------------------------------- the output folder
@pytest.mark.parametrize("name", ["results.md", "results.jsonl", "cells.json"])
def test_a_folder_where_the_ablation_writes_a_file_is_refused_before_training(tmp_path, capsys, name):
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    assert main(["ablate", str(TINY), "--out", str(out), *QUICK]) == 2
    line = _one_line(capsys)
    assert str(out / name) in line and "is a folder" in line and "--out" in line, line
    assert not (out / "checkpoints").exists()   # refused before any cell trained


def test_a_changed_cell_is_refused_naming_both_ways_on(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", str(TINY), "--out", str(out), *QUICK]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["ablate", str(TINY), "--out", str(out), "train.lr=1e-3", *QUICK]) == 2
    line = _one_line(capsys)
    assert "train.lr: 0.003 -> 0.001" in line and "another --out" in line and "as they were" in line, line


def test_a_ray_cluster_it_cannot_reach_changes_nothing(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    new = tmp_path / "new"
    assert main(["ablate", str(TINY), "--out", str(new), "--executor", "ray", "--address", "auto", *QUICK]) == 2
    assert "cannot connect to a Ray cluster" in _one_line(capsys)
    assert not new.exists()   # no folder that would read as an ablation's (a zoo train --out there would be refused)
    # a finished ablation whose grid grew keeps its layout until the new cell can run
    recipe = _grid(tmp_path, "{label: a, train.lr: 1.0e-3}")
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), *QUICK]) == 0, capsys.readouterr().err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    recipe = _grid(tmp_path, "{label: a, train.lr: 1.0e-3}", "{label: b, train.lr: 2.0e-3}")
    assert main(["ablate", str(recipe), "--out", str(out), "--executor", "ray", "--address", "auto", *QUICK]) == 2
    assert "cannot connect to a Ray cluster" in _one_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_an_override_some_cells_replace_is_named_with_those_cells(tmp_path, capsys):
    """A command-line override that some cells set themselves does not reach them: check and ablate say which (the
    cells that take it, and the ablation, run as before)."""
    steps = int(torch.randint(3, 9, ()))
    recipe = _grid(tmp_path, "{label: takes_it}", f"{{label: own_steps, train.steps: {steps}}}",
                   "{label: also_takes_it, seed: 4}")
    assert main(["check", str(recipe), "train.steps=2"]) == 0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.startswith("note: override 'train.steps=2' does not reach 1 of the grid's 3 cells") and \
        "'own_steps' (train.steps)" in note, note
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), "train.steps=2", "train.warmup_steps=0", "--no-progress",
                 "--no-plot"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "does not reach" in line]
    assert len(notes) == 1 and notes[0].startswith("zoo ablate: note: override 'train.steps=2'"), notes
    rows = {r["label"]: r["metrics"]["steps"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert rows == {"takes_it": 2, "own_steps": steps, "also_takes_it": 2}
