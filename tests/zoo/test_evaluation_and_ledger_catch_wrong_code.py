"""Evaluation and the claims ledger against numbers worked out by hand: the end-of-run evaluation reads the
recipe's test-time knobs (with each swept value on top of them) and its evaluation tasks' test split at the
recipe's seed; a checkpoint of another tokenizer is refused; and the ledger's fraction scales, step-0 checks,
disclosed runs, stale cells, cost estimates, claims.yaml checks, table columns, bench ratios, titles and the code
of a cell are what a hand computation says."""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml

from mixers.base import STATE_MIXERS
from zoo.errors import UserError
from zoo.experiments.ablate import cell_name
from zoo.experiments.claims.cells import CellStats, recipe_cells
from zoo.experiments.claims.conditions import Condition, check_fraction
from zoo.experiments.claims.costs import render_tables, table_estimates
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.ledger import first_difference
from zoo.experiments.claims.schema import Claim, check_tables, claimed_cells, load, parse_rule
from zoo.experiments.claims.verdicts import _check_step0 as check_step0
from zoo.experiments.claims.verdicts import _disclosed as disclosed
from zoo.experiments.claims.verdicts import evaluate_claims
from zoo.experiments.freshness import cell_code
from zoo.experiments.preregistration import Registration
from zoo.experiments.results import bench_with_ratios, render_folder, table_columns
from zoo.recipes import resolve
from zoo.tasks import Task, TaskData
from zoo.training import checkpoint as ckpt
from zoo.training import evaluation

from .test_claims import TINY, _synthetic_root
from .test_ledger_arithmetic import _cell as ledger_cell

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------- evaluation
class _KnobModel(torch.nn.Module):
    """Predicts each input token as the next label when its test-time knobs are exactly ``want`` (else the token
    after it), so an accuracy says which knobs the evaluation ran under."""

    def __init__(self, vocab: int, want: dict):
        super().__init__()
        self.vocab, self.want, self.knobs = vocab, want, {}
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, inputs, mask=None):
        shift = 0 if self.knobs == self.want else 1
        return F.one_hot((inputs + shift) % self.vocab, self.vocab).float() * 10 + self.weight

    def test_time_knobs(self) -> set[str]:
        return set(self.want)

    @contextlib.contextmanager
    def test_time(self, values=None):
        saved, self.knobs = self.knobs, dict(values or {})
        try:
            yield self
        finally:
            self.knobs = saved

    def num_params(self) -> int:
        return 1

    def state_size(self, seq_len: int) -> int:
        return 0

    active_state_size = state_size


def _copy_data(n: int, seq_len: int, vocab: int) -> TaskData:
    """Labels equal to the inputs, a random part of the positions unsupervised."""
    inputs = torch.randint(vocab, (n, seq_len))
    labels = inputs.clone()
    labels[torch.rand(n, seq_len) < 0.3] = -100
    labels[:, 0] = inputs[:, 0]  # every example has a supervised position
    return TaskData(inputs, labels)


def test_the_final_evaluation_runs_under_the_recipes_knobs_and_each_swept_value_on_top_of_them():
    """Test accuracy is read under ``eval.test_time``; a sweep of one knob keeps the recipe's other knobs."""
    vocab, a, b = random.randint(5, 9), random.randint(1, 9), random.randint(1, 9)
    other = b + random.randint(1, 5)
    model = _KnobModel(vocab, {"a": a, "b": b})
    data = _copy_data(random.randint(3, 7), random.randint(4, 8), vocab)
    task = SimpleNamespace(make=lambda split, seed, seq_len=None: data, seq_len=data.inputs.shape[1])
    recipe = SimpleNamespace(seed=0, eval_tasks=[], eval=SimpleNamespace(
        batch_size=2, test_time={"a": a, "b": b}, seq_lens=[], test_time_sweep={"b": [b, other]}))
    metrics = evaluation.test_metrics(model, recipe, task, CPU, "fp32")
    assert metrics["test_accuracy"] == 1.0 and metrics["test_sequence_accuracy"] == 1.0
    assert metrics[f"test_accuracy@b={b}"] == 1.0
    assert metrics[f"test_accuracy@b={other}"] == 0.0


