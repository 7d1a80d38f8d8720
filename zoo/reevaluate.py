"""``zoo eval`` and :func:`zoo.evaluate`: a trained model evaluated again without retraining.

The checkpoint carries its resolved recipe; :func:`eval_recipe` re-resolves it with overrides that leave the
trained model as it is:

- ``eval.*``: other test lengths (``eval.seq_lens=[64,128]``), test-time knob values
  (``eval.test_time={knob: v}``, ``eval.test_time_sweep``), other tasks with the same vocabulary
  (``eval.tasks``), the evaluation batch size;
- ``task.<option>`` for options that keep the task's vocabulary (e.g. ``task.num_test``,
  ``task.seq_len``, ``task.num_kv_pairs``), never ``task.name``, and ``task.tokenizer`` only naming the
  tokenizer the model was trained with;
- ``seed`` (it selects the generated test data of a synthetic task; a language model's validation windows
  are fixed, so it changes none of its numbers), ``train.device``, ``train.threads``,
  ``train.precision``, ``name``, ``description``, ``imports``;
- a mixer's kernel ``backend`` (``model.mixer_options.gla.backend=torch``, ``model.layers.1.gla.backend=torch``):
  the backends compute the same function, so a checkpoint trained with ``backend: triton`` on a GPU evaluates on a
  CPU with ``backend=torch`` (only for a checkpoint: :func:`evaluate` of a run's in-memory model keeps its layers).

Every other override (``model.*``, the rest of ``train.*``) describes how the checkpoint was trained,
and is refused with a one-line error. Without overrides, evaluation repeats the end-of-training
evaluation (:func:`zoo.training.evaluation.test_metrics`) exactly (same data, same code path, same numbers
on a CPU with the recipe's threads). Rows go to ``results.jsonl`` in the format of ablation rows
(:func:`zoo.rows.make_row`), with ``trained_recipe_key`` (the checkpoint's recipe) added: an eval row is
never a finished ablation cell or a seed of one. ``zoo eval --out`` into an ablation's folder holds the
folder's lock while it evaluates and appends, names the evaluated cell in the row's label
(``mamba2 eval eval.seq_lens=[64]``), and its rows are listed apart from the grid's cells.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping

from .config import Recipe
from .errors import UserError
from .experiments.results import read_layout
from .model import HybridLM
from .recipes import resolve
from .recipes.overrides import parse_override
from .recipes.plain import recipe_mapping
from .rows import make_row
from .tasks import Task
from .threads import torch_threads
from .training import checkpoint as ckpt
from .training.device import resolve_device, resolve_precision
from .training.evaluation import test_metrics

ALLOWED_PREFIXES = ("eval", "task", "seed", "name", "description", "imports", "train.device", "train.threads",
                    "train.precision")
WHY = ("zoo eval may change only eval.*, task options that keep the vocabulary, seed (the test data), "
       "train.device/threads/precision and a mixer's kernel backend")


def is_backend_override(key: str) -> bool:
    """``model.<...>.backend``: a mixer's kernel backend, which computes the same function with the same weights."""
    return key.startswith("model.") and key.endswith(".backend")

def _override_items(overrides) -> list[tuple[str, object, str]]:
    if isinstance(overrides, Mapping):
        return [(k, v, f"{k}={v!r}") for k, v in overrides.items()]
    items = []
    for text in overrides:
        path, value = parse_override(text)
        items.append((".".join(str(p) for p in path), value, text))
    return items


def relative_paths(plain: dict) -> list[str]:
    """``task.<option>=<value>`` of each file path in a stored recipe's task that is relative (read from the folder
    the command runs in): ``path`` (globs, ``;`` between several), ``data_dir``, a tokenizer file."""
    task = plain.get("task") if isinstance(plain.get("task"), dict) else {}
    found = []
    for option in ("path", "data_dir", "tokenizer"):
        value = task.get(option)
        if not isinstance(value, str) or not value:
            continue
        parts = [part for part in value.split(";") if part] if option == "path" else [value]
        if option == "tokenizer":  # else a name: bytes, or a Hub tokenizer
            parts = [part for part in parts if part.endswith(".json") or "/" in part or os.sep in part]
        if any(not os.path.isabs(os.path.expanduser(part)) for part in parts):
            found.append(f"task.{option}={value}")
    return found


