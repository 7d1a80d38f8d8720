"""A finished run's checkpoint read again (``zoo train`` in the same folder, a ``zoo ablate`` cell whose row was
never written) trains nothing, so its timing metrics stay those the run measured: no seconds of building the
model, the test data or the evaluation are added to ``train_seconds`` or ``warmup_seconds``, and the token rates
stay as they were (zoo.training.state, zoo.training.throughput)."""
import torch

from zoo import train
from zoo.recipes import resolve
from zoo.training.checkpoint import FILENAME, load

from .test_train import TINY

TIMING = ("train_seconds", "warmup_seconds", "steady_steps", "train_tokens_per_second", "steady_tokens_per_second")


def test_reading_a_finished_run_again_keeps_its_clocks(tmp_path):
    steps = int(torch.randint(5, 9, ()))
    recipe = resolve(TINY, [f"train.steps={steps}", f"seed={int(torch.randint(0, 1000, ()))}"])
    first = train(recipe, progress=False, checkpoint_dir=tmp_path).metrics
    saved = load(tmp_path / FILENAME)
    for _ in range(2):
        again = train(recipe, progress=False, checkpoint_dir=tmp_path).metrics
        for key in TIMING:
            assert again[key] == first[key], (key, again[key], first[key])
        assert again["test_loss"] == first["test_loss"]
    rewritten = load(tmp_path / FILENAME)
    assert rewritten["elapsed"] == saved["elapsed"] and rewritten["throughput"] == saved["throughput"]
    assert rewritten["step"] == steps and rewritten["finished"]
