"""Load, extend, override and validate YAML recipes — in one pass, :func:`resolve`.

Everything that reads a recipe (``zoo check``, ``train``, ``ablate`` and each of its grid cells,
``bench``, ``eval`` and the Python API) calls :func:`resolve`, which goes ``extends`` -> overrides ->
validation exactly once and returns a :class:`zoo.config.Recipe`: typed sections, a validated spec per
layer, the plain resolved dict and its stable hash.

- YAML is read with ``yaml.safe_load`` (no code runs from a recipe; python object tags are refused),
  and aliases may not expand past a size limit or refer to themselves.
- ``extends: base.yaml`` (relative to the recipe's folder) deep-merges the recipe over its base; lists
  are replaced, not merged; a base's ``grid`` is never inherited (a recipe extending an ablation is a
  new recipe, not that ablation).
- ``imports: [my_pkg.my_mixer]`` imports user modules first, so out-of-tree mixers and tasks registered
  with ``@register_mixer`` / ``@register_task`` can be named.
- Overrides ``key.path=value`` come from the command line or from an ablation grid; ``value`` is
  parsed as YAML (``train.lr=3e-3``, ``model.layers=[a,b]``), and integer segments index lists
  (``model.layers.1=<mixer>``, ``model.layers.1.<mixer>.<option>=value``).
- Validation is strict: unknown keys, unknown mixers / state mixers / tasks, wrong types, values out
  of range and missing fields raise :class:`UserError`, whose one-line message names the file and
  line (or the override) and suggests the nearest valid names.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import itertools
import json
import math
import re
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from mixers import MIXERS, STATE_MIXERS
from mixers.options import OptionError, build_options, nearest, plain_options

from .config import Cell, Recipe, RecipeConfig, Spec
from .errors import UserError
from .paths import read_recipe_text, recipe_file_problem, refuse_foreign_keys
from .tasks import TASKS, Task
from .tasks.text import layer_problem

#: the most values a recipe may expand to (YAML aliases can make a small file enormous)
MAX_VALUES = 100_000
#: an eval.tasks label names a metric column (test_accuracy@task=<label>)
_EVAL_TASK_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclasses.dataclass
class Source:
    """Where every key path of the merged recipe came from: ``path -> "file:line"``."""
    places: dict = dataclasses.field(default_factory=dict)

    def where(self, path: tuple) -> str:
        while path:
            if path in self.places:
                return self.places[path]
            path = path[:-1]
        return self.places.get((), "")


# --------------------------------------------------------------------------------------- reading
def _marks(node, prefix: tuple, filename: str, out: dict, depth: int = 0) -> None:
    if depth > 100:
        return
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if (key_node.tag, key_node.value) in seen:  # YAML keeps the last silently: refuse instead
                    raise UserError(f"{filename}:{key_node.start_mark.line + 1}: {key_node.value!r} appears twice "
                                      f"in the same mapping; keep one")
                seen.add((key_node.tag, key_node.value))
            out[path] = f"{filename}:{key_node.start_mark.line + 1}"
            _marks(value_node, path, filename, out, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[prefix + (i,)] = f"{filename}:{item.start_mark.line + 1}"
            _marks(item, prefix + (i,), filename, out, depth + 1)


def _check_size(data: Any, where: str) -> None:
    """Refuse self-referencing aliases and alias bombs before anything walks the data recursively."""
    count, stack, open_ids = 0, [(data, False)], set()
    while stack:
        node, leaving = stack.pop()
        if leaving:
            open_ids.discard(id(node))
            continue
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{where}: the recipe expands to more than {MAX_VALUES:,} values "
                              f"(YAML aliases repeated inside each other?)")
        if isinstance(node, (dict, list)):
            if id(node) in open_ids:
                raise UserError(f"{where}: a YAML alias refers to itself (e.g. a: &a [*a]); write the value out")
            open_ids.add(id(node))
            stack.append((node, True))
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, False) for child in children)


def _read_yaml(path: Path) -> tuple[dict, dict]:
    text = read_recipe_text(path)  # refuses devices, pipes and oversized files before reading
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark else ""
        problem = (err.problem or err.context or "invalid YAML").strip()
        raise UserError(f"{path}{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: YAML error: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise UserError(f"{path}: YAML nested too deeply") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise UserError(f"{path}: unreadable value: {str(err).splitlines()[0]}") from None
    _check_size(data, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a recipe must be a mapping of sections (model, task, train, ...)")
    refuse_foreign_keys(data, node, path)  # before any key or value of another kind of file is repeated
    marks: dict = {(): f"{path}:1"}
    _marks(node, (), str(path), marks)
    return data, marks


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_raw(path: str | Path, _seen: tuple = ()) -> tuple[dict, Source]:
    """Read a recipe and its ``extends`` chain into one dict, with the source of every key."""
    path = Path(path)
    if path.resolve() in _seen:
        raise UserError(f"{path}: 'extends' forms a cycle ({' -> '.join(str(p) for p in _seen + (path,))})")
    data, marks = _read_yaml(path)
    base_name = data.pop("extends", None)
    source = Source()
    if base_name is not None:
        if not isinstance(base_name, str) or not base_name.strip():
            raise UserError(f"{marks.get(('extends',), path)}: extends must be a file name")
        base_path = path.parent / base_name
        problem = recipe_file_problem(base_path)
        if problem:
            raise UserError(f"{marks.get(('extends',), path)}: extends: {base_path}: {problem}")
        base, source = load_raw(base_path, _seen + (path.resolve(),))
        base.pop("grid", None)  # a grid belongs to the recipe that declares it
        data = _merge(base, data)
    source.places.update(marks)
    return data, source


# --------------------------------------------------------------------------------------- overrides
def _key_path(key: str) -> list:
    return [int(p) if p.lstrip("-").isdigit() else p for p in key.split(".")]


def parse_override(text: str) -> tuple[list, Any]:
    """``"a.b.1=value"`` -> ``(["a", "b", 1], parsed YAML value)``."""
    if "=" not in text:
        raise UserError(f"override {text!r}: expected key.path=value, e.g. train.lr=3e-3 or model.layers.1=<mixer>")
    key, _, value_text = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        raise UserError(f"override {text!r}: the value {value_text!r} is not valid YAML "
                        f"(quote strings with spaces)") from None
    except RecursionError:
        raise UserError(f"override {text[:60]!r}...: the value is nested too deeply") from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise UserError(f"override {text[:60]!r}...: unreadable value: {str(err).splitlines()[0]}") from None
    _check_size(value, f"override {text!r}")
    return _key_path(key), value


def apply_override(data: dict, path: list, value: Any, label: str) -> None:
    """Set ``path`` in ``data`` (creating mappings as needed); ``label`` names the override in errors."""
    if path[:2] == ["model", "layers"] and len(path) > 2:
        model = data.setdefault("model", {})
        if "layers" not in model and isinstance(model.get("pattern"), list) and isinstance(model.get("n_layers"), int):
            pattern = model["pattern"]
            model["layers"] = [copy.deepcopy(pattern[i % len(pattern)]) for i in range(max(model["n_layers"], 0))]
    node = data
    for i, part in enumerate(path[:-1]):
        here = ".".join(map(str, path[: i + 1]))
        if isinstance(node, list):
            if not isinstance(part, int) or not -len(node) <= part < len(node):
                raise UserError(f"{label}: {here}: index out of range (the list has {len(node)} items)")
            if isinstance(node[part], str) and path[i + 1] == node[part]:
                node[part] = {node[part]: {}}  # model.layers.1.<mixer>.<option>=v on a plain "<mixer>" layer
            node = node[part]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise UserError(f"{label}: {here} is a {type(node).__name__}, not a mapping or list")
    last = path[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or not -len(node) <= last < len(node):
            where = ".".join(map(str, path))
            raise UserError(f"{label}: {where}: index out of range (the list has {len(node)} items)")
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise UserError(f"{label}: {'.'.join(map(str, path[:-1]))} is not a mapping or list")


# --------------------------------------------------------------------------------------- validation
class _Places:
    """Turns a dotted key path into the place to blame: an override's label, or file:line."""

    def __init__(self, source: Source, override_paths: dict):
        self.source, self.override_paths = source, override_paths

    def __call__(self, path_str: str) -> str:
        parts = tuple(int(p) if p.isdigit() else p for p in path_str.split(".")) if path_str else ()
        for length in range(len(parts), 0, -1):
            if parts[:length] in self.override_paths:
                return self.override_paths[parts[:length]]
        for path, label in self.override_paths.items():  # an override created this key (e.g. a typo in its path)
            if parts and path[:len(parts)] == parts and parts not in self.source.places:
                return label
        return self.source.where(parts)

    def fail(self, path_str: str, message: str):
        where = self(path_str)
        place = ": ".join(p for p in (where, path_str) if p)
        raise UserError(f"{place}: {message}" if place else message)


