"""A checkpoint given where a recipe is read, or a recipe or results file given where a checkpoint is read, is
refused in one line naming what the file is and what to give instead, and nothing is written. Before, a checkpoint
read as a recipe was "not UTF-8 text; save the recipe as UTF-8", and a text file read as a checkpoint was "not a
readable mixer-zoo checkpoint (UnpicklingError ...); the file is damaged": neither named the mix-up."""
from __future__ import annotations

from pathlib import Path

import pytest

from zoo.cli import main

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A folder that ``zoo train --out`` wrote: checkpoint.pt and results.jsonl."""
    folder = tmp_path_factory.mktemp("run")
    assert main(["train", str(TINY), "--out", str(folder), "--no-progress", "train.steps=2"]) == 0
    return folder


def _refusal(capsys, *args: str) -> str:
    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _contents(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["check", "train", "ablate"])
def test_a_checkpoint_given_for_a_recipe_names_the_mix_up(run, capsys, command):
    before = _contents(run)
    checkpoint = run / "checkpoint.pt"
    err = _refusal(capsys, command, str(checkpoint), "--no-progress" if command != "check" else "train.steps=2")
    assert f"{checkpoint} is a checkpoint" in err and "not a YAML recipe" in err, err
    assert f"zoo eval {checkpoint}" in err and f"--out {run}" in err, err
    assert _contents(run) == before


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_results_rows_given_for_a_checkpoint_name_the_checkpoint_beside_them(run, capsys, command):
    before = _contents(run)
    rows = run / "results.jsonl"
    err = _refusal(capsys, command, str(rows))
    assert f"{rows} is a text file, not a checkpoint; give {run / 'checkpoint.pt'}" in err, err
    assert _contents(run) == before   # no row appended


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_a_recipe_given_for_a_checkpoint_says_to_train_it_first(tmp_path, capsys, command):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY.read_text())
    err = _refusal(capsys, command, str(recipe), *(["--to", str(tmp_path / "exported")] if command == "export" else []))
    assert f"{recipe} is a recipe, not a checkpoint; train it first (zoo train {recipe} --out DIR)" in err, err
    assert sorted(tmp_path.iterdir()) == [recipe]


def test_a_damaged_checkpoint_is_still_reported_as_damaged(tmp_path, capsys):
    damaged = tmp_path / "checkpoint.pt"
    damaged.write_text("garbage\n")
    err = _refusal(capsys, "eval", str(damaged))
    assert "not a readable mixer-zoo checkpoint" in err and "damaged" in err, err
