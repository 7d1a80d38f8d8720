"""The claims ledger read against the committed rows it rests on, as a reader would check it by hand.

Every number CLAIMS.md prints in a claim's cell table (mean, sample standard deviation, min-max, every seed) is
recomputed here from ``tables/<table>/results.jsonl`` with the statistics module; the verdicts of four claims
of different kinds are worked out here from their rules and the tables' no-learning levels; every quoted
sentence names its paper by title and id; and a committed row's recorded overrides, given to its table's
recipe as a reader would type them after ``zoo train``, resolve to that row's recipe.
"""
import json
import math
import re
import statistics
from pathlib import Path

import pytest
import yaml

from zoo.api import load as load_recipe
from zoo.recipes.grids import cell_of

ROOT = Path(__file__).resolve().parents[2]
LEDGER = (ROOT / "CLAIMS.md").read_text()
SPEC = yaml.safe_load((ROOT / "claims.yaml").read_text())
CLAIMS = {c["id"]: c for c in SPEC["claims"]}


def _rows(table: str) -> list[dict]:
    path = ROOT / "tables" / table / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(table: str, label: str) -> dict[int, dict]:
    """seed -> metrics of the rows labelled ``label`` (a ``seed=N`` word in a label names a seed of the cell)."""
    out = {}
    for row in _rows(table):
        if cell_of(row["label"]) == label:
            assert row["seed"] not in out, f"{table}: two rows of {label!r} at seed {row['seed']}"
            out[row["seed"]] = row["metrics"]
    return out


def _values(table: str, label: str, metric: str) -> list[float]:
    cell = _cell(table, label)
    return [float(cell[s][metric]) for s in sorted(cell)]


def _section(claim_id: str) -> str:
    match = re.search(rf"^### \d+\. `{re.escape(claim_id)}`:.*?(?=^### |\Z)", LEDGER, re.M | re.S)
    assert match, f"CLAIMS.md has no section for {claim_id}"
    return match.group(0)


def _verdict(claim_id: str) -> str:
    return re.search(r"^- Verdict: \*\*(.*?)\*\*", _section(claim_id), re.M).group(1)


def _close(printed: str, value: float) -> bool:
    """``printed`` (three decimals, or ``nan`` for a diverged seed) is ``value`` rounded, allowing for a tie rounded
    either way."""
    number = float(printed)
    if math.isnan(value) or math.isnan(number):
        return math.isnan(value) and math.isnan(number)
    return number == value or abs(number - value) <= 0.0005 + 1e-9


def _detail_rows():
    """(claim id, table, label, seeds, metric, 'mean ± std', 'min-max', 'v0, v1, ...') of every judged claim."""
    out = []
    for claim in SPEC["claims"]:
        if "table" not in claim or "pending" in claim or "unit_test" in claim:
            continue
        for line in _section(claim["id"]).splitlines():
            parts = [p.strip() for p in line.strip().strip("|").split("|")]
            if len(parts) == 7 and " ± " in parts[4] and parts[0] != "cell":
                out.append((claim["id"], claim["table"], *parts[1:]))
    return out


DETAILS = _detail_rows()


def test_the_ledger_prints_cell_tables_for_the_judged_claims():
    judged = {c["id"] for c in SPEC["claims"] if c.get("table") and not SPEC["tables"][c["table"]].get("awaiting_rows")
              and "pending" not in c and "unit_test" not in c}
    assert judged <= {d[0] for d in DETAILS}
    assert len(DETAILS) >= 60


@pytest.mark.parametrize("claim_id,table,label,seeds,metric,mean_std,span,per_seed", DETAILS,
                         ids=[f"{d[0]}:{d[2]}:{d[4]}" for d in DETAILS])
def test_each_printed_number_is_the_statistic_of_its_committed_rows(claim_id, table, label, seeds, metric, mean_std,
                                                                    span, per_seed):
    cell = _cell(table, label)
    assert [int(s) for s in seeds.split(", ")] == sorted(cell)
    values = [math.nan if cell[s][metric] is None else float(cell[s][metric]) for s in sorted(cell)]
    mean, std = (p.strip() for p in mean_std.split("±"))
    low, high = span.split("-")
    if any(math.isnan(v) for v in values):   # a diverged seed: no mean, spread or range, as the ledger says
        assert (mean, std, low, high) == ("nan",) * 4, (mean_std, span, values)
    else:
        assert _close(mean, statistics.mean(values)), (mean, values)
        assert _close(std, statistics.stdev(values)), (std, values)
        assert _close(low, min(values)) and _close(high, max(values))
    printed = [float(v) for v in per_seed.split(", ")]
    assert len(printed) == len(values) and all(_close(str(p), v) for p, v in zip(printed, values))


def _learned(table: str, label: str, metric: str) -> list[bool]:
    """Per seed: past the table's no-learning level by 0.05 (below it, for bits per byte and losses)."""
    levels = SPEC["tables"][table]["no_learning"]
    level = levels.get(label, levels["*"])[metric]
    cost = metric.startswith(("val_bpb", "test_loss", "val_loss"))
    return [(v < level - 0.05) if cost else (v > level + 0.05) for v in _values(table, label, metric)]


def _mean(table, label, metric):
    return statistics.mean(_values(table, label, metric))


