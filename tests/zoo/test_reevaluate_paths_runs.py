"""``zoo eval`` / ``zoo.evaluate`` of small MQAR runs: accuracy at another length matches a forward pass computed by
hand, a diverged run's evaluation says where it diverged as the run's own metrics do, an ablation's folder (or its
``checkpoints`` folder) given for a checkpoint is refused naming its cells' checkpoints, and a ``TrainResult`` is
evaluated under the recipe's ``train.threads`` like a checkpoint."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

import zoo
from tests.zoo.test_training_divergence import _train_poisoned
from zoo import reevaluate
from zoo.cli import main as zoo_main
from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.tasks import Task
from zoo.training import checkpoint as ckpt

from .test_eval import TINY


def _accuracy_by_hand(run, seq_len: int) -> float:
    """Test accuracy of the checkpoint in ``run`` at ``seq_len``: its weights in a model built from its recipe, one
    forward pass over the whole test set, argmax against the supervised labels."""
    state = ckpt.load(run / ckpt.FILENAME)
    recipe = zoo.load(state["recipe"])
    assert recipe.key == state["recipe_key"]
    model = zoo.build_model(recipe)
    model.load_state_dict(state["model"])
    data = Task.from_spec(recipe.task).make("test", recipe.seed, seq_len=seq_len)
    with torch.no_grad():
        predicted = model.eval()(data.inputs, mask=data.mask).argmax(-1)
    supervised = data.labels != -100
    return ((predicted == data.labels) & supervised).sum().item() / supervised.sum().item()


def test_eval_at_another_length_is_the_accuracy_of_the_checkpoint_computed_by_hand(tmp_path):
    steps, length = random.randint(3, 8), random.randint(17, 40)
    result = zoo.train(resolve(TINY, [f"train.steps={steps}"]), progress=False, checkpoint_dir=tmp_path)
    again = zoo.evaluate(tmp_path, [f"eval.seq_lens=[{length}]"])
    assert again["test_accuracy"] == result.metrics["test_accuracy"] == pytest.approx(_accuracy_by_hand(tmp_path, 16))
    assert again[f"test_accuracy@{length}"] == pytest.approx(_accuracy_by_hand(tmp_path, length))


def test_eval_of_a_diverged_run_records_where_it_diverged_as_the_run_did(tmp_path, capsys):
    recipe = resolve(TINY, ["train.steps=10", "train.eval_every=0"])
    result, _poison = _train_poisoned(recipe, random.randint(2, 5), checkpoint_dir=tmp_path)
    assert zoo_main(["eval", str(tmp_path), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert math.isnan(metrics["test_loss"])
    for key in ("steps", "diverged_at_step"):
        assert metrics[key] == result.metrics[key]


def test_an_ablation_folder_given_to_evaluate_names_its_cells_checkpoints(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"extends: {TINY}\ntrain: {{steps: 2, warmup_steps: 0}}\n"
                    "grid:\n  - {label: only, model.layers: [mamba2]}\n")
    assert zoo_main(["ablate", str(grid), "--out", str(tmp_path / "abl"), "--no-progress"]) == 0
    capsys.readouterr()
    (key,) = [p.name for p in (tmp_path / "abl" / "checkpoints").iterdir()]
    cell = f"{tmp_path / 'abl' / 'checkpoints' / key} (only)"
    for call in (zoo.evaluate, zoo.evaluate_checkpoint):
        with pytest.raises(UserError) as refused:
            call(tmp_path / "abl")
        message = str(refused.value)
        assert "\n" not in message and "ablation" in message and cell in message, message
    # the folder of the cells' checkpoints, one level short of a cell's: named as such by the command too
    assert zoo_main(["eval", str(tmp_path / "abl" / "checkpoints")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ablation" in err and cell in err, err
    assert not (tmp_path / "abl" / "checkpoints" / "results.jsonl").exists()


def test_a_train_result_is_evaluated_under_the_recipes_thread_count(tmp_path, monkeypatch):
    result = zoo.train(resolve(TINY, ["train.steps=2"]), progress=False, checkpoint_dir=tmp_path)
    seen = []
    measure = reevaluate.test_metrics

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return measure(*args, **kwargs)

    monkeypatch.setattr(reevaluate, "test_metrics", counting)
    caller = torch.get_num_threads()
    wanted = 2 if caller == 1 else 1
    for source in (tmp_path, result):
        assert zoo.evaluate(source, [f"train.threads={wanted}"])["test_accuracy"] == result.metrics["test_accuracy"]
    assert seen == [wanted, wanted]
    assert torch.get_num_threads() == caller
