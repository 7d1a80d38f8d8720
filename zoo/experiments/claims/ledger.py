"""The ledger's entry points: build every generated file from ``claims.yaml`` and the committed results,
write them (``zoo claims``), or check the committed ones against them (``zoo claims --check``).

``CLAIMS.md`` (:mod:`.render`), ``tables/README.md`` (:mod:`.costs`) and the README's results table are
generated, so none of them can be edited by hand or drift from the data. The check also renders every listed
table's ``results.jsonl`` again (:func:`zoo.experiments.results.render_folder`) and compares its committed
``results.md`` and ``results.csv`` with that, so that a table re-run without being rendered again (or a hand
edit of a rendered number) is found; only the title line, which is not read from the rows, may differ.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..results import LAYOUT_NAME, render_folder
from .costs import render_tables
from .render import readme_with_results, render_claims
from .schema import check_tables, load
from .verdicts import evaluate_claims


def build(root: Path | str = ".", notes: list[str] | None = None,
          problems: list[str] | None = None) -> dict[str, str]:
    """``{relative path: text}`` of every generated file, from claims.yaml and the committed results; ``notes``
    (when given) receives one line per claim whose verdict reads cells that are stale by code, ``problems``
    one line per vacuous verdict and per claim whose cells have no step-0 evaluation."""
    root = Path(root)
    data = load(root)
    check_tables(data)
    claims = evaluate_claims(data, root)
    if notes is not None:
        notes.extend(f"{c.spec['id']}: stale by code: {'; '.join(x.text() for x in c.stale)}" for c in claims if c.stale)
    if problems is not None:
        problems.extend(f"claims.yaml: {c.spec['id']}: vacuous at step 0: {'; '.join(c.vacuous)}; tighten the rule, "
                        f"list its cells in learned, or say why in step0_ok" for c in claims if c.vacuous)
        problems.extend(f"claims.yaml: {c.spec['id']}: no step-0 evaluation of {', '.join(c.step0_missing)}; run "
                        f"zoo claims --untrained {c.spec['table']}" for c in claims if c.step0_missing)
    return {"CLAIMS.md": render_claims(data, claims), "tables/README.md": render_tables(data, root),
            **readme_with_results(root, data, claims)}


def first_difference(old: str, new: str) -> str:
    """The first differing line of two texts, for an error message."""
    a, b = old.splitlines(), new.splitlines()
    for i, (x, y) in enumerate(zip(a, b), 1):
        if x != y:
            return f"line {i}: committed {x[:120]!r}, regenerated {y[:120]!r}"
    return f"line {min(len(a), len(b)) + 1}: the committed file has {len(a)} lines, the regenerated {len(b)}"


def _without_title(text: str) -> str:
    """A rendered results.md without its title line (the title comes from the command line or the layout)."""
    return text.split("\n", 1)[1] if text.startswith("# ") else text


def stale_renderings(root: Path, tables) -> list[str]:
    """One message per committed ``results.md`` / ``results.csv`` of ``tables`` that differs from what its
    ``results.jsonl`` (with its grid layout) renders now; a table without such a file is not checked."""
    problems = []
    for table in tables:
        folder = root / "tables" / table
        committed = {name: (folder / name).read_text() for name in ("results.md", "results.csv")
                     if (folder / name).is_file()}
        if not committed or not (folder / "results.jsonl").is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("results.jsonl", LAYOUT_NAME):
                if (folder / name).is_file():
                    shutil.copyfile(folder / name, Path(tmp) / name)
            render_folder(Path(tmp), title=table, plot=False)
            rendered = {name: (Path(tmp) / name).read_text() for name in committed}
        for name, text in committed.items():
            old, new = text, rendered[name]
            if name == "results.md":
                old, new = _without_title(old), _without_title(new)
            if old != new:
                problems.append(f"tables/{table}/{name} does not match its results.jsonl ({first_difference(old, new)}"
                                f"{', after the title line' if name == 'results.md' else ''}); render it again with "
                                f"zoo table tables/{table}")
    return problems


def check(root: Path | str = ".", notes: list[str] | None = None) -> list[str]:
    """One message per generated file that differs from the committed one, and per committed rendering of a
    table that differs from its rows (empty when all match)."""
    root = Path(root)
    problems: list[str] = []
    for rel, text in build(root, notes, problems).items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing; run zoo claims")
        elif path.read_text() != text:
            problems.append(f"{rel} differs from the regenerated text ({first_difference(path.read_text(), text)}); "
                            f"edit claims.yaml or the tables, not {rel}, and run zoo claims")
    return problems + stale_renderings(root, load(root).get("tables") or {})


def write(root: Path | str = ".", notes: list[str] | None = None) -> list[str]:
    """Write every generated file; return their relative paths."""
    root = Path(root)
    written = []
    for rel, text in build(root, notes).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)  # tables/ of a ledger whose tables await rows
        (root / rel).write_text(text)
        written.append(rel)
    return written
