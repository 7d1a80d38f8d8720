"""``zoo claims --check`` finds a table whose rendered results.md or results.csv no longer matches its
results.jsonl: rows re-run (or a seed added) without rendering the table again, or a rendered number edited by
hand. Before, the check compared only the ledger's own files, so the numbers researchers read in a table's
results.md could differ from the rows the ledger judged while the check passed."""
import json
import random
from pathlib import Path

import yaml

from zoo.cli import main
from zoo.experiments.claims import ledger
from zoo.experiments.results import LAYOUT_NAME, render_folder

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _row(label, seed, acc):
    return {"recipe_key": f"{label}-{seed}", "label": label, "seed": seed,
            "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 16}},
            "metrics": {"test_accuracy": acc, "params": 10, "state_size": 4, "steps": 10, "train_seconds": 1.0},
            "step0_metrics": {"test_accuracy": 0.25, "steps": 10}}


def _root(tmp_path: Path, layout: bool) -> Path:
    """A repository with one table ``t`` (two cells of three seeds), its ledger written and its table rendered."""
    root = tmp_path / "repo"
    folder = root / "tables" / "t"
    folder.mkdir(parents=True)
    (root / "recipes").mkdir()
    grid = [{"label": label, "train.lr": 1e-3 * (i + 1)} for i, label in enumerate("ab")]
    (root / "recipes" / "t.yaml").write_text(yaml.safe_dump(yaml.safe_load(TINY.read_text())
                                                            | {"grid": grid, "seeds": [0, 1, 2]}))
    rows = [_row(label, seed, random.uniform(lo, hi)) for label, lo, hi in (("a", 0.8, 0.99), ("b", 0.3, 0.5))
            for seed in range(3)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if layout:
        (folder / LAYOUT_NAME).write_text(json.dumps({"title": "t", "cells": [{"key": r["recipe_key"],
                                                                               "label": r["label"]} for r in rows]}))
    spec = {"id": "c", "paper": "p", "claim": "a beats b", "paper_result": "a 0.9, b 0.4", "source": "made up",
            "table": "t", "cells": {"a": "a", "b": "b"}, "show": ["a.test_accuracy"],
            "rule": {"reproduced": ["a.test_accuracy >= b.test_accuracy + 0.2"]}}
    data = {"papers": {"p": {"title": "A paper", "id": "arXiv 0000.00000"}},
            "tables": {"t": {"recipe": "recipes/t.yaml", "no_learning": {"*": {"test_accuracy": 0.25}}}},
            "claims": [spec]}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    render_folder(folder, title="my table", plot=False)
    ledger.write(root)
    return root


def _rewrite_rows(root: Path, change) -> None:
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    change(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ledger.write(root)  # the ledger follows the rows: only the table's rendering is stale


def test_a_rerun_row_without_rendering_again_fails_the_check(tmp_path, capsys):
    for layout in (False, True):
        root = _root(tmp_path / str(layout), layout)
        assert ledger.check(root) == []
        seed = random.randrange(3)

        def rerun(rows):
            rows[seed]["metrics"]["test_accuracy"] += random.uniform(0.001, 0.01)   # cell a's seed, run again
        _rewrite_rows(root, rerun)
        problems = ledger.check(root)
        assert any(p.startswith("tables/t/results.md does not match its results.jsonl") for p in problems), problems
        assert any(p.startswith("tables/t/results.csv does not match its results.jsonl") for p in problems), problems
        assert main(["claims", "--check", "--root", str(root)]) == 1
        assert "zoo table tables/t" in capsys.readouterr().err
        render_folder(root / "tables" / "t", title="another title", plot=False)  # the title is free
        assert ledger.check(root) == []


def test_a_hand_edited_number_in_results_md_fails_the_check(tmp_path):
    root = _root(tmp_path, True)
    path = root / "tables" / "t" / "results.md"
    lines = path.read_text().splitlines()
    at = max(i for i, line in enumerate(lines) if line.startswith("| a "))   # a per-seed row of cell a
    cells = lines[at].split("|")
    number = cells[3].strip()                                                 # its test_accuracy, as rendered
    edited = number[:-1] + str((int(number[-1]) + 1) % 10)                    # one digit changed
    cells[3] = cells[3].replace(number, edited)
    lines[at] = "|".join(cells)
    path.write_text("\n".join(lines) + "\n")
    problems = ledger.check(root)
    assert len(problems) == 1 and problems[0].startswith("tables/t/results.md does not match"), problems
    assert edited in problems[0] or number in problems[0]