def test_a_supported_claim_holds_on_its_rows():
    """echo-mqar-attention: the three judged grid cells at least 0.95 on the mean, every seed learned."""
    claim = CLAIMS["echo-mqar-attention"]
    assert claim["rule"]["reproduced"] == ["p4t32.test_accuracy >= 0.95", "p4t128.test_accuracy >= 0.95",
                                           "p8t32.test_accuracy >= 0.95"]
    for short in ("p4t32", "p4t128", "p8t32"):
        label = claim["cells"][short]
        assert _mean("echo_mqar_grid", label, "test_accuracy") >= 0.95
        assert all(_learned("echo_mqar_grid", label, "test_accuracy"))
    assert _verdict("echo-mqar-attention").startswith("reproduced")


def test_a_refuted_claim_fails_both_its_conditions_on_its_rows():
    """gka-vs-gla: GLA learned on every seed; neither GKA cell is 0.05 above it."""
    claim = CLAIMS["gka-vs-gla"]
    assert claim["rule"] == {"reproduced": ["gka.test_accuracy >= gla.test_accuracy + 0.05"],
                             "partly": ["plain.test_accuracy >= gla.test_accuracy + 0.05"]}
    gla = claim["cells"]["gla"]
    assert all(_learned("gka_budget", gla, "test_accuracy"))
    bar = _mean("gka_budget", gla, "test_accuracy") + 0.05
    assert _mean("gka_budget", claim["cells"]["gka"], "test_accuracy") < bar
    assert _mean("gka_budget", claim["cells"]["plain"], "test_accuracy") < bar
    assert _verdict("gka-vs-gla").startswith("not reproduced")
    assert "inconclusive" not in _verdict("gka-vs-gla")


def test_a_language_model_verdict_is_decided_by_its_conclusive_condition():
    """echo-lm-bytes: the comparison with attention reads a seed that did not learn (inconclusive), the one with
    Mamba-2 + attention fails on learned cells, and it is both the reproduced and the partly condition."""
    claim = CLAIMS["echo-lm-bytes"]
    cells = claim["cells"]
    assert claim["rule"]["partly"] == ["echo.val_bpb <= m2attn.val_bpb + 0.02"]
    assert "echo.val_bpb <= m2attn.val_bpb + 0.02" in claim["rule"]["reproduced"]
    for short in ("echo", "m2attn"):
        assert all(_learned("lm_bytes", cells[short], "val_bpb"))
        assert all(_learned("lm_bytes", cells[short], "test_accuracy"))
    assert not all(_learned("lm_bytes", cells["attention"], "test_accuracy"))
    assert _mean("lm_bytes", cells["echo"], "val_bpb") > _mean("lm_bytes", cells["m2attn"], "val_bpb") + 0.02
    verdict = _verdict("echo-lm-bytes")
    assert verdict.startswith("not reproduced") and "inconclusive" not in verdict


def test_a_claim_on_a_table_without_rows_is_not_tested_and_names_the_command_that_makes_them():
    claim = CLAIMS["gka-lm"]
    table = SPEC["tables"][claim["table"]]
    if not (ROOT / "tables" / claim["table"] / "results.jsonl").exists():
        why = table["awaiting_rows"]
        assert _verdict("gka-lm") == f"not tested (no rows yet: {why})"
        script = re.search(r"scripts/\S+\.sh", why)
        assert script and (ROOT / script.group(0)).is_file()
    assert (ROOT / table["recipe"]).is_file()


def test_every_quote_names_its_paper_by_title_and_id():
    papers = SPEC["papers"]
    for claim in SPEC["claims"]:
        paper = papers[claim["paper"]]
        assert paper["title"].strip() and re.fullmatch(r"arXiv \d{4}\.\d{4,5}|OpenReview \w+", paper["id"])
        section = _section(claim["id"])
        assert f"- Paper: {paper['title']} ({paper['id']})" in section
        if "quote" in claim:
            assert claim.get("section"), f"{claim['id']}: a quote without the place it is from"
            assert "- Quote (" in section


@pytest.mark.parametrize("table", ["echo_mqar_grid", "gka_budget", "lm_bytes"])
def test_a_rows_recorded_recipe_resolves_to_its_recipe_key(table):
    """One cell re-run from its row: the resolved recipe the row records, saved as YAML and given to `zoo train`,
    is the recipe the row was trained with (every row of the table)."""
    for row in _rows(table):
        assert load_recipe(row["recipe"]).key == row["recipe_key"], (table, row["label"], row["seed"])


@pytest.mark.parametrize("table", ["echo_mqar_grid", "gka_budget", "lm_bytes"])
def test_a_cell_that_changes_layers_or_task_resolves_from_its_table_recipe_and_overrides(table):
    """`zoo train <table recipe> <the row's overrides>` trains the row's recipe for a cell whose overrides are its
    layers, task or seed (the first cell of each of these tables)."""
    row = _rows(table)[0]
    assert set(row["overrides"]) <= {"model.layers", "seed"} | {k for k in row["overrides"] if k.startswith("task.")}
    typed = [f"{key}={json.dumps(value)}" for key, value in row["overrides"].items()]
    assert load_recipe(ROOT / SPEC["tables"][table]["recipe"], typed).key == row["recipe_key"], typed