class _Memorized(torch.nn.Module):
    """Answers every labelled position of the examples it memorized and shifts the inputs of any other example,
    so its accuracy is 1 on exactly the data it saw."""

    def __init__(self, data: TaskData, vocab: int):
        super().__init__()
        self.vocab, self.weight = vocab, torch.nn.Parameter(torch.zeros(1))
        self.known = {tuple(x.tolist()): y.clamp(min=0) for x, y in zip(data.inputs, data.labels)}

    def forward(self, inputs, mask=None):
        out = [self.known.get(tuple(x.tolist()), (x + 1) % self.vocab) for x in inputs]
        return F.one_hot(torch.stack(out), self.vocab).float() * 10 + self.weight

    @contextlib.contextmanager
    def test_time(self, values=None):
        yield self


def test_an_evaluation_task_is_scored_on_the_test_split_of_the_recipes_seed():
    """A model that memorized the ``eval.tasks`` entry's test split at the recipe's seed scores 1 on it."""
    spec = resolve(TINY, [f"task.num_test={random.randint(8, 16)}"]).task
    seed = random.randrange(10_000)
    task = Task.from_spec(spec)
    model = _Memorized(task.make("test", seed), task.vocab_size)
    recipe = SimpleNamespace(seed=seed, eval_tasks=[("recall", spec)],
                             eval=SimpleNamespace(batch_size=4, test_time={}, seq_lens=[]))
    assert evaluation.eval_task_metrics(model, recipe, CPU, "fp32") == {"test_accuracy@task=recall": 1.0}
    other = evaluation.eval_task_metrics(model, SimpleNamespace(**{**vars(recipe), "seed": seed + 1}), CPU, "fp32")
    assert other["test_accuracy@task=recall"] < 1.0


# ------------------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_of_a_tokenizer_with_other_contents_is_refused(tmp_path):
    """The fingerprint a checkpoint recorded must be the tokenizer's now; one without a record is not checked."""
    contents = os.urandom(32)
    now = hashlib.sha256(contents).hexdigest()
    task = SimpleNamespace(tokenizer_fingerprint=lambda: now, options=SimpleNamespace(tokenizer="tok.json"))
    path = tmp_path / "checkpoint.pt"
    ckpt.check_same_tokenizer(path, {"tokenizer_fingerprint": now}, task)
    ckpt.check_same_tokenizer(path, {}, task)
    changed = hashlib.sha256(contents + b"x").hexdigest()
    with pytest.raises(UserError, match="tok.json'? has other contents"):
        ckpt.check_same_tokenizer(path, {"tokenizer_fingerprint": changed}, task)


# ------------------------------------------------------------------------------------- ledger conditions
def _cell(label: str, per_seed: dict[int, dict], keys: dict[int, str] | None = None) -> CellStats:
    """A cell of table t from ``{seed: metrics}`` (rows written in a shuffled order), with recipe keys."""
    return ledger_cell(label, per_seed, random.sample(list(per_seed), len(per_seed)), keys or {})


def test_accuracies_are_fractions_thresholds_and_levels_in_0_1_and_offsets_in_minus_1_1():
    """1.0 is a valid threshold and 1.5 is not; a negative offset is valid and a negative level is not."""
    Condition.parse("a.test_accuracy >= 1.0", "test")
    with pytest.raises(ClaimsError, match="is a fraction"):
        Condition.parse(f"a.test_accuracy >= {random.uniform(1.01, 90):.2f}", "test")
    low = -round(random.uniform(0.05, 0.95), 2)
    check_fraction("test_accuracy", low, "test", "offset")
    with pytest.raises(ClaimsError, match="its level is"):
        check_fraction("test_accuracy", low, "test", "level")
    with pytest.raises(ClaimsError, match="its threshold is"):
        check_fraction("test_accuracy", low, "test", "threshold")


# ------------------------------------------------------------------------------------- step 0 and registration
def _step0_claim(step0_ok: dict | None = None) -> Claim:
    """Cells a and b (b planned, without rows): ``reproduced`` reads both, ``partly`` reads a alone."""
    claim = Claim({"id": "c", "step0_ok": step0_ok or {}})
    claim.cells = {"a": _cell("a", {s: {"test_accuracy": 0.9} for s in range(3)}), "b": CellStats("t", "b", [])}
    claim.rule = {"reproduced": [Condition.parse("a.test_accuracy >= 0.0", "t"),
                                 Condition.parse("b.test_accuracy >= 0.5", "t")],
                  "partly": [Condition.parse("a.test_accuracy >= 0.0", "t")], "exploration": []}
    return claim


