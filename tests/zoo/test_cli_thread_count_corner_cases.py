"""A thread count past what torch takes (``zoo bench --threads 99999999999999999999``) or past a recipe's
``train.threads`` limit is refused in one line before anything runs, never with torch's overflow traceback."""
import random
from pathlib import Path

import pytest
import torch

from tests.zoo.cli_errors import one_line_error
from zoo.recipes import resolve
from zoo.threads import MAX_THREADS

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


def test_bench_refuses_a_thread_count_over_the_limit_and_writes_nothing(tmp_path, capsys, rng):
    before = torch.get_num_threads()
    for threads in (rng.randint(MAX_THREADS + 1, 10**6), rng.randint(2**63, 10**30)):
        out = tmp_path / f"bench{threads % 97}"
        err = one_line_error(capsys, "bench", "--threads", threads, "--seq-lens", "16", "--mixers", "attention",
                              "--repeats", "1", "--warmup", "0", "--no-plot", "--no-progress", "--out", out)
        assert f"--threads {threads}: at most {MAX_THREADS} threads" in err, err
        assert not out.exists()
    assert torch.get_num_threads() == before


def test_the_limit_is_the_one_of_a_recipes_train_threads(capsys, rng):
    assert resolve(TINY, [f"train.threads={MAX_THREADS}"]).train.threads == MAX_THREADS
    err = one_line_error(capsys, "check", TINY, f"train.threads={MAX_THREADS + rng.randint(1, 100)}")
    assert "train.threads" in err and f"<= {MAX_THREADS}" in err, err


def test_generate_refuses_a_thread_count_or_seed_out_of_range_before_loading(tmp_path, capsys, rng):
    missing = tmp_path / "no-run"       # refused before the checkpoint is looked for
    threads = rng.choice([rng.randint(MAX_THREADS + 1, 10**6), rng.randint(2**63, 10**30)])
    err = one_line_error(capsys, "generate", missing, "--threads", threads)
    assert f"--threads {threads}: must be a number of threads from 1 to {MAX_THREADS}" in err, err
    seed = rng.choice([rng.randint(2**32, 10**30), -rng.randint(1, 10**30)])
    err = one_line_error(capsys, "generate", missing, "--seed", seed)
    assert f"--seed {seed}: must be in 0 .. 2**32 - 1" in err, err
