"""Stale by code: a table cell computed at a commit older than the last change to the code it ran.

A cell's code is the module of every mixer its layers and state mixer name, the module of its training task
and of every ``eval.tasks`` entry, and every module of ``kernels/``, ``mixers/``, ``zoo/tasks/`` and ``zoo/data/`` those
import, followed transitively (read from the code as it is now), with the hybrid stack (``zoo/model.py``),
the optimizer (``zoo/training/optim.py``: which parameters are decayed, the learning-rate schedule) and the
end-of-run metrics (``zoo/training/evaluation.py``: how a row's test and validation numbers are computed). The
modules in :data:`INFRASTRUCTURE` (the mixer contract, option parsing, registries, backend dispatch) are left
out: they compute no number of a row, and their changes are checked by the contract and kernel test suites.
The training loop (batch order, clipping, how the schedule is stepped) is not part of a cell's code here, so
a change there that alters the numbers is not flagged by this check.

A file has *changed* since a row when its code differs between the row's commit (``versions.git``) and now,
compared as syntax trees without docstrings and with the import statements sorted, so a change of wording,
comments, formatting or import order is not a change. Each commit that changed a file's code since the row's
commit is a *change* of the cell; a cell is **stale** while it has a change that its table does not vouch for
in ``claims.yaml`` (``tables.<name>.code_changes: {<commit>: <why the change keeps this table's numbers>}``,
for a refactor checked element for element, say). Re-running the cell's rows clears it.
"""
from __future__ import annotations

import ast
import atexit
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mixers import MIXERS, STATE_MIXERS

from ..errors import UserError
from ..recipes import resolve
from ..recipes.plain import recipe_mapping
from ..tasks import TASKS
from .preregistration import git

#: packages whose modules can change a row's numbers
CODE_PACKAGES = ("kernels", "mixers", "zoo.tasks", "zoo.data")
#: modules of every cell: the hybrid stack, the optimizer (weight decay and schedule) and the end-of-run metrics
EVERY_CELL = ("zoo/model.py", "zoo/training/optim.py", "zoo/training/evaluation.py")
#: where git looks for changes
CODE_PATHS = ("kernels", "mixers", "zoo/tasks", "zoo/data", *EVERY_CELL)
#: modules that compute no number of a row (contract, options, registries, dispatch)
INFRASTRUCTURE = frozenset({"kernels", "kernels.backend", "mixers", "mixers.base", "mixers.options",
                            "zoo.tasks", "zoo.data"})


# ----------------------------------------------------------------------------------- the code of a cell
def module_path(root: Path, module: str) -> Path | None:
    """The file of ``module`` under ``root`` (a module file or a package's ``__init__.py``), if there is one."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _ours(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CODE_PACKAGES)


def imported_modules(module: str, text: str) -> set[str]:
    """The modules of the code packages that the source of ``module`` imports (absolute and relative imports;
    ``module`` names the importing module, so its package resolves the relative ones)."""
    package = module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if _ours(m)}


def _imports_in_file(path: Path, package: str) -> frozenset[str]:
    return _imports_in_version(path, package, path.stat().st_mtime_ns)


@lru_cache(maxsize=None)
def _imports_in_version(path: Path, package: str, mtime_ns: int) -> frozenset[str]:
    return frozenset(imported_modules(package + ".x", path.read_text()))


def code_modules(root: Path, start: frozenset[str]) -> frozenset[str]:
    """``start`` and every code-package module they import, transitively, without the infrastructure."""
    seen, todo = set(), [m for m in start if _ours(m)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = module_path(root, module)
        if path is None:
            continue
        seen.add(module)
        pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        todo.extend(_imports_in_file(path, pkg) - seen)
    return frozenset(m for m in seen if m not in INFRASTRUCTURE)


def cell_code(root: Path, plain_recipe: dict) -> list[str]:
    """The repository paths of the code a row with this resolved recipe ran."""
    try:
        recipe = resolve(recipe_mapping(plain_recipe))
    except UserError:
        return []
    start = {MIXERS.get(s.name).__module__ for s in recipe.layers}
    start.add(STATE_MIXERS.get(recipe.state_mixer.name).__module__)
    for _, spec in [("", recipe.task), *recipe.eval_tasks]:
        start.add(TASKS.get(spec.name).__module__)
    paths = {module_path(root, m) for m in code_modules(root, frozenset(start))}
    found = {str(p.relative_to(root)) for p in paths if p is not None}
    return sorted(found | {p for p in EVERY_CELL if (root / p).is_file()})


# ----------------------------------------------------------------------------------- changes of code
def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]


def code_form(text: str | None) -> str | None:
    """The code of a module without docstrings, comments, formatting and import order (None: no file)."""
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    _strip_docstrings(tree)
    imports = sorted(ast.dump(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    rest = [ast.dump(n) for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    return "\n".join(imports + rest)


class _Blobs:
    """File contents at commits, read through one ``git cat-file --batch`` process (thousands of lookups)."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(["git", "-C", str(root), "cat-file", "--batch"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        atexit.register(self.close)

    def close(self) -> None:
        """End the git process (it ends at end of input) and close its pipes."""
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()

    def read(self, spec: str) -> str | None:
        self.proc.stdin.write(spec.encode() + b"\n")
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().split()
        if len(header) < 3:  # "<spec> missing"
            return None
        data = self.proc.stdout.read(int(header[2]) + 1)[:-1]
        return data.decode("utf-8", errors="replace")


