"""Training: reproducible on a CPU, learns, and the one-line swap trains the swapped model."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from zoo.recipes import resolve
from zoo.train import lr_at, train

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_same_seed_same_numbers():
    recipe = resolve(TINY)
    a, b = train(recipe, progress=False).metrics, train(recipe, progress=False).metrics
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert a[key] == b[key], key
    other = resolve(TINY, ["seed=4"])
    assert train(other, progress=False).metrics["test_loss"] != a["test_loss"]


def test_loss_decreases():
    recipe = resolve(TINY, ["train.steps=40", "train.eval_every=0", "model.layers=[attention]"])
    before = resolve(TINY, ["train.steps=1", "model.layers=[attention]"])
    assert train(recipe, progress=False).metrics["test_loss"] < train(before, progress=False).metrics["test_loss"] - 0.2


def test_schedule_warms_up_then_decays_to_the_floor():
    recipe = resolve(TINY, ["train.steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"])
    lrs = [lr_at(s, recipe) for s in range(100)]
    assert lrs[0] == 0.1 and abs(lrs[9] - 1.0) < 1e-12
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert abs(lr_at(100, recipe) - 0.1) < 1e-12


def test_one_line_swap_on_the_command_line():
    result = subprocess.run([sys.executable, "-m", "zoo", "train", str(TINY), "--json", "--no-progress",
                             "model.layers.1=attention"], capture_output=True, text=True)  # overrides after flags
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # --json prints nothing but the JSON
    assert out["recipe"]["model"]["layers"] == ["attention", "attention"]
    assert 0.0 <= out["metrics"]["test_accuracy"] <= 1.0


def test_test_time_sweep_evaluates_one_trained_model_at_several_knob_values():
    recipe = resolve(TINY, ["model.layers=[gka]", "model.mixer_options={gka: {n_heads: 2, chunk_size: 8}}",
                            "train.steps=3", "eval.test_time_sweep={num_iter: [0, 2, 30]}"])
    result = train(recipe, progress=False)
    m = result.metrics
    assert {"test_accuracy@num_iter=0", "test_accuracy@num_iter=2", "test_accuracy@num_iter=30"} <= set(m)
    gka = result.model.blocks[0].mixer
    assert gka._test_time == {} and gka.options.num_iter == 30, "the sweep must restore the mixer's own setting"
    from zoo.train import build_task, evaluate
    data = build_task(recipe).make("test", recipe.seed)
    with result.model.test_time({"num_iter": 2}):
        assert evaluate(result.model, data, 128, torch.device("cpu"))["accuracy"] == m["test_accuracy@num_iter=2"]
    # and the knob really changes the computation: no iterations is gated linear attention
    x = torch.randn(1, 12, 32)
    gka.eval()
    with result.model.test_time({"num_iter": 0}):
        y0 = gka(x)
    with result.model.test_time({"num_iter": 30}):
        y30 = gka(x)
    assert not torch.allclose(y0, y30)
    # training ignores evaluation overrides: the knob is a test-time setting only
    gka.train()
    with result.model.test_time({"num_iter": 0}):
        assert torch.allclose(gka(x), gka(x)) and gka.knob("num_iter") == 30


def test_a_knob_no_mixer_declares_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "zoo", "check", str(TINY), "eval.test_time={num_iters: 3}"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean 'num_iter'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
