"""The plain form of a recipe: the fully resolved recipe as JSON data (what a results row records and a recipe
key hashes), a recipe mapping rebuilt from it, the differences between two of them, and a layer's label.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from mixers.options import plain_options

from ..config import RecipeConfig, Spec


def layer_label(entry) -> str:
    """``"name"`` or ``"name(option=value,...)"`` for a written layer entry."""
    if isinstance(entry, str):
        return entry
    (name, options), = entry.items()
    inner = ",".join(f"{k}={v}" for k, v in (options or {}).items())
    return f"{name}({inner})" if inner else name


def plain_eval_tasks(eval_tasks: list[tuple[str, Spec]]) -> list[dict]:
    """The resolved entries as JSON data, every option filled in."""
    return [{"label": label, "name": spec.name, **plain_options(spec.options)} for label, spec in eval_tasks]


def plain_recipe(config: RecipeConfig, layers: list[Spec], state_mixer: Spec, task: Spec,
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
    """A recipe mapping that :func:`zoo.recipes.resolve` turns back into the recipe of ``plain`` (same key): the
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