def test_a_verdict_is_vacuous_only_when_every_one_of_its_conditions_holds_untrained_and_none_is_accounted_for():
    """``reproduced`` has a condition on a cell without rows, so the untrained models cannot get it; ``partly``
    they get, unless ``step0_ok`` says why its condition may hold at step 0; a cell whose rows have a seed
    without a step-0 evaluation is named and nothing is concluded."""
    untrained = {"a": {s: {"test_accuracy": random.uniform(0, 0.5)} for s in range(3)}}
    claim = _step0_claim()
    check_step0(claim, untrained, "t")
    assert claim.vacuous == ["every partly condition holds at step 0"] and claim.step0_missing == []
    assert [h.split(":")[0] for h in claim.step0_holds] == ["reproduced", "partly"]
    claim = _step0_claim({"a.test_accuracy >= 0.0": "any accuracy is at least 0"})
    check_step0(claim, untrained, "t")
    assert claim.vacuous == []
    extra = {s: {"test_accuracy": 0.1} for s in range(random.randint(4, 6))}  # step-0 seeds the rows lack
    gone = random.randrange(3)
    for seeds in ({**untrained["a"], **extra}, {s: m for s, m in untrained["a"].items() if s != gone}):
        claim = _step0_claim()
        check_step0(claim, {"a": seeds}, "t")
        assert claim.step0_missing == ([] if len(seeds) > 3 else ["a"])
        assert claim.vacuous == ([] if len(seeds) < 3 else ["every partly condition holds at step 0"])
        assert len(claim.step0_holds) == (0 if len(seeds) < 3 else 2)


def test_disclosed_runs_before_a_rule_make_a_pre_registered_rule_post_hoc_and_add_to_an_unchecked_one():
    """``calibration`` turns a rule pre-registered in git into a post-hoc one; a rule git could not check stays
    unchecked, not post hoc, with the disclosed runs added to its text."""
    runs = f"{random.randint(2, 9)} pilot runs"
    unchecked = disclosed({"id": "c", "calibration": runs}, Registration(False, False, "not in git"))
    assert (unchecked.checked, unchecked.post_hoc) == (False, False)
    assert unchecked.text == f"not in git; runs before the rule: {runs}"
    pre = disclosed({"id": "c", "calibration": runs}, Registration(True, False, "pre-registered: rule at abc"))
    assert (pre.checked, pre.post_hoc) == (True, True) and pre.text.startswith("post hoc: rule at abc")


def test_a_change_of_code_stales_the_cells_a_verdict_reads_and_never_an_exploration_cell(tmp_path):
    """Every row ran the attention mixer; after a change of its code the verdict's cells a and b are stale, and
    cell c, read only by an exploration condition, is shown but not counted."""
    from .test_claims_honesty import ATTENTION, _code_repo, _commit
    rule = {"reproduced": ["a.test_accuracy >= 0.9", "b.test_accuracy <= 0.2"],
            "exploration": ["c.test_accuracy >= 0.0"]}
    root, _ = _code_repo(tmp_path, {"a": [0.95] * 3, "b": [0.1] * 3, "c": [random.random() for _ in range(3)]},
                         rule=rule, claim={"cells": {"a": "a", "b": "b", "c": "c"}})
    (root / "mixers" / "attention.py").write_text(ATTENTION.read_text() + f"\nSCALE = {random.randint(2, 9)}\n")
    _commit(root, "a change of code")
    claim = evaluate_claims(load(root), root)[0]
    assert [s.label for s in claim.stale] == ["a", "b"]
    assert claim.verdict == "reproduced, stale by code"


