"""Load, extend, override and validate YAML recipes.

- YAML is read with ``yaml.safe_load`` semantics (no code runs from a recipe).
- ``extends: base.yaml`` (relative to the recipe's folder) deep-merges the recipe over its base;
  lists are replaced, not merged.
- Overrides ``key.path=value`` come from the command line or from an ablation grid; ``value`` is
  parsed as YAML (``train.lr=3e-3``, ``model.layers=[mamba2,attention]``), and integer segments
  index lists (``model.layers.1=attention``).
- Validation is strict: unknown keys, unknown mixers / state mixers / tasks, wrong types and missing
  fields raise :class:`RecipeError`, whose one-line message names the file and line (or the
  command-line override) and suggests the nearest valid names.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mixers import MIXERS, STATE_MIXERS
from mixers.options import OptionError, build_options, nearest

from .config import RecipeConfig


class RecipeError(Exception):
    """A recipe problem, reported to the user as one line (no traceback)."""


@dataclass
class Source:
    """Where every key path of the merged recipe came from: ``path -> "file:line"``."""
    places: dict[tuple, str] = field(default_factory=dict)

    def where(self, path: tuple) -> str:
        while path:
            if path in self.places:
                return self.places[path]
            path = path[:-1]
        return self.places.get((), "")


def _marks(node, prefix: tuple, filename: str, out: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            path = prefix + (key,)
            out[path] = f"{filename}:{key_node.start_mark.line + 1}"
            _marks(value_node, path, filename, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[prefix + (i,)] = f"{filename}:{item.start_mark.line + 1}"
            _marks(item, prefix + (i,), filename, out)


def _read_yaml(path: Path) -> tuple[dict, dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except OSError as err:
        raise RecipeError(f"{path}: cannot read: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark else ""
        problem = (err.problem or err.context or "invalid YAML").strip()
        raise RecipeError(f"{path}{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: YAML syntax error: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}:1: a recipe must be a mapping of sections (model, task, train, ...)")
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
        raise RecipeError(f"{path}: 'extends' forms a cycle ({' -> '.join(str(p) for p in _seen)})")
    data, marks = _read_yaml(path)
    base_name = data.pop("extends", None)
    source = Source()
    if base_name is not None:
        if not isinstance(base_name, str):
            raise RecipeError(f"{marks.get(('extends',), path)}: extends must be a file name")
        base_path = (path.parent / base_name)
        if not base_path.exists():
            raise RecipeError(f"{marks.get(('extends',), path)}: extends: no such file {base_path}")
        base, source = load_raw(base_path, _seen + (path.resolve(),))
        data = _merge(base, data)
    source.places.update(marks)
    return data, source


def _parse_override(text: str) -> tuple[list, Any]:
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.path=value, e.g. train.lr=3e-3 or model.layers.1=attention")
    key, _, value_text = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: the value {value_text!r} is not valid YAML (quote strings with spaces)") from None
    path = [int(p) if p.lstrip("-").isdigit() else p for p in key.split(".")]
    return path, value


def apply_override(data: dict, path: list, value: Any, label: str) -> None:
    """Set ``path`` in ``data`` (creating mappings as needed); ``label`` names the override in errors."""
    if path[:2] == ["model", "layers"] and len(path) > 2:
        model = data.setdefault("model", {})
        if "layers" not in model and "pattern" in model and "n_layers" in model:
            pattern = model["pattern"]
            model["layers"] = [pattern[i % len(pattern)] for i in range(model["n_layers"])]
    node = data
    for i, part in enumerate(path[:-1]):
        here = ".".join(map(str, path[: i + 1]))
        if isinstance(node, list):
            if not isinstance(part, int) or not -len(node) <= part < len(node):
                raise RecipeError(f"{label}: {here}: index out of range (the list has {len(node)} items)")
            node = node[part]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise RecipeError(f"{label}: {here} is a {type(node).__name__}, not a mapping or list")
    last = path[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or not -len(node) <= last < len(node):
            where = ".".join(map(str, path))
            raise RecipeError(f"{label}: {where}: index out of range (the list has {len(node)} items)")
        node[last] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise RecipeError(f"{label}: {'.'.join(map(str, path[:-1]))} is not a mapping or list")


def _validate(data: dict, source: Source, override_paths: dict) -> RecipeConfig:
    def place(path_str: str) -> str:
        parts = tuple(int(p) if p.isdigit() else p for p in path_str.split(".")) if path_str else ()
        for length in range(len(parts), 0, -1):
            if parts[:length] in override_paths:
                return override_paths[parts[:length]]
        for path, label in override_paths.items():  # an override created this key (e.g. a typo in its path)
            if parts and path[:len(parts)] == parts and parts not in source.places:
                return label
        return source.where(parts)

    def fail(path_str: str, message: str):
        where = place(path_str)
        raise RecipeError(f"{where}: {path_str}: {message}" if where else f"{path_str}: {message}")

    try:
        recipe = build_options(RecipeConfig, data)
    except OptionError as err:
        fail(err.path, err.message)
    # names and options of mixers, state mixers and the task
    model = recipe.model
    layers = model.resolved_layers()
    where_layers = "model.layers" if model.layers is not None else "model.pattern"
    for i, name in enumerate(model.layers if model.layers is not None else model.pattern):
        try:
            MIXERS.get(name)
        except OptionError as err:
            fail(f"{where_layers}.{i}", err.message)
    for name, options in model.mixer_options.items():
        try:
            cls = MIXERS.get(name)
            build_options(cls.Options, options or {}, "")
        except OptionError as err:
            fail(f"model.mixer_options.{name}" + (f".{err.path}" if err.path else ""), err.message)
    try:
        cls = STATE_MIXERS.get(model.state_mixer)
        build_options(cls.Options, model.state_mixer_options, "")
    except OptionError as err:
        key = "model.state_mixer" if not err.path else f"model.state_mixer_options.{err.path}"
        fail(key, err.message)
    from .tasks import TASKS  # late: tasks import heavy modules
    task = dict(recipe.task)
    name = task.pop("name", None)
    if name is None:
        fail("task.name", f"missing; choose one of {', '.join(TASKS.names())}")
    try:
        task_cls = TASKS.get(name)
        build_options(task_cls.Options, task, "")
    except OptionError as err:
        fail("task.name" if not err.path else f"task.{err.path}", err.message)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] = ()) -> tuple[RecipeConfig, dict]:
    """Read, extend, override and validate. Returns the typed recipe and its resolved plain dict."""
    data, source = load_raw(path)
    override_paths = {}
    for text in overrides:
        key, value = _parse_override(text)
        label = f"override {text!r}"
        apply_override(data, key, value, label)
        override_paths[tuple(key)] = label
    recipe = _validate(data, source, override_paths)
    return recipe, to_plain(recipe)


def recipe_from_dict(data: dict, overrides: dict | None = None, label: str = "grid cell") -> RecipeConfig:
    """Validate an already-merged recipe dict plus ``{key.path: value}`` overrides (ablation cells)."""
    data = copy.deepcopy(data)
    override_paths = {}
    for key, value in (overrides or {}).items():
        path = [int(p) if p.lstrip("-").isdigit() else p for p in key.split(".")]
        apply_override(data, path, copy.deepcopy(value), f"{label} {key}")
        override_paths[tuple(path)] = f"{label} {key}"
    return _validate(data, Source(), override_paths)


def to_plain(recipe: RecipeConfig) -> dict:
    """The fully resolved recipe as JSON-compatible data (every default filled in)."""
    plain = asdict(recipe)
    plain["model"]["layers"] = recipe.model.resolved_layers()
    return json.loads(json.dumps(plain))
