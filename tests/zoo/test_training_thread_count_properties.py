"""A recipe's ``train.threads`` holds for its own training and evaluation only: ``zoo.train`` and
``zoo.evaluate_checkpoint`` run with it and give the caller's thread count back after them, also when they fail."""
from pathlib import Path

import pytest
import torch

import zoo
from zoo import reevaluate
from zoo.recipes import resolve
from zoo.training import loop

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _other_count(before: int) -> int:
    return before + 1 + int(torch.randint(0, 3, ()))


def test_training_runs_with_the_recipe_threads_and_gives_the_callers_count_back(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    threads = _other_count(before)
    seen = []
    real_step = loop._step

    def step(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_step(*args, **kwargs)
    monkeypatch.setattr(loop, "_step", step)
    try:
        result = zoo.train(resolve(TINY, [f"train.threads={threads}", "train.steps=2"]), progress=False,
                           checkpoint_dir=tmp_path / "run")
        assert seen == [threads, threads] and result.metrics["steps"] == 2
        assert torch.get_num_threads() == before
        # evaluating the checkpoint with another count: the same rule
        other = _other_count(before)
        evaluated = []
        real_metrics = reevaluate.test_metrics

        def test_metrics(*args, **kwargs):
            evaluated.append(torch.get_num_threads())
            return real_metrics(*args, **kwargs)
        monkeypatch.setattr(reevaluate, "test_metrics", test_metrics)
        row = zoo.evaluate_checkpoint(tmp_path / "run", [f"train.threads={other}"])
        assert evaluated == [other] and row["metrics"]["steps"] == 2
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_failed_training_gives_the_callers_thread_count_back(monkeypatch):
    before = torch.get_num_threads()
    threads = _other_count(before)

    def step(*args, **kwargs):
        assert torch.get_num_threads() == threads
        raise RuntimeError("diverged")
    monkeypatch.setattr(loop, "_step", step)
    try:
        with pytest.raises(RuntimeError, match="diverged"):
            zoo.train(resolve(TINY, [f"train.threads={threads}"]), progress=False)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