def _layer_entry(entry, where: str, fail) -> tuple[str, dict]:
    """A layer is ``name`` or ``{name: {options}}``."""
    if isinstance(entry, str):
        return entry, {}
    if isinstance(entry, dict) and len(entry) == 1:
        (name, options), = entry.items()
        if not isinstance(name, str):
            fail(where, f"a layer is a mixer name or {{name: {{options}}}}, got {entry!r}")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            fail(f"{where}.{name}", f"per-layer options must be a mapping, e.g. {{{name}: {{...}}}}, got {options!r}")
        return name, options
    fail(where, f"a layer is a mixer name or a one-key mapping {{name: {{options}}}}, got {entry!r}")


def _import_modules(data: dict, places: _Places) -> tuple:
    modules = data.pop("imports", None) or []
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        places.fail("imports", f"expected a list of module names, e.g. [my_pkg.my_mixer], got {modules!r}")
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a user module may fail in any way: report it in one line
            places.fail(f"imports.{i}", f"cannot import {name!r}: {type(err).__name__}: {err}")
    return tuple(modules)


def _validate(data: dict, places: _Places, source_name: str) -> Recipe:
    fail = places.fail
    recorded = data["model"].pop("layer_options", None) if isinstance(data.get("model"), dict) else None
    try:
        config = build_options(RecipeConfig, data)
    except OptionError as err:
        fail(err.path, err.message)
    model = config.model
    written = "model.layers" if model.layers is not None else "model.pattern"
    layers = []
    for i, entry in enumerate(model.layer_entries()):
        at = f"{written}.{i if model.layers is not None else i % len(model.pattern)}"
        name, layer_options = _layer_entry(entry, at, fail)
        name_at = at if isinstance(entry, str) else f"{at}.{name}"
        try:
            cls = MIXERS.get(name)
        except OptionError as err:
            fail(name_at, err.message)
        defaults = model.mixer_options.get(name) or {}
        try:
            options = build_options(cls.Options, {**defaults, **layer_options}, "")
        except OptionError as err:
            head = err.path.split(".")[0] if err.path else ""
            owner = name_at if (head in layer_options or (not head and layer_options)) else f"model.mixer_options.{name}"
            fail(owner + (f".{err.path}" if err.path else ""), err.message)
        layers.append(Spec(name, options))
    for name, options in model.mixer_options.items():  # defaults of types no layer uses are checked too
        try:
            build_options(MIXERS.get(name).Options, options or {}, "")
        except OptionError as err:
            fail(f"model.mixer_options.{name}" + (f".{err.path}" if err.path else ""), err.message)
    try:
        sm_cls = STATE_MIXERS.get(model.state_mixer)
    except OptionError as err:
        fail("model.state_mixer", err.message)
    try:
        state_mixer = Spec(model.state_mixer, build_options(sm_cls.Options, model.state_mixer_options, ""))
    except OptionError as err:
        fail("model.state_mixer_options" + (f".{err.path}" if err.path else ""), err.message)
    task_values = dict(config.task)
    task_name = task_values.pop("name", None)
    if task_name is None:
        fail("task.name", f"missing; choose one of {', '.join(TASKS.names())}")
    if not isinstance(task_name, str):
        fail("task.name", f"expected a task name, got {task_name!r}; choose one of {', '.join(TASKS.names())}")
    try:
        task_cls = TASKS.get(task_name)
    except OptionError as err:
        fail("task.name", err.message)
    try:
        task = Spec(task_name, build_options(task_cls.Options, task_values, ""))
    except OptionError as err:
        fail("task" + (f".{err.path}" if err.path else ""), err.message)
    _check_test_time(config.eval, layers, fail)
    _check_task_fit(config, layers, task_cls(task.options), written, fail)
    eval_tasks = resolve_eval_tasks(config.eval.tasks, task, config.eval.seq_lens, fail)
    for length in config.eval.seq_lens:  # the training task is tested at these lengths too
        try:
            task_cls(task.options).check_length(length)
        except ValueError as err:
            fail("eval.seq_lens", f"{err}; drop that length or lower the task's size")
    plain = _plain(config, layers, state_mixer, task, eval_tasks)
    if recorded is not None and recorded != plain["model"]["layer_options"]:  # a recorded recipe's derived copy
        fail("model.layer_options", "disagrees with model.layers and model.mixer_options, from which it is derived; "
                                    "remove model.layer_options (it is only a record)")
    return Recipe(config=config, layers=layers, state_mixer=state_mixer, task=task, plain=plain, source=source_name,
                  eval_tasks=eval_tasks)


