"""Training: reproducible on a CPU, learns, and the one-line swap trains the swapped model."""
import json
import subprocess
import sys
from pathlib import Path

from zoo.recipes import load_recipe
from zoo.train import lr_at, train

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_same_seed_same_numbers():
    recipe, _ = load_recipe(TINY)
    a, b = train(recipe, progress=False).metrics, train(recipe, progress=False).metrics
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert a[key] == b[key], key
    other, _ = load_recipe(TINY, ["seed=4"])
    assert train(other, progress=False).metrics["test_loss"] != a["test_loss"]


def test_loss_decreases():
    recipe, _ = load_recipe(TINY, ["train.steps=40", "train.eval_every=0", "model.layers=[attention]"])
    before, _ = load_recipe(TINY, ["train.steps=1", "model.layers=[attention]"])
    assert train(recipe, progress=False).metrics["test_loss"] < train(before, progress=False).metrics["test_loss"] - 0.2


def test_schedule_warms_up_then_decays_to_the_floor():
    recipe, _ = load_recipe(TINY, ["train.steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"])
    lrs = [lr_at(s, recipe) for s in range(100)]
    assert lrs[0] == 0.1 and abs(lrs[9] - 1.0) < 1e-12
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert abs(lr_at(100, recipe) - 0.1) < 1e-12


def test_one_line_swap_on_the_command_line():
    result = subprocess.run([sys.executable, "-m", "zoo", "train", str(TINY), "model.layers.1=attention", "--json",
                             "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout[result.stdout.index("{"):])
    assert out["recipe"]["model"]["layers"] == ["attention", "attention"]
    assert 0.0 <= out["metrics"]["test_accuracy"] <= 1.0
