"""A committed table's README quotes its rows: every per-seed accuracy and every mean ± std it prints for a cell
of its results table must be what that cell's rows in ``results.jsonl`` give.

The READMEs are written by hand; a cell re-run after the README was written (new rows, same label) leaves the
README's numbers behind. This reads each README's results table (the one with a "per seed" column), finds the
rows whose first column is a cell label of the table, and recomputes per-seed values, the mean and the sample
standard deviation of ``test_accuracy`` from ``results.jsonl`` directly.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch

TABLES = Path(__file__).resolve().parents[2] / "tables"

#: tables whose README results table names its rows by the cells' labels (others rename them: echo_mask, ...)
LABELLED = ["bdlru_recall", "echo_mqar", "echo_power", "jordan_block_size", "slots_capacity", "zoology_mqar",
            "zoology_mqar_t128"]

_NUMBER = re.compile(r"\d+\.\d+")
_MEAN_STD = re.compile(r"(\d+\.\d+) ± (\d+\.\d+)")


def seed_values(table: str) -> dict[str, dict[int, float]]:
    """label -> {seed: test_accuracy}, read from the table's results.jsonl (training rows only)."""
    out: dict[str, dict[int, float]] = {}
    for line in (TABLES / table / "results.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("kind", "train") not in ("train", "") or "test_accuracy" not in row.get("metrics", {}):
            continue
        out.setdefault(row["label"], {})[row["seed"]] = row["metrics"]["test_accuracy"]
    return out


def readme_rows(table: str, labels) -> list[tuple[str, str, str]]:
    """(label, per-seed text, row text) for every row of the README's "per seed" tables that names a cell."""
    lines = (TABLES / table / "README.md").read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if not (line.startswith("|") and "per seed" in line):
            continue
        head = [c.strip() for c in line.strip().strip("|").split("|")]
        column = next(j for j, h in enumerate(head) if "per seed" in h)
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            label = cells[0].replace("*", "").replace("`", "").strip()
            if label in labels and column < len(cells):
                found.append((label, cells[column], row))
    return found


def _printed(text: str, value: float, slack_ulps: float) -> bool:
    """Whether ``text`` (a decimal as printed) is ``value`` rounded to its digits, within ``slack_ulps`` units of
    its last digit."""
    return abs(float(text) - value) <= slack_ulps * 10 ** -len(text.split(".")[1]) + 1e-12


def disagreements(table: str) -> dict[str, list[str]]:
    """label -> what its README row says that its rows do not; every label the README table names is a key."""
    values = seed_values(table)
    out: dict[str, list[str]] = {}
    for label, per_seed, row in readme_rows(table, values):
        seeds = sorted(values[label])
        accs = [values[label][s] for s in seeds]
        problems = out.setdefault(label, [])
        printed = _NUMBER.findall(per_seed.split("(")[0])
        if "every seed" in per_seed and len(printed) == 1:
            printed = printed * len(accs)
        if len(printed) != len(accs) or not all(_printed(p, v, 0.5) for p, v in zip(printed, accs)):
            problems.append(f"per seed {printed} but the rows give {[round(v, 4) for v in accs]} (seeds {seeds})")
        first = _MEAN_STD.search(row)
        if first and len(accs) > 1:
            mean, std = statistics.mean(accs), statistics.stdev(accs)
            # an error bar printed one digit up (0.00048 as 0.001) is a rounding choice, not a different number
            if not (_printed(first.group(1), mean, 0.5) and _printed(first.group(2), std, 1.0)):
                problems.append(f"{first.group(0)} but the rows give {mean:.4f} ± {std:.4f}")
    return out


@pytest.mark.parametrize("table", LABELLED)
def test_readme_seed_values_agree_with_rows(table):
    found = disagreements(table)
    assert len(found) >= 2, f"tables/{table}/README.md: its results table names {sorted(found)} cells only"
    wrong = {label: p for label, p in found.items() if p}
    assert not wrong, f"tables/{table}/README.md disagrees with its results.jsonl: {wrong}"


def test_a_changed_value_is_found(tmp_path, monkeypatch):
    """The comparison is not vacuous: a README row whose per-seed value or mean moves by one printed digit is
    caught, and the rows' own values, printed to three digits, pass."""
    table, label = "echo_mqar", "mamba2"
    values = seed_values(table)
    accs = [values[label][s] for s in sorted(values[label])]
    mean, std = statistics.mean(accs), statistics.stdev(accs)
    one = int(torch.randint(len(accs), ()))  # which seed's value the bad README moves
    per_seed = " / ".join(f"{v:.3f}" for v in accs)
    moved = " / ".join(f"{v + 0.002 * (i == one):.3f}" for i, v in enumerate(accs))
    cases = [(f"{mean:.3f} ± {std:.3f}", per_seed, True), (f"{mean:.3f} ± {std:.3f}", moved, False),
             (f"{mean + 0.002:.3f} ± {std:.3f}", per_seed, False)]
    for i, (summary, seeds_text, agrees) in enumerate(cases):
        root = tmp_path / str(i)
        (root / table).mkdir(parents=True)
        (root / table / "results.jsonl").write_text((TABLES / table / "results.jsonl").read_text())
        (root / table / "README.md").write_text(f"| cell | acc | per seed |\n|---|---|---|\n| {label} | {summary} | "
                                                f"{seeds_text} |\n")
        monkeypatch.setitem(globals(), "TABLES", root)
        problems = disagreements(table)[label]
        assert (not problems) == agrees, (summary, seeds_text, problems)
        monkeypatch.undo()