def _check_task_fit(config: RecipeConfig, layers: list[Spec], task: Task, written: str, fail) -> None:
    """The task accepts every layer (e.g. only causal mixers for next-token prediction), and a token budget
    ``train.tokens`` becomes ``train.steps``."""
    problem = layer_problem(task, layers)
    if problem is not None:
        index, message = problem
        fail(f"{written}.{index if config.model.layers is not None else index % len(config.model.pattern)}", message)
    t = config.train
    if t.tokens:
        t.steps = max(1, math.ceil(t.tokens / (t.batch_size * task.seq_len)))
        if t.warmup_steps > t.steps:
            fail("train.warmup_steps", f"{t.warmup_steps} exceeds the {t.steps} steps that train.tokens={t.tokens} "
                                       f"makes; lower warmup_steps or raise tokens")


# --------------------------------------------------------------------------------------- eval.tasks
def resolve_eval_tasks(entries: list, train_task: Spec, seq_lens: list[int],
                       fail: Callable[[str, str], None]) -> list[tuple[str, Spec]]:
    """``[(label, Spec)]`` of the ``eval.tasks`` entries, validated (also against the ``eval.seq_lens``
    they will be generated at); ``fail(path, message)`` raises."""
    train_vocab = Task.from_spec(train_task).vocab_size
    inherited = {f.name: getattr(train_task.options, f.name) for f in fields(train_task.options)}
    out, seen = [], set()
    for i, entry in enumerate(entries):
        at = f"eval.tasks.{i}"
        values = dict(entry)
        name = values.pop("name", None)
        if not isinstance(name, str):
            fail(f"{at}.name", f"expected a task name, got {name!r}; choose one of {', '.join(TASKS.names())}")
        label = values.pop("label", name)
        if not isinstance(label, str) or not _EVAL_TASK_LABEL.match(label):
            fail(f"{at}.label", f"expected a short name of letters, digits and _.+- (it names the metric "
                                f"test_accuracy@task=<label>), got {label!r}")
        if label in seen:
            fail(f"{at}.label", f"{label!r} is used by two eval.tasks entries; give each a distinct label")
        seen.add(label)
        try:
            cls = TASKS.get(name)
        except OptionError as err:
            fail(f"{at}.name", err.message)
        own = {f.name for f in fields(cls.Options)}
        merged = {k: v for k, v in inherited.items() if k in own}
        merged.update(values)
        try:
            spec = Spec(name, build_options(cls.Options, merged, ""))
        except OptionError as err:
            fail(at + (f".{err.path}" if err.path else ""), err.message)
        task = cls(spec.options)
        if task.vocab_size != train_vocab:
            fail(at, f"task {name!r} here has vocabulary size {task.vocab_size} but the model is trained with "
                     f"{train_vocab}; set its options so the vocabularies match (e.g. vocab_size)")
        for length in seq_lens:
            try:
                task.check_length(length)
            except ValueError as err:
                fail(at, f"{err}; eval.seq_lens asks for {length}: drop that length or lower this entry's facts")
        out.append((label, spec))
    return out