def checkpoint_recipe(path, plain: dict, imports: list[str] = ()) -> Recipe:
    """The resolved recipe a checkpoint at ``path`` stores as ``plain``; a recipe this version of mixer-zoo no longer
    accepts (an option renamed or removed since it was written) is refused naming the checkpoint, not as if the
    user had written it. One that names files by relative paths (a corpus, a tokenizer), read here from another
    folder than the one it was trained in, is refused saying so."""
    try:
        return resolve(recipe_mapping(plain, imports))
    except UserError as err:
        if str(err).startswith("imports"):  # a module the user named that does not import: theirs to fix
            raise
        relative = relative_paths(plain)
        if relative:
            raise UserError(f"{path}: the recipe stored in this checkpoint does not resolve here: {err}; it names "
                            f"{', '.join(relative)} relative to the folder it was trained in, and this command reads "
                            f"them from {os.getcwd()}: run it from the folder the run was trained in") from None
        raise UserError(f"{path}: the recipe stored in this checkpoint does not resolve here: {err} (a checkpoint "
                        f"written by another mixer-zoo version needs that version)") from None


def with_backends(plain: dict, imports: list[str], overrides, command: str) -> Recipe | None:
    """The checkpoint's recipe (stored as ``plain``, already read by :func:`checkpoint_recipe`) with the kernel
    backends ``overrides`` choose (:func:`is_backend_override`), to build its trained model with; None without
    overrides. Any other override is refused naming ``command``: it would change the trained model."""
    items = _override_items(overrides)
    if not items:
        return None
    for key, _value, text in items:
        if not is_backend_override(key):
            raise UserError(f"{command}: override {text!r}: only a mixer's kernel backend may change here "
                            f"(e.g. model.mixer_options.gla.backend=torch); anything else would change the trained "
                            f"model")
    return resolve(recipe_mapping(plain, imports), overrides)


def eval_recipe(plain: dict, imports: list[str] = (), overrides=(), path="checkpoint") -> tuple[Recipe, Recipe]:
    """``(trained, for_eval)``: the checkpoint's recipe and the one with the evaluation overrides,
    after checking that no override changes the trained model."""
    base = recipe_mapping(plain, imports)
    for key, _value, text in _override_items(overrides):
        allowed = is_backend_override(key) or any(key == p or key.startswith(p + ".") for p in ALLOWED_PREFIXES)
        if key == "task.name" or not allowed:
            raise UserError(f"zoo eval: override {text!r} would change the trained model; {WHY}")
    trained = checkpoint_recipe(path, plain, imports)
    if trained.train.tokens:  # the steps it trained: another task.seq_len must not derive another count from tokens
        base = {**base, "train": {**base.get("train", {}), "tokens": 0, "steps": trained.train.steps}}
    new = resolve(base, overrides)
    if new.task.name != trained.task.name:
        raise UserError(f"zoo eval: the task must stay {trained.task.name!r}; {WHY}")
    old_vocab, new_vocab = Task.from_spec(trained.task).vocab_size, Task.from_spec(new.task).vocab_size
    if old_vocab != new_vocab:
        raise UserError(f"zoo eval: these task options change the vocabulary from {old_vocab} to {new_vocab}, "
                        f"which the trained embedding cannot read; {WHY}")
    return trained, new


def load_model(state: dict, recipe: Recipe, device, path: str | Path = "checkpoint") -> HybridLM:
    """The trained model of a checkpoint's ``state`` (read from ``path``), built from its ``recipe``; weights it
    cannot take are refused in one line (:func:`zoo.training.checkpoint.check_weights_fit`)."""
    model = HybridLM.from_recipe(recipe, Task.from_spec(recipe.task).vocab_size)
    ckpt.check_weights_fit(path, state["model"], model, recipe,
                           "use it with the task options (tokenizer) and the mixer-zoo version it was trained with")
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def refuse_another_tokenizer(trained: Recipe, recipe: Recipe, task: Task, recorded: Callable[[], str | None]) -> None:
    """Refuse a ``task.tokenizer`` override naming a tokenizer other than the one the model was trained with (whose
    contents fingerprint ``recorded()`` gives): one of the same size reads the weights but gives other ids for the same
    text. The same tokenizer under another path passes; without a record (prepared shards, older checkpoints) nothing
    is checked."""
    old, new = getattr(trained.task.options, "tokenizer", None), getattr(recipe.task.options, "tokenizer", None)
    if old == new:
        return
    fingerprint = recorded()
    if fingerprint is None or ckpt.tokenizer_record(task).get("tokenizer_fingerprint") == fingerprint:
        return
    raise UserError(f"zoo eval: override task.tokenizer={new}: the model was trained on the ids of tokenizer {old!r}, "
                    f"and this one has other contents; drop the override; {WHY}")


