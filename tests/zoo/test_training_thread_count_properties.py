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


@pytest.fixture
def before():
    """The caller's thread count, set back after the test whatever it left."""
    count = torch.get_num_threads()
    yield count
    torch.set_num_threads(count)


def _other_count(before: int) -> int:
    return before + 1 + int(torch.randint(0, 3, ()))


def _threads_seen(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` so that each call records the torch thread count it ran with."""
    seen, real = [], getattr(module, name)

    def recorded(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, recorded)
    return seen


def test_training_runs_with_the_recipe_threads_and_gives_the_callers_count_back(tmp_path, monkeypatch, before):
    threads = _other_count(before)
    seen = _threads_seen(monkeypatch, loop, "_step")
    result = zoo.train(resolve(TINY, [f"train.threads={threads}", "train.steps=2"]), progress=False,
                       checkpoint_dir=tmp_path / "run")
    assert seen == [threads, threads] and result.metrics["steps"] == 2
    assert torch.get_num_threads() == before
    # evaluating the checkpoint with another count: the same rule
    other = _other_count(before)
    evaluated = _threads_seen(monkeypatch, reevaluate, "test_metrics")
    row = zoo.evaluate_checkpoint(tmp_path / "run", [f"train.threads={other}"])
    assert evaluated == [other] and row["metrics"]["steps"] == 2
    assert torch.get_num_threads() == before


def test_a_failed_training_gives_the_callers_thread_count_back(monkeypatch, before):
    threads = _other_count(before)

    def step(*args, **kwargs):
        assert torch.get_num_threads() == threads
        raise RuntimeError("diverged")
    monkeypatch.setattr(loop, "_step", step)
    with pytest.raises(RuntimeError, match="diverged"):
        zoo.train(resolve(TINY, [f"train.threads={threads}"]), progress=False)
    assert torch.get_num_threads() == before
