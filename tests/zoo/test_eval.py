"""`zoo eval`: a checkpoint re-evaluates to exactly the accuracy recorded at the end of training, adds
rows for other lengths and test data, and refuses overrides that would change the trained model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo import build_task, train
from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.training.evaluation import evaluate_data as evaluate

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]


def _zoo(*args):
    return subprocess.run([sys.executable, "-m", "zoo", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)


def test_eval_reproduces_training_exactly_and_adds_a_longer_length(tmp_path):
    recipe = resolve(TINY, ["train.steps=8"])
    result = train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    run = _zoo("eval", tmp_path / "run", "eval.seq_lens=[24]", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)  # --json: nothing but JSON on stdout
    m = out["metrics"]
    for key in ("test_loss", "test_accuracy", "test_sequence_accuracy", "params", "state_size"):
        assert m[key] == result.metrics[key], key
    data = build_task(recipe).make("test", recipe.seed, seq_len=24)  # independent: the in-memory model
    expected = evaluate(result.model, data, recipe.eval.batch_size, torch.device("cpu"))
    assert m["test_accuracy@24"] == expected["accuracy"]
    assert out["trained_recipe_key"] == recipe.key and out["recipe_key"] != recipe.key
    row = json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[-1])
    assert row["label"] == "eval eval.seq_lens=[24]" and row["metrics"] == m
    assert row["recipe"]["eval"]["seq_lens"] == [24] and "torch" in row["versions"]

    # other test data (seed) and other test-set size are legal and change the numbers' basis
    other = zoo.evaluate(tmp_path / "run", ["seed=11", "task.num_test=40"])
    data = build_task(resolve(TINY, ["task.num_test=40"])).make("test", 11)
    assert other["test_accuracy"] == evaluate(result.model, data, 128, torch.device("cpu"))["accuracy"]
    # the Python API evaluates the in-memory result the same way
    assert zoo.evaluate(result)["test_accuracy"] == result.metrics["test_accuracy"]


def test_eval_refuses_overrides_that_change_the_model(tmp_path):
    train(resolve(TINY, ["train.steps=2"]), progress=False, checkpoint_dir=tmp_path)
    run = _zoo("eval", tmp_path, "model.d_model=16")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "would change the trained model" in run.stderr
    for bad, why in [("train.lr=1e-2", "would change the trained model"),
                     ("task.name=parity", "would change the trained model"),
                     ("task.vocab_size=64", "vocabulary from 32 to 64")]:
        with pytest.raises(UserError, match=why):
            zoo.evaluate(tmp_path, [bad])
    assert not (tmp_path / "results.jsonl").exists()


def test_eval_imports_no_module_named_only_by_the_checkpoint(tmp_path):
    recipe = resolve(TINY, ["train.steps=2", "imports=[tests.zoo.out_of_tree_mixer]",
                            "model.layers=[cumulative_mean]"])
    train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    refused = _zoo("eval", tmp_path / "run")
    assert refused.returncode == 2 and "imports=[tests.zoo.out_of_tree_mixer]" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    named = _zoo("eval", tmp_path / "run", "imports=[tests.zoo.out_of_tree_mixer]", "--json")
    assert named.returncode == 0, named.stderr


def test_eval_of_an_unfinished_run_says_so_on_stderr(tmp_path, capsys):
    from zoo.cli import main
    from zoo.training import checkpoint as ckpt
    train(resolve(TINY, ["train.steps=3"]), progress=False, checkpoint_dir=tmp_path / "done")
    state = ckpt.load(tmp_path / "done" / ckpt.FILENAME)
    state.update(step=2, finished=False)  # as an interrupted run leaves it: step 2 of 3
    ckpt.save(tmp_path / "cut" / ckpt.FILENAME, state)
    assert main(["eval", str(tmp_path / "cut"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["metrics"]["steps"] == 2
    assert f"{tmp_path / 'cut' / ckpt.FILENAME} is the checkpoint of an unfinished run (step 2 of 3)" in captured.err
    assert main(["eval", str(tmp_path / "done"), "--json"]) == 0
    assert "unfinished" not in capsys.readouterr().err


def test_eval_takes_another_kernel_backend_and_nothing_else_of_the_model(tmp_path):
    """A mixer's backend computes the same function with the same weights: a checkpoint trained with one evaluates
    with another (a GPU run's ``backend: triton`` on a CPU, here the reverse through the interpreter) to the numbers
    of the backend it was trained with; no other model option passes, and a run's in-memory model is not rebuilt."""
    recipe = resolve(TINY, ["train.steps=3", "model.mixer_options.mamba2.backend=torch"])
    result = train(recipe, progress=False, checkpoint_dir=tmp_path)
    other = "model.mixer_options.mamba2.backend=triton"
    row = zoo.evaluate(tmp_path, [other])
    assert row["test_loss"] == pytest.approx(result.metrics["test_loss"], rel=1e-5, abs=1e-6)
    built = []
    real = zoo.reevaluate.load_model

    def spy(state, recipe, device, path):
        built.append(recipe)
        return real(state, recipe, device, path)

    layer = f"model.layers.1.mamba2.backend={'triton' if int(torch.randint(0, 2, ())) else 'torch'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zoo.reevaluate, "load_model", spy)
        zoo.evaluate(tmp_path, [layer])
    assert built[0].layers[1].options.backend == layer.rsplit("=", 1)[1]
    for bad in ("model.mixer_options.mamba2.d_state=4", "model.layers.1.mamba2.chunk_size=4"):
        with pytest.raises(UserError, match="would change the trained model"):
            zoo.evaluate(tmp_path, [bad])
    with pytest.raises(UserError, match="pass its checkpoint path"):
        zoo.evaluate(result, [other])
