"""Cell statistics: the rows of one cell of a committed table (one per seed), checked, and what the ledger reads
from them (per-seed values, the mean and spread over seeds, the test lengths of a metric).

Rows are grouped into cells by label (:func:`zoo.experiments.results.cell_of`: a ``seed=N`` word of an older
label is ignored); every row of a cell must have the same resolved recipe apart from its seed, one row per seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mixers.options import nearest

from ...errors import UserError
from ...recipes import resolve
from ...recipes.plain import recipe_differences
from ...rows import read_rows
from ..ablate import cells_of, row_seed
from ..results import group_by_cell, mean_std
from .errors import ClaimsError


def num(x: float) -> str:
    """How the ledger writes a number: three decimals, or ``nan``."""
    return "nan" if x != x else f"{x:.3f}"


def _metrics(row: dict) -> dict:
    return dict(row.get("metrics", {}))


@dataclass
class CellStats:
    """The rows of one cell of a table (one per seed) and what the ledger reads from them."""
    table: str
    label: str
    rows: list[dict]

    @property
    def seeds(self) -> list[int]:
        return sorted(row_seed(r) for r in self.rows)

    @property
    def n(self) -> int:
        return len(self.rows)

    def metrics(self) -> set[str]:
        return {k for r in self.rows for k in _metrics(r)}

    def values(self, metric: str) -> list[float]:
        out = []
        for r in sorted(self.rows, key=row_seed):
            m = _metrics(r)
            if metric not in m:
                raise ClaimsError(f"tables/{self.table}: cell {self.label!r} (seed {row_seed(r)}) has no metric "
                                  f"{metric!r}{nearest(metric, m)} (its metrics: {', '.join(sorted(m))})")
            out.append(float("nan") if m[metric] is None else float(m[metric]))
        return out

    def mean(self, metric: str) -> float:
        values = self.values(metric)
        return mean_std(values)[0] if values else float("nan")

    def lengths(self, metric: str) -> list[str]:
        """``metric`` at the training length, then at every test length of the cell's rows."""
        # the length is what follows "<metric>@", so metrics with an "@" of their own (e.g.
        # test_accuracy@task=<label>) have lengths too
        found = sorted({int(k[len(metric) + 1:]) for k in self.metrics()
                        if k.startswith(metric + "@") and k[len(metric) + 1:].isdigit()})
        return [metric] + [f"{metric}@{length}" for length in found]

    def summary(self, metric: str) -> str:
        """``0.921 ± 0.012 (3 seeds)``: mean ± sample standard deviation, and the number of seeds."""
        if not self.rows:
            return "no rows (0 seeds)"
        values = self.values(metric)
        mean, std = mean_std(values)
        seeds = f"{self.n} seed{'s' * (self.n != 1)}"
        return f"{num(mean)} ({seeds})" if self.n == 1 else f"{num(mean)} ± {num(std)} ({seeds})"


def _without_seed(recipe: dict) -> dict:
    return {k: v for k, v in recipe.items() if k != "seed"}


def _check_cell(table: str, label: str, rows: list[dict]) -> None:
    """One recipe per cell apart from the seed, and one row per seed."""
    first = _without_seed(rows[0]["recipe"])
    for r in rows[1:]:
        if _without_seed(r["recipe"]) != first:
            diff = "; ".join(recipe_differences(first, _without_seed(r["recipe"])))
            raise ClaimsError(f"tables/{table}: the rows of cell {label!r} differ in more than the seed ({diff}); "
                              f"give the cells different labels")
    seeds = [row_seed(r) for r in rows]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ClaimsError(f"tables/{table}: cell {label!r} has more than one row for seed {repeated[0]}; "
                          f"keep one row per seed in results.jsonl")


def table_cells(root: Path, table: str, awaiting: str | None = None) -> dict[str, CellStats]:
    """Every cell of ``tables/<table>/results.jsonl``, checked: one recipe per cell apart from the seed,
    and one row per seed. A table whose ``claims.yaml`` entry says why it has no rows yet (``awaiting``: its
    ``awaiting_rows``) has no cells until its rows come; once they do, the entry must go."""
    path = root / "tables" / table / "results.jsonl"
    if not path.is_file():
        if awaiting:
            return {}
        raise ClaimsError(f"{path.relative_to(root)}: no such file; run the table's recipe (zoo ablate ... --out "
                          f"tables/{table}), correct the claim's table, or, for a table not run yet, say why in "
                          f"claims.yaml tables.{table}.awaiting_rows")
    cells = {}
    for label, rows in group_by_cell(read_rows(path)).items():
        _check_cell(table, label, rows)
        cells[label] = CellStats(table, label, rows)
    if cells and awaiting:
        raise ClaimsError(f"tables/{table} has rows now; remove awaiting_rows from claims.yaml tables.{table}")
    return cells


def recipe_cells(root: Path, recipe_path: str):
    """The cells (label, resolved recipe) of a table's recipe as written now."""
    try:
        return cells_of(resolve(root / recipe_path))
    except UserError as err:
        raise ClaimsError(f"{recipe_path}: {err}") from None