def plain_eval_tasks(eval_tasks: list[tuple[str, Spec]]) -> list[dict]:
    """The resolved entries as JSON data, every option filled in."""
    return [{"label": label, "name": spec.name, **plain_options(spec.options)} for label, spec in eval_tasks]


def _check_test_time(ev, layers: list[Spec], fail) -> None:
    """Every ``eval.test_time`` / ``eval.test_time_sweep`` knob is declared by some mixer, and every value is
    valid for each layer that declares it (checked as the option it overrides)."""
    declared = sorted({k for n in MIXERS.names() for k in MIXERS.get(n).test_time_knobs})
    for section, values in (("eval.test_time", ev.test_time), ("eval.test_time_sweep", ev.test_time_sweep)):
        for knob, value in values.items():
            if knob not in declared:
                fail(f"{section}.{knob}", f"no registered mixer declares a test-time knob {knob!r}"
                                          f"{nearest(knob, declared)} (declared: {', '.join(declared) or 'none'})")
            if section == "eval.test_time_sweep" and (not isinstance(value, list) or not value):
                fail(f"{section}.{knob}", f"expected a non-empty list of values, got {value!r}")
            for v in value if section == "eval.test_time_sweep" else [value]:
                for spec in layers:
                    if knob in MIXERS.get(spec.name).test_time_knobs:
                        try:
                            build_options(type(spec.options), {**plain_options(spec.options), knob: v}, "")
                        except OptionError as err:
                            fail(f"{section}.{knob}", f"{v!r} is not a valid {knob} for {spec.name}: {err.message}")