@lru_cache(maxsize=None)
def _blobs(root: str) -> _Blobs:
    return _Blobs(Path(root))


@lru_cache(maxsize=None)
def _form_at(root: str, commit: str, path: str) -> str | None:
    return code_form(_blobs(root).read(f"{commit}:{path}"))


def _form_now(path: Path) -> str | None:
    stat = path.stat() if path.is_file() else None
    return _form_of_file(path, stat.st_mtime_ns if stat else None, stat.st_size if stat else None)


@lru_cache(maxsize=None)
def _form_of_file(path: Path, mtime_ns: int | None, size: int | None) -> str | None:
    """(the file's modification time and size are part of the cache key: a file edited since is read again)"""
    return code_form(path.read_text() if mtime_ns is not None else None)


@lru_cache(maxsize=None)
def _commits_since(root: str, since: str, head: str) -> dict[str, tuple[str, ...]]:
    """``{path: commits after since that touched it, newest first}``, from one ``git log``."""
    log = git(Path(root), "log", "--format=%x00%H", "--name-only", f"{since}..{head}", "--", *CODE_PATHS) or ""
    out: dict[str, list[str]] = {}
    for entry in log.split("\x00")[1:]:
        commit, *paths = entry.split()
        for path in paths:
            out.setdefault(path, []).append(commit)
    return {k: tuple(v) for k, v in out.items()}


@lru_cache(maxsize=None)
def _full(root: str, commit: str) -> str | None:
    out = git(Path(root), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    return out.strip() if out else None


def code_changes(root: Path, since: str, path: str, head: str | None = None) -> list[str]:
    """The commits after ``since`` that changed the code of ``path`` (oldest first); a working-tree change of
    the code that is not committed yet is ``"uncommitted"``. None when the code now is the code at ``since``."""
    key = str(root)
    if _form_at(key, since, path) == _form_now(root / path):
        return []  # the same code as at ``since``: changes undone since change nothing
    head = head or (git(root, "rev-parse", "HEAD") or "").strip()
    out = [c for c in reversed(_commits_since(key, since, head).get(path, ()))
           if _form_at(key, c + "^", path) != _form_at(key, c, path)]
    if _form_now(root / path) != _form_at(key, head, path):
        out.append("uncommitted")
    return out


@dataclass
class Staleness:
    """The changes of a cell's code since its rows that its table does not vouch for."""
    label: str
    unvouched: dict[str, list[str]]  # commit (short) -> paths it changed
    unknown_commits: list[str]       # row commits this history does not have

    @property
    def stale(self) -> bool:
        return bool(self.unvouched or self.unknown_commits)

    def text(self) -> str:
        parts = [f"{c} ({', '.join(paths)})" for c, paths in self.unvouched.items()]
        if self.unknown_commits:
            parts.append(f"rows at commits unknown here: {', '.join(self.unknown_commits)}")
        return f"{self.label}: " + "; ".join(parts)


def cell_staleness(root: Path, label: str, rows: list[dict], vouched: dict, probed: dict | None = None) -> Staleness:
    """``vouched``: the table's ``code_changes`` of claims.yaml (commit -> reason, every cell); ``probed``: the
    outcomes :mod:`zoo.experiments.vouch` recorded (``{label: {row commit: {"until", "outcome"}}}``): the
    changes of a row commit's code up to ``until`` are vouched for when the outcome is "keeps"."""
    key = str(root)
    head = (git(root, "rev-parse", "HEAD") or "").strip()
    vouched_full = {_full(key, str(c)) for c in vouched or {}}
    unvouched: dict[str, list[str]] = {}
    unknown = []
    for commit in sorted({(r.get("versions") or {}).get("git") or "" for r in rows}):
        full = _full(key, commit) if commit else None
        if full is None:
            unknown.append(commit or "unrecorded")
            continue
        probe = ((probed or {}).get(label) or {}).get(full) or {}
        since = _full(key, probe["until"]) if probe.get("outcome") == "keeps" and probe.get("until") else full
        row = next(r for r in rows if (r.get("versions") or {}).get("git") == commit)
        for path in cell_code(root, row["recipe"]):
            for change in code_changes(root, since or full, path, head):
                if change != "uncommitted" and change in vouched_full:
                    continue
                short = change[:7] if change != "uncommitted" else change
                unvouched.setdefault(short, [])
                if path not in unvouched[short]:
                    unvouched[short].append(path)
    return Staleness(label, unvouched, unknown)