# ------------------------------------------------------------------------------------- table costs
def test_a_recipes_estimate_counts_each_committed_run_at_its_own_time_and_the_rest_at_its_cells_rate(tmp_path):
    """Cell a: every seed committed under the recipe's key; b: seeds 0 and 1 committed, seed 2 never run; c: rows
    of an older recipe on every seed; planned: no rows. Worked out run by run."""
    root = _synthetic_root(tmp_path, {"a": [0.9] * 3, "b": [0.9] * 3, "c": [0.9] * 3})
    recipe = {(cell.label, cell.recipe.seed): cell.recipe for cell in recipe_cells(root, "recipes/t.yaml")}
    secs = {(label, s): random.uniform(5, 50) for label in "abc" for s in range(3)}
    steps = {(label, s): random.randint(2, 9) for label in "abc" for s in range(3)}

    def rows(label, seeds, current):
        keys = {s: recipe[label, s].key if current else f"old-{label}-{s}" for s in seeds}
        return _cell(label, {s: {"train_seconds": secs[label, s], "steps": steps[label, s]} for s in seeds}, keys)
    cells = {"a": rows("a", range(3), True), "b": rows("b", range(2), True), "c": rows("c", range(3), False)}
    rate = {label: sum(secs[label, s] / steps[label, s] for s in range(len(cells[label].rows)))
            / len(cells[label].rows) for label in "bc"}
    budget = recipe["a", 0].train.steps
    missing = rate["b"] * budget + 3 * rate["c"] * budget
    est = table_estimates(root, "recipes/t.yaml", cells)
    assert est["total"] == pytest.approx(sum(secs["a", s] for s in range(3)) + secs["b", 0] + secs["b", 1] + missing)
    assert est["missing"] == pytest.approx(missing)
    assert (est["n_missing"], est["unmeasured"], est["stale"]) == (1 + 3 + 3, 3, 3)
    assert (est["cells"], est["runs"], est["seeds"]) == (4, 12, [0, 1, 2])


def test_the_committed_rows_column_gives_the_fewest_and_most_seeds_of_a_cell(tmp_path):
    """tables/README.md writes the seeds per cell of the committed rows as ``<fewest>-<most>``."""
    few, most = sorted(random.sample(range(1, 6), 2))
    root = _synthetic_root(tmp_path, {"a": [0.9] * few, "b": [0.1] * most})
    line = next(x for x in render_tables(load(root), root).splitlines() if x.startswith("| `tables/t`"))
    assert f"| 2 cells, {few}-{most} seeds, " in line


# ------------------------------------------------------------------------------------- claims.yaml
def _tables(**spec) -> dict:
    return {"papers": {}, "tables": {"t": {"recipe": "recipes/t.yaml",
                                           "no_learning": {"*": {"test_accuracy": 0.0}}, **spec}}}


def test_claims_yaml_refuses_zero_workers_a_yes_or_no_level_and_a_shown_term_with_an_offset():
    """``ray_workers`` is a whole number from 1, a no-learning level is a number (YAML's yes/no is not), and a
    ``show`` term is shown as measured, without an offset."""
    check_tables(_tables(ray_workers=random.randint(1, 8)))
    with pytest.raises(ClaimsError, match="ray_workers"):
        check_tables(_tables(ray_workers=0))
    with pytest.raises(ClaimsError, match="no_learning"):
        check_tables(_tables(no_learning={"*": {"test_accuracy": random.choice([True, False])}}))
    claim = Claim({"rule": {"reproduced": ["a.test_accuracy >= 0.5"]}, "show": ["a.test_accuracy"]})
    claim.cells = {"a": _cell("a", {s: {"test_accuracy": random.random()} for s in range(3)})}
    parse_rule(claim, "c")
    claim.spec["show"] = [f"a.test_accuracy + {random.uniform(0.01, 0.5):.2f}"]
    with pytest.raises(ClaimsError, match="adds an offset"):
        parse_rule(claim, "c")


def test_the_cells_claims_read_leave_out_those_of_pending_claims(tmp_path):
    """A pending claim reads no cell yet; a label with its seed word names the cell."""
    data = {**_tables(), "claims": [{"id": "x", "table": "t", "cells": {"m": "a seed=1", "n": "b"}},
                                    {"id": "y", "table": "t", "cells": {"m": "c"}, "pending": "not run yet"}]}
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(data))
    assert claimed_cells(tmp_path, "t") == {"a", "b"}


def test_the_first_difference_of_two_texts_is_named_by_its_line_counted_from_one():
    """The first differing line is numbered as an editor numbers it; a text cut short differs at its end."""
    lines = [f"line {i} {random.random()}" for i in range(random.randint(3, 9))]
    at = random.randrange(len(lines))
    changed = [x if i != at else x + " edited" for i, x in enumerate(lines)]
    assert first_difference("\n".join(lines), "\n".join(changed)).startswith(f"line {at + 1}: committed ")
    assert first_difference("\n".join(lines), "\n".join(lines[:at])).startswith(f"line {at + 1}: the committed")


