"""Reading recipe files: YAML read safely, every key's file and line recorded, and ``extends`` chains merged.

- YAML is read with ``yaml.safe_load`` (no code runs from a recipe; python object tags are refused),
  and aliases may not expand past a size limit (:data:`MAX_VALUES`) or refer to themselves.
- A key written twice in one mapping is refused (YAML would keep the last one silently).
- A number YAML 1.1 reads in another base than the one it seems written in is refused with how to write it:
  a leading zero makes ``010`` the octal 8 and a colon makes ``1:30`` the base-60 90 (:func:`misread_number`).
- A value written once and repeated through a YAML alias (``layers: [&m {<mixer>: {...}}, *m]``) becomes
  independent copies (:func:`unshared`): an override of one place (``model.layers.0.<mixer>.<option>=...``)
  never changes the others.
- ``extends: base.yaml`` (relative to the recipe's folder) deep-merges the recipe over its base; lists
  are replaced, not merged; a base's ``grid`` is never inherited (a recipe extending an ablation is a
  new recipe, not that ablation). A cycle of ``extends`` is refused.
- A model's layers are ``model.layers`` or ``model.pattern`` repeated to ``model.n_layers``, given one way
  at each level: a file that sets ``layers`` together with ``pattern`` or ``n_layers`` is refused, and a
  level that gives them (a recipe over its base, here; the command line's overrides or a grid cell, see
  :func:`replace_layers`) replaces the other way's keys inherited from below (``layers`` drops an inherited
  ``pattern`` and ``n_layers``, ``pattern`` an inherited ``layers``).

The file itself is read in one place, :func:`read_text`.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from ..paths import read_recipe_text, recipe_file_problem, refuse_foreign_keys

#: the most values a recipe may expand to (YAML aliases can make a small file enormous)
MAX_VALUES = 100_000
#: the keys of ``model`` that give its layers: ``layers``, or ``pattern`` repeated to ``n_layers``
LAYER_KEYS = ("layers", "pattern", "n_layers")


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


#: plain scalars YAML 1.1 reads as numbers in another base: a leading zero (octal) or colons (base 60)
_OTHER_BASE = re.compile(r"[-+]?(?:0[0-9_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)")
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def misread_number(node) -> str | None:
    """Why a plain scalar node's number is not what it seems written as (``010`` is read as 8, ``1:30`` as 90),
    with how to write it; None for every other node."""
    if not isinstance(node, yaml.ScalarNode) or node.style or node.tag not in _NUMBER_TAGS:
        return None
    text = node.value
    if not _OTHER_BASE.fullmatch(text):
        return None
    value = yaml.safe_load(text)
    if ":" in text:
        return (f"YAML reads {text} as the base-60 number {value}; write the number meant, or quote it ('{text}') "
                f"where it is a name")
    decimal = re.sub(r"^([-+]?)[0_]+(?=[0-9])", r"\1", text)
    return (f"YAML reads {text} as the octal number {value}; write {decimal} (no leading zero) for the decimal "
            f"number, or quote it ('{text}') where it is a name")


def misread_value(text: str) -> str | None:
    """:func:`misread_number` of a value written alone (an override's ``VALUE``): its first number written in
    another base, if any."""
    try:
        stack = [yaml.compose(text, Loader=yaml.SafeLoader)]
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            stack.extend(v for _, v in reversed(node.value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
        elif (why := misread_number(node)) is not None:
            return why
    return None


def _marks(node, prefix: tuple, filename: str, out: dict, depth: int = 0) -> None:
    if depth > 100:
        return
    why = misread_number(node)
    if why is not None:
        raise UserError(f"{filename}:{node.start_mark.line + 1}: {why}")
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


def check_size(data: Any, where: str) -> None:
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


def unshared(data: Any) -> Any:
    """``data`` with every mapping and list its own copy (the rest kept as it is): a value that YAML aliases, or a
    caller's mapping, holds at several places becomes one copy per place, so that setting a key at one place (an
    override of one layer's option) leaves the others as written. ``data`` must have passed :func:`check_size`."""
    root = [data]
    stack = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        node = parent[key]
        if isinstance(node, dict):
            node = parent[key] = dict(node)
            stack.extend((node, k) for k in node)
        elif isinstance(node, list):
            node = parent[key] = list(node)
            stack.extend((node, i) for i in range(len(node)))
    return root[0]


def read_text(path: Path) -> str:
    """The text of the recipe file at ``path``: every read of a recipe file goes through here (devices, pipes
    and oversized files are refused before anything is read)."""
    return read_recipe_text(path)


def _parse(text: str, path: Path) -> tuple[Any, yaml.Node]:
    """The data and the node tree of a recipe's text, with YAML's errors as one line naming the file."""
    try:
        return yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
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


def read_yaml(path: Path) -> tuple[dict, dict]:
    """A recipe file's mapping and the ``file:line`` of every key path in it."""
    data, node = _parse(read_text(path), path)
    check_size(data, str(path))
    data = unshared(data)
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


def layer_keys_given(model) -> set:
    """The keys of :data:`LAYER_KEYS` that a level's ``model`` mapping sets (to something other than null)."""
    return {k for k in LAYER_KEYS if isinstance(model, dict) and model.get(k) is not None}


def replace_layers(data: dict, given: set) -> None:
    """Before a later level that sets the keys ``given`` is applied to ``data``: ``model.layers`` there drops the
    ``pattern`` and ``n_layers`` that ``data`` inherited, ``model.pattern`` there drops its ``layers``."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    dropped = ("pattern", "n_layers") if "layers" in given else ("layers",) if "pattern" in given else ()
    for key in dropped:
        model.pop(key, None)


def layers_given_twice(others: list[str], layers_at: str) -> str:
    """The refusal of ``model.<others>`` set together with ``model.layers`` (set at ``layers_at``)."""
    named = " and ".join(f"model.{k}" for k in others)
    if others == ["n_layers"]:
        advice = ("model.n_layers only counts the layers a model.pattern is repeated to; drop model.n_layers, "
                  "or give model.pattern instead of model.layers")
    else:
        advice = (f"give the layers one way: drop {named} to keep model.layers, or drop model.layers to repeat "
                  f"model.pattern to model.n_layers")
    also = f" ({layers_at})" if layers_at else ""
    return f"{named} {'is' if len(others) == 1 else 'are'} set together with model.layers{also}; {advice}"


def _check_layer_keys(data: dict, marks: dict) -> None:
    """One file gives a model's layers one way."""
    given = layer_keys_given(data.get("model"))
    others = [k for k in LAYER_KEYS[1:] if k in given]
    if "layers" in given and others:
        layers_at = marks.get(("model", "layers"), "")
        raise UserError(f"{marks.get(('model', others[0]), layers_at)}: "
                        f"{layers_given_twice(others, 'line ' + layers_at.rsplit(':', 1)[-1])}")


def load_raw(path: str | Path, _seen: tuple = ()) -> tuple[dict, Source]:
    """Read a recipe and its ``extends`` chain into one dict, with the source of every key."""
    path = Path(path)
    if path.resolve() in _seen:
        raise UserError(f"{path}: 'extends' forms a cycle ({' -> '.join(str(p) for p in _seen + (path,))})")
    data, marks = read_yaml(path)
    _check_layer_keys(data, marks)
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
        replace_layers(base, layer_keys_given(data.get("model")))
        data = _merge(base, data)
    source.places.update(marks)
    return data, source