def layer_label(entry) -> str:
    """``"name"`` or ``"name(option=value,...)"`` for a written layer entry."""
    if isinstance(entry, str):
        return entry
    (name, options), = entry.items()
    inner = ",".join(f"{k}={v}" for k, v in (options or {}).items())
    return f"{name}({inner})" if inner else name


def _plain(config: RecipeConfig, layers: list[Spec], state_mixer: Spec, task: Spec,
           eval_tasks: list[tuple[str, Spec]]) -> dict:
    """The fully resolved recipe as JSON data: every default filled in, layers expanded, options per layer."""
    plain = asdict(config)
    model = plain["model"]
    model["layers"] = config.model.layer_entries()
    model["pattern"] = model["n_layers"] = None
    model["layer_options"] = [plain_options(spec.options) for spec in layers]
    model["state_mixer_options"] = plain_options(state_mixer.options)
    plain["task"] = {"name": task.name, **plain_options(task.options)}
    plain["train"], plain["eval"] = plain_options(config.train), plain_options(config.eval)
    if eval_tasks:  # the entries as resolved, every option filled in
        plain["eval"]["tasks"] = plain_eval_tasks(eval_tasks)
    plain.pop("grid", None)
    plain.pop("seeds", None)  # like the grid, it says which cells run, not what one computes
    return json.loads(json.dumps(plain))


# --------------------------------------------------------------------------------------- comparing and reloading
def recipe_differences(old: dict, new: dict, prefix: str = "", limit: int = 4) -> list[str]:
    """Up to ``limit`` ``"key.path: old -> new"`` lines where two plain recipes differ."""
    out: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += recipe_differences(a, b, path + ".", limit - len(out))
        elif a != b:
            out.append(f"{path}: {a!r} -> {b!r}")
        if len(out) >= limit:
            break
    return out[:limit]


def recipe_mapping(plain: dict, imports: list[str] = ()) -> dict:
    """A recipe mapping that :func:`resolve` turns back into the recipe of ``plain`` (same key): the
    expanded layer entries stay, the derived per-layer option lists go."""
    data = dict(plain)
    model = dict(data["model"])
    model.pop("layer_options", None)
    for derived in ("pattern", "n_layers"):
        if model.get(derived) is None:
            model.pop(derived, None)
    data["model"] = model
    if imports:
        data["imports"] = list(imports)
    return data


# --------------------------------------------------------------------------------------- grids
def _short(value) -> str:
    if isinstance(value, list):
        return "+".join(layer_label(v) if isinstance(v, (str, dict)) else str(v) for v in value)
    return str(value)


def _check_grid_key(key, where: str) -> None:
    if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
        raise UserError(f"{where}: a grid key is a key.path such as train.lr, got {key!r}")


