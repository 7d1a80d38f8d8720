"""Task definitions against what a recipe is allowed to ask of them: every length a task's generator
refuses is refused when the recipe is validated (``Task.check_length``), not after training."""
from pathlib import Path

import pytest

from mixers.options import build_options
from zoo import resolve
from zoo.tasks import TASKS

TINY = Path(__file__).resolve().parent / "recipes" / "tiny.yaml"

# (task, its options, lengths its generator refuses, lengths it draws)
LENGTH_RULES = [
    ("assoc_recall", {"seq_len": 20}, [1, 2, 3], [4, 5, 41]),
    ("dyck1_next", {"seq_len": 20}, [1, 3, 41], [2, 4, 42]),
    ("mad_recall", {"seq_len": 32}, [1, 2, 3, 5, 63], [4, 6, 64]),
]


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


@pytest.mark.parametrize("name,options,refused,drawn", LENGTH_RULES)
def test_check_length_refuses_exactly_the_lengths_the_generator_refuses(name, options, refused, drawn):
    task = make(name, **options)
    for length in refused:
        with pytest.raises(ValueError, match="seq_len"):
            task.make("test", 0, seq_len=length, num_examples=2)
        with pytest.raises(ValueError, match="seq_len"):
            task.check_length(length)
    for length in drawn:
        task.check_length(length)
        assert task.make("test", 0, seq_len=length, num_examples=2).inputs.shape == (2, length)


@pytest.mark.parametrize("name,options,refused,drawn", LENGTH_RULES)
def test_a_recipe_testing_at_a_length_the_task_cannot_draw_is_refused(name, options, refused, drawn):
    task = [f"task={{name: {name}, seq_len: {options['seq_len']}, num_train: 64, num_test: 16}}"]
    resolve(TINY, task + [f"eval.seq_lens=[{drawn[-1]}]"])
    with pytest.raises(Exception, match="eval.seq_lens"):
        resolve(TINY, task + [f"eval.seq_lens=[{refused[-1]}]"])
