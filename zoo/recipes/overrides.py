"""Overrides ``key.path=value``, from the command line or from an ablation grid.

``value`` is parsed as YAML (``train.lr=3e-3``, ``model.layers=[a,b]``), and integer segments index lists
(``model.layers.1=<mixer>``, ``model.layers.1.<mixer>.<option>=value``; the ``<mixer>`` must be the one of
that layer, else the error says which it is and how to replace the layer). An override of one layer of a
recipe written as a ``pattern`` first expands the pattern into its ``n_layers`` layers (which then replace
``pattern`` and ``n_layers``). The overrides of one command line, like the keys of one grid cell, are one
level: they give a model's layers one way (:func:`given_layer_keys`), replacing the other way's inherited keys.
An override sets its key to its value, whatever that is: a mapping value (``train={lr: 0.01}``) replaces the
whole mapping at that key (the other ``train`` keys fall back to their defaults), unlike ``extends:``, which
merges mappings; to change one key, name it (``train.lr=0.01``).
"""
from __future__ import annotations

import copy
from typing import Any

import yaml

from ..errors import UserError
from .loading import check_size, layer_keys_given, misread_value
from .plain import layer_label


def key_path(key: str) -> list:
    """``"a.b.1"`` -> ``["a", "b", 1]``."""
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
    check_size(value, f"override {text!r}")
    why = misread_value(value_text)
    if why is not None:
        raise UserError(f"override {text!r}: {why}")
    return key_path(key), value


def given_layer_keys(path: list, value: Any) -> set:
    """The keys of a model's layers (``layers``, ``pattern``, ``n_layers``) that the override ``path=value`` sets
    to something other than null."""
    if path == ["model"]:
        return layer_keys_given(value)
    return layer_keys_given({path[1]: value}) if len(path) == 2 and path[0] == "model" else set()


def flow_yaml(value: Any) -> str:
    """``value`` as one line of YAML (as an override writes it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def _expand_pattern(data: dict, label: str) -> None:
    """A recipe written as ``pattern`` x ``n_layers`` gets its explicit ``layers`` (so one can be overridden),
    which replace ``pattern`` and ``n_layers``."""
    model = data.get("model")
    if not isinstance(model, dict):  # nothing to expand: setting the layer then names what model is instead
        return
    if model.get("layers") is None and isinstance(model.get("pattern"), list) and isinstance(model.get("n_layers"), int):
        pattern, n_layers = model["pattern"], model["n_layers"]
        if pattern and len(pattern) > n_layers:
            raise UserError(f"{label}: model.pattern has {len(pattern)} layers but model.n_layers is {n_layers}, so the "
                            f"pattern would be cut short; raise model.n_layers or shorten model.pattern")
        model["layers"] = [copy.deepcopy(pattern[i % len(pattern)]) for i in range(max(n_layers, 0))]
        del model["pattern"], model["n_layers"]


def _other_mixer(label: str, path: list, at: int, entry: Any, value: Any) -> None:
    """``model.layers.<i>.<mixer>...=value`` where layer ``i`` is another mixer: refused with what it is and how
    to set its options or replace it."""
    name = path[at + 1]
    here = ".".join(map(str, path[: at + 1]))
    if isinstance(entry, str):
        own, it = entry, f"{entry} (a mixer name, without options of its own)"
    elif isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry)), str):
        own = next(iter(entry))
        it = f"{layer_label(entry)} (a {own} layer with options of its own)"
    else:
        return
    if name == own:
        return
    replacement = value
    for part in reversed(path[at + 1:]):
        replacement = {part: replacement}
    raise UserError(f"{label}: {here} is {it}, not {name}: set one of its options with {here}.{own}.<option>=value, "
                    f"or replace the layer with {here}={flow_yaml(replacement)}")


def _index(label: str, here: str, node: list, part) -> int:
    """The list index ``part`` names in ``node`` (a negative one counts from the end), or a refusal."""
    if not isinstance(part, int):
        items = f"a list of {len(node)} items, indexed 0 to {len(node) - 1}" if node else "an empty list"
        raise UserError(f"{label}: {here}: {part!r} is not an index; {here.rpartition('.')[0]} is {items}")
    if not -len(node) <= part < len(node):
        raise UserError(f"{label}: {here}: index out of range (the list has {len(node)} items)")
    return part % len(node)


def apply_override(data: dict, path: list, value: Any, label: str) -> list:
    """Set ``path`` in ``data`` (creating mappings as needed); ``label`` names the override in errors. Returns the
    key path it set, a negative list index as the index it names (``model.layers.-1`` -> ``model.layers.5``), so
    that errors about that key blame this override."""
    if path[:2] == ["model", "layers"] and len(path) > 2:
        _expand_pattern(data, label)
    path = list(path)
    node = data
    for i, part in enumerate(path[:-1]):
        here = ".".join(map(str, path[: i + 1]))
        if isinstance(node, list):
            part = path[i] = _index(label, here, node, part)
            if i == 2 and path[:2] in (["model", "layers"], ["model", "pattern"]):  # a layer: <mixer>.<option>
                _other_mixer(label, path, i, node[part], value)
            if isinstance(node[part], str) and path[i + 1] == node[part]:
                node[part] = {node[part]: {}}  # model.layers.1.<mixer>.<option>=v on a plain "<mixer>" layer
            node = node[part]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:  # the value at the path so far, not the key that would be looked up in it
            raise UserError(f"{label}: {'.'.join(map(str, path[:i]))} is a {type(node).__name__}, not a mapping or "
                            f"list, so it has no key {part!r}")
    if isinstance(node, list):
        path[-1] = _index(label, ".".join(map(str, path)), node, path[-1])
        node[path[-1]] = value
    elif isinstance(node, dict):
        node[path[-1]] = value
    else:
        raise UserError(f"{label}: {'.'.join(map(str, path[:-1]))} is not a mapping or list")
    return path