def expand_grid(grid) -> list[tuple[str, dict]]:
    """``[(label, {key.path: value})]`` for every cell of the grid (one empty cell without a grid)."""
    if grid is None or grid == {}:
        return [("base", {})]
    if isinstance(grid, dict):
        keys = list(grid)
        for key in keys:
            _check_grid_key(key, f"grid.{key}")
            if not isinstance(grid[key], list) or not grid[key]:
                raise UserError(f"grid.{key}: expected a non-empty list of values to try")
        cells = []
        for values in itertools.product(*(grid[k] for k in keys)):
            overrides = dict(zip(keys, values))
            cells.append((" ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in overrides.items()), overrides))
        return cells
    if isinstance(grid, list):
        if not grid:
            raise UserError("grid: the list of cells is empty")
        cells = []
        for i, cell in enumerate(grid):
            if not isinstance(cell, dict):
                raise UserError(f"grid.{i}: expected a mapping of key.path: value overrides")
            cell = dict(cell)
            label = cell.pop("label", None)
            if label is not None and not isinstance(label, (str, int, float)):
                raise UserError(f"grid.{i}.label: expected a short name, got {label!r}")
            for key in cell:
                _check_grid_key(key, f"grid.{i}.{key}")
            label = str(label or " ".join(f"{k}={_short(v)}" for k, v in cell.items()) or f"cell{i}")
            cells.append((label, cell))
        labels = [c[0] for c in cells]
        dupes = {x for x in labels if labels.count(x) > 1}
        if dupes:
            raise UserError(f"grid: duplicate cell labels {sorted(dupes)}; give each cell a distinct label")
        return cells
    raise UserError("grid: expected a mapping of key.path -> list, or a list of override mappings")


def cross_seeds(cells: list[tuple[str, dict]], seeds: list[int] | None) -> list[tuple[str, dict]]:
    """Every cell once per seed (cell-major order), each keeping its label; ``cells`` unchanged without seeds.

    A cell that sets ``seed`` itself cannot also be crossed with the recipe's ``seeds``: that would run
    some cells with other seeds than the rest of the comparison.
    """
    if seeds is None:
        return cells
    out = []
    for label, overrides in cells:
        if "seed" in overrides:
            raise UserError(f"grid cell {label!r} sets seed: {overrides['seed']!r}, but the recipe runs every cell "
                              f"with seeds: {seeds}; remove the cell's seed (or the seeds list)")
        out += [(label, {**overrides, "seed": seed}) for seed in seeds]
    return out


# --------------------------------------------------------------------------------------- the one pass
def resolve(recipe: str | Path | Mapping, overrides=()) -> Recipe:
    """The one way a recipe becomes a :class:`Recipe`: extends -> overrides -> validation.

    ``recipe`` is a YAML path or an already-loaded mapping; ``overrides`` is a list of ``key.path=value``
    strings or a mapping ``{key.path: value}``. A recipe with a ``grid`` also gets ``cells``: every cell
    resolved the same way (base + overrides + the cell's overrides), all validated before anything runs.
    With ``seeds: [s, ...]`` every cell (or the recipe itself, without a grid) runs once per seed under
    its own label.
    """
    if isinstance(recipe, Mapping):
        data, source, name = copy.deepcopy(dict(recipe)), Source(), "<recipe>"
        _check_size(data, name)
    else:
        data, source = load_raw(recipe)
        name = str(recipe)
    items = overrides.items() if isinstance(overrides, Mapping) else [parse_override(t) + (t,) for t in overrides]
    override_paths = {}
    for item in items:
        if isinstance(overrides, Mapping):
            key, value = item
            path, label = _key_path(key), f"override {key}={value!r}"
        else:
            path, value, text = item
            label = f"override {text!r}"
        apply_override(data, path, copy.deepcopy(value), label)
        override_paths[tuple(path)] = label
    places = _Places(source, override_paths)
    imports = _import_modules(data, places)
    grid = data.pop("grid", None)
    base = _validate(data, places, name)
    base.config.grid, base.imports = grid, imports
    if grid is not None or base.config.seeds is not None:
        for label, cell_overrides in cross_seeds(expand_grid(grid), base.config.seeds):
            cell_data = copy.deepcopy(data)
            cell_paths = dict(override_paths)
            for key, value in cell_overrides.items():
                path = _key_path(key)
                where = f"grid cell {label!r}: {key}"
                apply_override(cell_data, path, copy.deepcopy(value), where)
                cell_paths[tuple(path)] = where
            cell = _validate(cell_data, _Places(source, cell_paths), name)
            cell.imports = imports
            base.cells.append(Cell(label, cell_overrides, cell))
    _refuse_identical_cells(base.cells)
    return base


def _refuse_identical_cells(cells: list[Cell]) -> None:
    """Two grid cells that resolve to one recipe would train the same thing twice under two labels."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        twin = seen.setdefault(cell.recipe.key, cell)
        if twin is not cell:
            raise UserError(f"grid cells {twin.label!r} and {cell.label!r} resolve to the same recipe "
                            f"(seed {cell.recipe.seed}); remove one of them or make them differ")