def refuse_ablation_folder(given: Path) -> None:
    """Refuse an ablation's folder (or its ``checkpoints`` folder) given for a checkpoint, naming its cells'
    checkpoints: it holds one per cell, none at its top."""
    folder = given.parent if given.name == "checkpoints" else given
    layout = read_layout(folder) if given.is_dir() else None
    if layout is None:
        return
    cells = [f"{folder / 'checkpoints' / c['key']} ({c['label']})" for c in layout["cells"]
             if (folder / "checkpoints" / c["key"] / ckpt.FILENAME).exists()]
    where = f"{given} is the checkpoints folder of an ablation" if folder != given else f"{given} is an ablation's folder"
    raise UserError(f"{where}, with a checkpoint per cell under {folder / 'checkpoints'}/<recipe key>: "
                    + (f"give one of {', '.join(cells)}" if cells else
                       "none of its cells has one (not trained yet, or its checkpoints were removed: run the zoo "
                       "ablate command again to train the missing ones)"))


def evaluate_checkpoint(location: str | Path, overrides=(), label: str = "") -> dict:
    """Evaluate the checkpoint at ``location`` (a file or its folder); returns a results row
    (``recipe_key``, ``label``, ``recipe``, ``metrics``, environment, ...)."""
    path = ckpt.path_in(location)
    if not path.exists():
        refuse_ablation_folder(path.parent)
    state = ckpt.load(path)
    named = [v for k, v, _t in _override_items(overrides) if k == "imports"]
    for value in named:  # a string would be read as its letters, each imported as a module
        if value is not None and not (isinstance(value, list) and all(isinstance(m, str) and m for m in value)):
            raise UserError(f"override imports={value!r}: expected a list of module names, e.g. [my_pkg.my_mixer]")
    missing = sorted(set(state.get("imports", [])) - {m for value in named for m in (value or [])})
    if missing:  # importing runs code: only what the user names, never what a file names
        raise UserError(f"{path}: trained with components defined in {missing}; zoo eval imports no module "
                        f"named only by a checkpoint: add imports=[{', '.join(missing)}] if you trust them")
    trained, recipe = eval_recipe(state["recipe"], [m for value in named for m in (value or [])], overrides,
                                   path)
    ckpt.check_same_model(path, state, trained.key)
    t = recipe.train
    with torch_threads(t.threads):
        device = resolve_device(t.device)
        # the trained model, with the kernel backends the overrides choose (no other model.* override passes)
        model = load_model(state, recipe, device, path)   # a tokenizer of another size is named here first
        task = Task.from_spec(recipe.task)
        refuse_another_tokenizer(trained, recipe, task, lambda: state.get("tokenizer_fingerprint"))
        ckpt.check_same_tokenizer(path, state, task)
        metrics = {"steps": state["step"]}
        if state.get("diverged_at") is not None:  # as the run's own metrics say why its numbers are not numbers
            metrics["diverged_at_step"] = state["diverged_at"]
        metrics.update(test_metrics(model, recipe, task, device, resolve_precision(t.precision, device)))
        metrics["device"] = str(device)
        items = _override_items(overrides)
        return make_row(recipe, label or " ".join(["eval"] + [text for _k, _v, text in items]), metrics,
                        overrides={k: v for k, v, _t in items}, device=device, checkpoint=str(path),
                        trained_recipe_key=state["recipe_key"], finished=state["finished"])


def evaluate(source, overrides=()) -> dict:
    """Metrics of a trained model: ``source`` is a :class:`zoo.training.loop.TrainResult` or a checkpoint path."""
    if isinstance(source, (str, Path)):
        return evaluate_checkpoint(source, overrides)["metrics"]
    result = source
    if result.recipe is None:
        raise UserError("evaluate: this TrainResult carries no recipe; pass a checkpoint path instead")
    backends = [text for key, _v, text in _override_items(overrides) if is_backend_override(key)]
    if backends:
        raise UserError(f"evaluate: override {backends[0]!r}: a run's model is evaluated with the layers it was built "
                        f"with; pass its checkpoint path to evaluate it with another backend")
    trained, recipe = eval_recipe(result.recipe.plain, ckpt.imports_for(result.recipe), overrides)
    task = Task.from_spec(recipe.task)
    refuse_another_tokenizer(trained, recipe, task,
                             lambda: ckpt.tokenizer_record(Task.from_spec(trained.task)).get("tokenizer_fingerprint"))
    device = next(result.model.parameters()).device
    metrics = {"steps": result.metrics["steps"]} if "steps" in result.metrics else {}
    with torch_threads(recipe.train.threads):  # as a checkpoint's evaluation and the run's own
        metrics.update(test_metrics(result.model, recipe, task, device,
                                    resolve_precision(recipe.train.precision, device)))
    metrics["device"] = str(device)   # the keys and order a checkpoint's evaluation returns
    return metrics
