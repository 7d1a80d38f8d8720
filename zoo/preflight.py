"""Checks a resolved recipe must pass before anything trains (``zoo check``, and every cell of
``zoo ablate`` before the first one starts): what option ranges cannot see.

- the model builds (sizes that divide, heads that fit) and the task generates at every length;
- the device exists here (``train.device=cuda`` on a machine without CUDA is one line, not a traceback), and so
  does the package ``train.tracking`` logs with (``pip install 'mixer-zoo[tracking]'``);
- every layer's kernel backend can run on that device: one forward pass of a few tokens, where a backend
  that cannot run (Triton on a CPU without the interpreter, a CUDA-only outside library) says so in one
  line;
- no layer is structurally dead (:meth:`mixers.base.Mixer.dead_at`) at the training length or at any
  ``eval.seq_lens`` length: a layer whose options keep every output independent of the input there (SKA
  chunk-causal with ``chunk_size`` >= the length) would train as a silent zero.

Each failure is a :class:`zoo.errors.UserError` naming the recipe and what to change.

:func:`refuse_unrunnable` is the cheap part of these checks that ``zoo ablate`` runs on every cell still to
train before the first one starts, where the cells train on this machine: a cell that cannot start here (its
device, its tracking package, a layer's chosen backend) would otherwise fail only when its turn comes, after
the cells before it trained, and fail again at every re-run.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

from kernels.backend import BackendUnavailable
from mixers import MIXERS
from mixers.options import OptionError

from .config import ModelConfig, Recipe
from .errors import UserError
from .model import HybridLM
from .tasks import Task
from .training.device import autocast, resolve_device

#: the package each ``train.tracking`` choice imports, with the one line a missing one gives
TRACKING_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}

#: tokens in the trial forward pass: enough to reach every chunked code path once, cheap on any device
TRIAL_TOKENS = 8


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _keys_under(path: str, cell_keys: dict) -> str:
    """The keys of a grid cell (``{key: value}``) at, below or above the recipe key ``path``, as ``key=value``."""
    keys = [f"{k}={v}" for k, v in cell_keys.items() if k == path or k.startswith(f"{path}.") or
            path.startswith(f"{k}.")]
    return f"; this cell sets {', '.join(keys)}" if keys else ""


def build_checked(recipe: Recipe, where: str = "", cell_keys: dict | None = None) -> tuple[HybridLM, Task]:
    """The untrained model and the task of ``recipe`` on its device, after a trial forward pass; ``where`` and
    ``cell_keys`` (the keys of the grid cell ``recipe`` is, if it is one) are how a refusal names it."""
    where = where or recipe.source or "recipe"
    try:
        device = resolve_device(recipe.train.device)
    except UserError as err:  # a grid cell's own train.device: the refusal names the cell
        raise UserError(f"{where}: {err}") from None
    problem = _tracking_problem(recipe.train.tracking)
    if problem:  # zoo train and zoo ablate refuse it before training: so does the check
        raise UserError(f"{where}: {problem}")
    try:
        task = Task.from_spec(recipe.task)
        model = HybridLM.from_recipe(recipe, task.vocab_size).to(device)
    except OptionError as err:  # a layer or the state mixer refused its options: it names the key that holds them
        if cell_keys is None:
            raise
        raise UserError(f"{where}: {err}{_keys_under(err.path, cell_keys)}") from None  # and which cell it is
    except (ArithmeticError, RuntimeError, MemoryError) as err:  # sizes no option range caught
        raise UserError(f"{where}: the model cannot be built ({_first_line(err)}); check the model and "
                        f"task sizes") from None
    sample = task.generate(1, task.seq_len, torch.Generator().manual_seed(recipe.seed))
    check_alive([block.mixer for block in model.blocks], [task.seq_len, *recipe.eval.seq_lens], where,
                layer_names(recipe.model))
    ids = sample.inputs[:, :TRIAL_TOKENS].to(device)
    mask = None if sample.mask is None else sample.mask[:, :TRIAL_TOKENS].to(device)
    try:
        with torch.no_grad(), _outputs_checked(model, where, layer_names(recipe.model)):
            model(ids, mask=mask)
    except BackendUnavailable as err:
        raise UserError(f"{where}: {err}") from None
    return model, task


@contextlib.contextmanager
def _outputs_checked(model: HybridLM, where: str, names: list[str]):
    """Within the block, a layer's mixer or state mixer whose output is not the shape of its input (an out-of-tree
    one of the wrong width) is refused naming the layer, before the residual sum fails in a shape error."""
    def check(i: int, part: str, name: str):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            if isinstance(y, torch.Tensor) and y.shape != args[0].shape:
                raise UserError(f"{where}: layer {i} ({name}): its {part} {type(module).__name__} returned shape "
                                f"{tuple(y.shape)} for an input of shape {tuple(args[0].shape)}; a {part} maps "
                                f"(batch, T, d_model) to the same shape")
        return hook
    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.mixer.register_forward_hook(check(i, "mixer", names[i])))
        if block.state_mixer is not None:
            handles.append(block.state_mixer.register_forward_hook(check(i, "state mixer", block.state_mixer.name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def layer_names(model: ModelConfig) -> list[str]:
    """How a refusal names every layer, in the recipe's words: its place where the recipe writes it
    (``model.layers.<i>``, or ``model.pattern.<j>`` for a pattern), its mixer and, where it has options, the key
    that holds them (:meth:`zoo.config.ModelConfig.layer_option_keys`)."""
    written = "model.layers" if model.layers is not None else "model.pattern"
    names = []
    for i, ((mixer, _own), (key, note)) in enumerate(zip(model.named_layer_entries(), model.layer_option_keys())):
        place = f"{written}.{i if model.layers is not None else i % len(model.pattern)}"
        if key == place:
            names.append(f"{place} ({mixer})")
            continue
        over = f", {note.strip()[1:-1]}" if note and key.startswith(place) else ""  # own options over defaults
        names.append(f"{place} ({mixer}, options in {key}{over})")
    return names


def check_alive(mixers: list, lengths: list[int], where: str, names: list[str] | None = None) -> None:
    """Refuse a layer that cannot contribute at one of ``lengths`` (the training length first); ``names``: how
    each layer is named (:func:`layer_names`; by default ``model.layers.<i> (<mixer>)``)."""
    for i, mixer in enumerate(mixers):
        dead_at = getattr(mixer, "dead_at", None)  # a registered class outside the Mixer base has none
        for n, seq_len in enumerate(lengths):
            reason = dead_at(seq_len) if dead_at is not None else None
            if reason is not None:
                at = "the training length" if n == 0 else "an eval.seq_lens length"
                layer = names[i] if names else f"model.layers.{i} ({mixer.name})"
                raise UserError(f"{where}: {layer} cannot contribute at seq_len {seq_len} ({at}): {reason}")


def _meta_mixers(recipe: Recipe) -> list | None:
    """The recipe's mixers built on the meta device (no memory, no initialisation); None if one cannot be
    built there (the model's own build then reports it in the recipe's words)."""
    try:
        with torch.device("meta"):
            return [MIXERS.get(spec.name)(recipe.model.d_model, spec.options) for spec in recipe.layers]
    except (ValueError, TypeError, ArithmeticError, RuntimeError, NotImplementedError, MemoryError):
        return None


def refuse_dead_layers(recipe: Recipe, trains: str) -> None:
    """The dead-layer part of :func:`check_recipe` alone (no model, no trial pass), before anything trains, for
    what the command trains (``trains``): ``"base"`` (``zoo train``: a grid's cells are not trained) or ``"cells"``
    (``zoo ablate``: the grid's cells, or the recipe itself without a grid; a grid's base is not trained)."""
    source = recipe.source or "recipe"
    cells = [(c.recipe, f"{source}: grid cell {c.label!r}") for c in recipe.cells]
    for each, where in (cells if trains == "cells" and cells else [(recipe, source)]):
        mixers = _meta_mixers(each)
        if mixers is not None:
            check_alive(mixers, [Task.from_spec(each.task).seq_len, *each.eval.seq_lens], where,
                        layer_names(each.model))


def check_recipe(recipe: Recipe) -> tuple[HybridLM, Task]:
    """Check ``recipe`` and every cell of its grid; returns the base recipe's model and task."""
    for cell in recipe.cells:
        build_checked(cell.recipe, f"{recipe.source or 'recipe'}: grid cell {cell.label!r}", cell.overrides)
    return build_checked(recipe)


def _tracking_problem(kind: str) -> str | None:
    """Why ``train.tracking: kind`` cannot start here (its package is not installed), or None."""
    package = TRACKING_PACKAGES.get(kind)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return (f"train.tracking={kind} needs the {package} package: pip install 'mixer-zoo[tracking]' "
            f"(or pip install {package})")


def _backend_problem(spec, d_model: int, device: torch.device, precision: str) -> str | None:
    """Why the layer ``spec``, whose options choose a kernel backend, cannot run on ``device``: one forward pass
    of a few tokens through the mixer alone, under the autocast training uses (``train.precision``: a backend may
    take bf16 and refuse fp32), with the global random state left as it was; or None. Only a refused backend is
    reported; anything else the trial meets is left to the run, which reports it in its own words."""
    with torch.random.fork_rng(devices=[]):  # built on the CPU (the weights' draws), then moved
        try:
            mixer = MIXERS.get(spec.name)(d_model, spec.options).to(device)
            x = torch.randn(1, TRIAL_TOKENS, d_model, generator=torch.Generator().manual_seed(0)).to(device)
            with torch.no_grad(), autocast(device, precision):
                mixer(x)
        except BackendUnavailable as err:
            return str(err)
        except Exception:  # noqa: BLE001 - not this check's to judge: the run reports it where it happens
            return None
    return None


def refuse_unrunnable(cells: list[tuple[Recipe, str]]) -> None:
    """Refuse, before anything trains, the first of ``cells`` (``(recipe, where it comes from)``) that cannot
    start on this machine whatever its data: ``train.device`` that is not here, a ``train.tracking`` package that
    is not installed, or a layer whose options choose a kernel backend that cannot run on the device (``auto``
    always finds one). Each distinct device and layer is tried once; no model is built."""
    tried: dict[tuple, str | None] = {}
    for recipe, where in cells:
        try:
            device = resolve_device(recipe.train.device)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
        problem = _tracking_problem(recipe.train.tracking)
        if problem:
            raise UserError(f"{where}: {problem}; nothing was trained")
        for i, spec in enumerate(recipe.layers):
            if getattr(spec.options, "backend", "auto") == "auto":
                continue
            key = (spec.name, repr(spec.options), recipe.model.d_model, str(device), recipe.train.precision)
            if key not in tried:
                tried[key] = _backend_problem(spec, recipe.model.d_model, device, recipe.train.precision)
            if tried[key]:
                raise UserError(f"{where}: layer {i} ({spec.name}): {tried[key]}; nothing was trained")
