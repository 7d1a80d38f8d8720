"""Grid cell labels holding a ``|`` or a line break (``mamba2|attn``): every row of results.md's tables keeps
its columns, and results.csv keeps the labels as written."""
import csv
import random
import re
import string
from pathlib import Path

import pytest
import yaml

from zoo.cli import main

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
FAST = ["train.steps=2", "train.warmup_steps=0", "task.num_test=16", "--no-plot", "--no-progress"]
UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


def _label(rng: random.Random, breaks: str) -> str:
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 5))) for _ in range(3)]
    return words[0] + rng.choice(breaks) + words[1] + rng.choice(["|", " | ", "||"]) + words[2]


def _table_lines(text: str) -> list[list[str]]:
    """The lines of each markdown table in ``text``, one list per table."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def test_labels_with_pipes_and_line_breaks_keep_every_markdown_row_whole(tmp_path, rng):
    labels = [_label(rng, "|"), _label(rng, "\n\r")]
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(yaml.safe_dump({"extends": str(TINY), "seeds": [0, 1],
                                      "grid": [{"label": label, "train.lr": lr}
                                               for label, lr in zip(labels, (1e-3, 2e-3))]}))
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), *FAST]) == 0
    tables = _table_lines((out / "results.md").read_text())
    assert len(tables) == 2  # the seed summary, then the rows per seed
    for lines in tables:
        widths = {len(UNESCAPED_PIPE.findall(line)) for line in lines}
        assert len(widths) == 1, lines
    with open(out / "results.csv", newline="") as fh:
        assert {row["cell"] for row in csv.DictReader(fh)} == set(labels)
