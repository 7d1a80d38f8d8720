"""Faults around re-reading a run: a checkpoint whose recipe no longer resolves to the model it trained is refused
by ``zoo export`` / ``zoo generate`` (as ``zoo eval`` refuses it) instead of exporting another model; a run folder
whose name ends in ``.pt`` is read as a folder; ``imports=<one name>`` for ``zoo eval`` imports nothing but the
named module; an evaluation at another length keeps the steps a token budget trained. Tiny models; nothing
downloads."""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

import zoo
from mixers import MIXERS
from zoo.cli import main as zoo_main
from zoo.errors import UserError
from zoo.generate import load_lm
from zoo.recipes.plain import recipe_mapping
from zoo.rows import read_rows
from zoo.training import checkpoint as ckpt
from zoo.training.evaluation import evaluate_data

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _lm_recipe():
    return zoo.load({"model": {"d_model": 16, "layers": ["attention"], "mixer_options": {"attention": {"n_heads": 2}}},
                     "task": {"name": "lm", "seq_len": 16}, "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})


def _write(folder, recipe, model):
    ckpt.save(folder / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                       "model": model.state_dict(), "step": 1, "finished": True})


def _change_default(monkeypatch, mixer: str, option: str, value) -> None:
    """What a later release that changes the default of ``mixer``'s ``option`` does to a stored recipe."""
    options = MIXERS.get(mixer).Options
    names = [f.name for f in dataclasses.fields(options) if f.init]
    defaults = list(options.__init__.__defaults__)
    defaults[names.index(option) - (len(names) - len(defaults))] = value
    monkeypatch.setattr(options.__init__, "__defaults__", tuple(defaults))


def test_export_and_generate_refuse_a_checkpoint_whose_recipe_now_builds_another_model(tmp_path, monkeypatch, capsys):
    recipe = _lm_recipe()
    model = zoo.build_model(recipe)
    _write(tmp_path / "run", recipe, model)
    ids = torch.randint(0, 257, (2, int(torch.randint(4, 16, ()))))
    with torch.no_grad():
        trained = model(ids)
    base = float(torch.randint(20, 2000, ()))
    _change_default(monkeypatch, "attention", "rope_base", base)
    rebuilt = zoo.load(recipe_mapping(recipe.plain))
    assert rebuilt.key != recipe.key and rebuilt.layers[0].options.rope_base == base
    rebuilt_model = zoo.build_model(rebuilt)
    rebuilt_model.load_state_dict(model.state_dict())  # same weights, another computation: the numbers move
    with torch.no_grad():
        assert (rebuilt_model(ids) - trained).abs().max() > 1e-4

    with pytest.raises(UserError, match="no longer resolves to the key it was trained under"):
        zoo.evaluate_checkpoint(tmp_path / "run")  # zoo eval refuses it ...
    with pytest.raises(UserError, match="no longer resolves to the key it was trained under"):
        load_lm(tmp_path / "run")  # ... and so do zoo generate and the harness adapter
    capsys.readouterr()
    assert zoo_main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no longer resolves to the key it was trained under" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_a_run_folder_named_like_a_file_is_read_as_a_folder(tmp_path, capsys):
    recipe = zoo.load(TINY, ["train.steps=2", "task.num_test=16"])
    model = zoo.build_model(recipe)
    folder = tmp_path / f"run v{int(torch.randint(1, 99, ()))}.pt"  # zoo train --out 'run v3.pt' writes here
    _write(folder, recipe, model)
    assert zoo.load_checkpoint(folder)["recipe_key"] == recipe.key
    assert zoo_main(["eval", str(folder), "--json"]) == 0
    capsys.readouterr()
    data = zoo.build_task(recipe).make("test", recipe.seed)
    expected = evaluate_data(model.eval(), data, recipe.eval.batch_size, torch.device("cpu"))
    metrics = zoo.evaluate(folder)
    assert metrics["test_accuracy"] == expected["accuracy"] and metrics["test_loss"] == expected["loss"]
    assert (folder / "results.jsonl").exists()


def test_eval_with_one_module_named_as_a_string_imports_nothing_else(tmp_path, monkeypatch):
    recipe = zoo.load(TINY, ["train.steps=2", "task.num_test=16"])
    _write(tmp_path / "run", recipe, zoo.build_model(recipe))
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with pytest.raises(UserError, match="imports") as err:
        zoo.evaluate_checkpoint(tmp_path / "run", ["imports=json"])
    assert "expected a list of module names" in str(err.value)
    assert imported in ([], ["json"]), imported  # never the letters of the name, one module each


def test_eval_at_another_length_keeps_the_steps_a_token_budget_trained(tmp_path):
    """A run trained on ``train.tokens`` derived its steps from its own sequence length; evaluating its checkpoint
    at a longer ``task.seq_len`` must neither derive another step count (the row's ``steps`` and the unfinished-run
    line read it) nor refuse the evaluation over a warm-up longer than that count."""
    steps = int(torch.randint(3, 6, ()))
    tokens = steps * 16 * 16   # batch 16 x seq_len 16
    out = tmp_path / "run"
    assert zoo_main(["train", str(TINY), "--out", str(out), "--no-progress", f"train.tokens={tokens}",
                     "train.warmup_steps=2"]) == 0
    trained = ckpt.load(out / ckpt.FILENAME)
    assert trained["step"] == steps
    assert zoo_main(["eval", str(out), "--out", str(tmp_path / "eval"), "task.seq_len=64"]) == 0
    (row,) = read_rows(tmp_path / "eval" / "results.jsonl")
    assert row["metrics"]["steps"] == steps and row["recipe"]["train"]["steps"] == steps
    assert row["recipe"]["task"]["seq_len"] == 64