# ------------------------------------------------------------------------------------- tables and bench
def test_test_lengths_are_columns_from_short_to_long_and_a_lower_sequence_accuracy_gets_its_column():
    """Test lengths are ordered as numbers (64 before 1024); sequence accuracy below token accuracy is a column."""
    lengths = random.sample([64, 128, 256, 1024, 4096], 3)
    tok = random.uniform(0.5, 0.9)
    rows = [{"metrics": {"test_accuracy": tok, "test_sequence_accuracy": tok - random.uniform(0.01, 0.4),
                         **{f"test_accuracy@{n}": random.random() for n in lengths}}}]
    columns = table_columns(rows)
    assert [c for c in columns if c.startswith("test_")] == [
        "test_accuracy", "test_sequence_accuracy", *(f"test_accuracy@{n}" for n in sorted(lengths))]


def test_bench_ratios_divide_by_the_baseline_and_growth_skips_an_entry_without_a_time():
    """``<time>_vs_baseline`` is the entry's time over the baseline's at the same T; ``fwd_bwd_growth`` compares
    with the last shorter T that has a fwd+bwd time."""
    times = {(label, t): random.uniform(1, 10) for label in ("attn", "m") for t in (1, 2, 3)}
    rows = [{"label": label, "T": 64 * t, "fwd_ms": times[label, t], "fwd_bwd_ms": 3 * times[label, t]}
            for label in ("attn", "m") for t in (1, 2, 3)]
    rows[4]["fwd_bwd_ms"] = None  # m at T=128: its fwd+bwd was not measured
    out = {(r["label"], r["T"] // 64): r for r in bench_with_ratios(rows)}
    for t in (1, 2, 3):
        assert out["m", t]["fwd_ms_vs_baseline"] == pytest.approx(times["m", t] / times["attn", t])
    assert out["m", 3]["fwd_bwd_growth"] == pytest.approx(times["m", 3] / times["m", 1])
    assert out["m", 3]["T_growth"] == 3 and "fwd_bwd_growth" not in out["m", 2]


def test_a_cells_seed_shows_only_beside_a_cell_of_the_same_label():
    """A cell is named by its label, with its seed only where other cells share the label."""
    seed = random.randrange(100)
    cells = [SimpleNamespace(label="a", recipe=SimpleNamespace(seed=seed)),
             *(SimpleNamespace(label="b", recipe=SimpleNamespace(seed=s)) for s in (seed, seed + 1))]
    assert [cell_name(c, cells) for c in cells] == ["a", f"b (seed {seed})", f"b (seed {seed + 1})"]


def test_an_ablation_folder_renders_under_its_grids_title_unless_another_is_given(tmp_path):
    """results.md of a folder with a grid layout is titled by the layout, or by the title given."""
    root = _synthetic_root(tmp_path, {"a": [random.random() for _ in range(3)], "b": [random.random()]})
    folder = root / "tables" / "t"
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    title = f"grid {random.randrange(1000)}"
    (folder / "cells.json").write_text(json.dumps({"title": title, "cells": [
        {"key": r["recipe_key"], "label": r["label"]} for r in rows]}))
    render_folder(folder, plot=False)
    assert (folder / "results.md").read_text().startswith(f"# {title}\n")
    render_folder(folder, title="given", plot=False)
    assert (folder / "results.md").read_text().startswith("# given\n")


# ------------------------------------------------------------------------------------- code of a cell
@pytest.mark.parametrize("state_mixer", ["swiglu", "koopman_mlp"])
def test_the_code_of_a_cell_holds_the_file_of_its_state_mixer(state_mixer):
    """A row ran its state mixer's module as much as its sequence mixers': a change there changes the cell."""
    root = Path(__file__).resolve().parents[2]
    plain = resolve(TINY, ["model.layers=[attention]", f"model.state_mixer={state_mixer}"]).plain
    source = Path(inspect.getfile(STATE_MIXERS.get(state_mixer))).resolve().relative_to(root)
    assert str(source) in cell_code(root, plain)
