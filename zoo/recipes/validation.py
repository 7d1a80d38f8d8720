"""Validation of a merged, overridden recipe mapping into a :class:`zoo.config.Recipe`.

Strict: unknown keys, unknown mixers / state mixers / tasks, wrong types, values out of range and missing
fields raise :class:`UserError`, whose one-line message names the place (the file and line, or the override)
and suggests the nearest valid names. Beyond each option's own type and range it checks what spans sections:
the layers are given one way (``model.layers``, or ``model.pattern`` no longer than ``model.n_layers``), every
layer's mixer builds at ``model.d_model`` (built on the meta device: its constructor's checks), the task accepts
every layer, a token budget becomes a step count, every test-time knob is declared by a layer of the model it
is given for (a grid's shared knob: by a layer of some cell) and valid for each layer that declares it, and
every ``eval.tasks`` entry and ``eval.seq_lens`` length is one the tasks can generate. A check across options
(``train.batch_size`` against ``train.grad_accum``, a layer against ``model.d_model``) is blamed on the
overrides that set the keys it names, else on the line of the first of them; the key path is written once.
``imports: [my_pkg.my_mixer]`` imports user modules first, so out-of-tree mixers and tasks registered with
``@register_mixer`` / ``@register_task`` can be named.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import fields
from typing import Callable

import torch

from mixers import MIXERS, STATE_MIXERS
from mixers.options import WRITE_AS, OptionError, build_options, failed_assertion, nearest, plain_options

from ..config import Recipe, RecipeConfig, Spec
from ..errors import UserError
from ..paths import recipe_sections
from ..tasks import TASKS, Task
from ..tasks.text import layer_problem
from .loading import LAYER_KEYS, Source, layers_given_twice
from .plain import plain_recipe

#: an eval.tasks label names a metric column (test_accuracy@task=<label>)
_EVAL_TASK_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")
#: a key path named in a message (train.batch_size, seeds)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")
#: (mixer class, d_model, options) already built on the meta device
_BUILT: set = set()


def key_parts(path_str: str) -> tuple:
    """``"model.layers.1"`` -> ``("model", "layers", 1)``."""
    return tuple(int(p) if p.isdigit() else p for p in path_str.split(".")) if path_str else ()


def _repeats(message: str, path_str: str) -> bool:
    """Whether ``message`` starts with the key path ``path_str`` (so the place need not repeat it)."""
    return bool(path_str) and message.startswith(tuple(path_str + end for end in (".", ":", " ")))


class Places:
    """Turns a dotted key path into the place to blame: an override's label, or file:line."""

    def __init__(self, source: Source, override_paths: dict):
        self.source, self.override_paths = source, override_paths

    def __call__(self, path_str: str) -> str:
        return self.at(key_parts(path_str))

    def at(self, parts: tuple) -> str:
        """The place of the key path ``parts`` (a tuple; a grid key with dots is one element)."""
        return self.override_at(parts) or self.source.where(parts)

    def override_at(self, parts: tuple) -> str | None:
        """The label of the override that set the key path ``parts`` (or a mapping above it); None if none did."""
        for length in range(len(parts), 0, -1):
            if parts[:length] in self.override_paths:
                return self.override_paths[parts[:length]]
        for path, label in self.override_paths.items():  # an override created this key (e.g. a typo in its path)
            if parts and path[:len(parts)] == parts and parts not in self.source.places:
                return label
        return None

    def overrides_under(self, parts: tuple, message: str) -> list[str]:
        """The labels of the overrides (a grid cell's keys among them) that set a key below the key path ``parts``
        whose name ``message`` mentions (``model.mixer_options.<mixer>.headdim`` below
        ``model.mixer_options.<mixer>``, for a message that names ``headdim``)."""
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
        return list(dict.fromkeys(label for path, label in self.override_paths.items()
                                  if len(path) > len(parts) and path[:len(parts)] == parts and str(path[-1]) in words))

    def blame(self, paths, fallback: str = "", message: str = "") -> str:
        """The overrides that set any of the key paths ``paths`` or, where none sets one, a key below it that
        ``message`` names; all of them, once each; else the place of ``fallback`` (the first of ``paths`` when not
        given)."""
        labels = []
        for path in paths:
            label = self.override_at(key_parts(path))
            for found in [label] if label is not None else self.overrides_under(key_parts(path), message):
                if found not in labels:
                    labels.append(found)
        return " and ".join(labels) if labels else self(fallback or (list(paths) or [""])[0])

    def how_to_write(self, path_str: str, message: str) -> str:
        """``message`` with its closing ``write it as <value>`` (a type refusal's) naming the key as the place
        that set it writes it: ``key=<value>`` for a command-line override, ``key: <value>`` in a grid cell and,
        in a recipe file, the key's own name (``steps: <value>``)."""
        head, found, value = message.rpartition(WRITE_AS)
        if not found:
            return message
        parts = key_parts(path_str)
        label = self.override_at(parts)
        if label is not None:
            return f"{head}; write {path_str}{'=' if label.startswith('override ') else ': '}{value}"
        if parts and isinstance(parts[-1], str):
            return f"{head}; write {parts[-1]}: {value}"
        return message

    def fail(self, path_str: str, message: str, given: dict | None = None):
        """Refuse the key at ``path_str``. With ``given`` (the mapping at ``path_str``: a section, or the whole
        recipe for ``""``) the problem is a check across its options: it is blamed on the keys it names (before
        the first ``;``) that ``given`` sets, on the overrides that set any of them, else on the first one's line."""
        named = [] if given is None else _named_keys(path_str, message, given)
        if named:
            where = self.blame(named)
            raise UserError(f"{where}: {message}" if where else message)
        where, message = self(path_str), self.how_to_write(path_str, message)
        place = ": ".join(p for p in (where, "" if _repeats(message, path_str) else path_str) if p)
        raise UserError(f"{place}: {message}" if place else message)

    def fail_at(self, parts: tuple, message: str):
        """:meth:`fail` for a key path given as a tuple (a grid key with dots is one element)."""
        where, path_str = self.at(parts), ".".join(map(str, parts))
        raise UserError(": ".join(p for p in (where, path_str, message) if p))


def import_modules(data: dict, places: Places) -> tuple:
    """Import the recipe's ``imports`` (removed from ``data``); their names, in order."""
    modules = data.pop("imports", None) or []
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        places.fail("imports", f"expected a list of module names, e.g. [my_pkg.my_mixer], got {modules!r}")
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a user module may fail in any way: report it in one line
            places.fail(f"imports.{i}", f"cannot import {name!r}: {type(err).__name__}: {err}")
    return tuple(modules)


# --------------------------------------------------------------------------------------- the parts of a recipe
def _registered(registry, name, at: str, fail):
    """The class registered as ``name``, or a failure at ``at`` naming the nearest registered names."""
    try:
        return registry.get(name)
    except OptionError as err:
        fail(at, err.message)


def _options(cls, values: dict, at: str, fail):
    """``cls.Options`` built from ``values``; a bad option fails at ``at.<option path>``."""
    try:
        return build_options(cls.Options, values, "")
    except OptionError as err:
        if not err.path:   # a check across the section's options
            fail(at, err.message, values)
        fail(f"{at}.{err.path}", err.message)


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


def _layer(entry, at: str, mixer_options: dict, fail) -> Spec:
    """One layer's spec: its own options over its type's ``model.mixer_options``; a bad option is blamed on
    the layer when the layer sets it, else on the type's defaults."""
    name, layer_options = _layer_entry(entry, at, fail)
    name_at = at if isinstance(entry, str) else f"{at}.{name}"
    cls = _registered(MIXERS, name, name_at, fail)
    defaults = mixer_options.get(name) or {}
    try:
        options = build_options(cls.Options, {**defaults, **layer_options}, "")
    except OptionError as err:
        head = err.path.split(".")[0] if err.path else ""
        owner = name_at if (head in layer_options or (not head and layer_options)) else f"model.mixer_options.{name}"
        fail(owner + (f".{err.path}" if err.path else ""), err.message)
    return Spec(name, options)


def _layers(model, fail) -> tuple[list[Spec], str]:
    """Every layer's spec, and the key the layers are written under (``model.layers`` or ``model.pattern``);
    the defaults of mixer types no layer uses are checked too."""
    written = "model.layers" if model.layers is not None else "model.pattern"
    layers = []
    for i, entry in enumerate(model.layer_entries()):
        at = f"{written}.{i if model.layers is not None else i % len(model.pattern)}"
        layers.append(_layer(entry, at, model.mixer_options, fail))
    for name, options in model.mixer_options.items():
        try:
            build_options(MIXERS.get(name).Options, options or {}, "")
        except OptionError as err:
            fail(f"model.mixer_options.{name}" + (f".{err.path}" if err.path else ""), err.message)
    return layers, written


def _state_mixer(model, places: Places) -> Spec:
    """The state mixer's spec. An option it has nothing like (one of another state mixer: a grid cell or an override
    that sets ``model.state_mixer: none`` under the recipe's SwiGLU options) names the state mixer and is blamed on
    whatever set either key; a misspelt one names the nearest options."""
    cls = _registered(STATE_MIXERS, model.state_mixer, "model.state_mixer", places.fail)
    own = [f.name for f in fields(cls.Options)]
    for key in model.state_mixer_options:
        if isinstance(key, str) and key not in own and not nearest(key, own):
            at = f"model.state_mixer_options.{key}"
            valid = f"valid: {', '.join(own)}" if own else "it takes no options"
            message = (f"{at}: {model.state_mixer} has no option {key!r} ({valid}); model.state_mixer_options holds "
                       f"the options of model.state_mixer: drop {key} (model.state_mixer_options: {{}} drops them "
                       f"all)")
            where = places.blame(["model.state_mixer", "model.state_mixer_options"], fallback=at, message=message)
            raise UserError(f"{where}: {message}" if where else message)
    return Spec(model.state_mixer, _options(cls, model.state_mixer_options, "model.state_mixer_options", places.fail))


def _task(section: dict, fail) -> tuple[type, Spec]:
    """The task's class and spec from the ``task`` section."""
    values = dict(section)
    name = values.pop("name", None)
    if name is None:
        fail("task.name", f"missing; choose one of {', '.join(TASKS.names())}")
    if not isinstance(name, str):
        fail("task.name", f"expected a task name, got {name!r}; choose one of {', '.join(TASKS.names())}")
    cls = _registered(TASKS, name, "task.name", fail)
    return cls, Spec(name, _options(cls, values, "task", fail))


# --------------------------------------------------------------------------------------- the whole recipe
def _check_top_level_keys(data: dict, fail) -> None:
    """An unknown top-level key of a mapping or an override fails with the nearest recipe section, ``imports`` and
    ``extends`` included (a file's keys were checked when it was read); ``extends`` there has no file beside it
    to resolve the base from."""
    known = {f.name for f in fields(RecipeConfig) if f.init}
    for key in data:
        if key == "extends":
            fail("extends", "'extends' is read only at the top of a recipe file, whose folder holds the base; "
                            "write a recipe file that extends the base, or merge the base's keys in yourself")
        if key not in known:
            sections = recipe_sections()
            fail(str(key), f"unknown option {key!r}{nearest(key, sections)} (valid: {', '.join(sections)})")


def validate(data: dict, places: Places, source_name: str, own_knob: Callable[[str], bool] | None = None) -> Recipe:
    """The :class:`Recipe` of a merged, overridden mapping (``imports`` and ``grid`` already taken out).

    ``own_knob(path)`` says whether the test-time knob at ``eval.test_time[_sweep].<knob>`` was given for this
    model, so that a layer of it must declare the knob (None: every knob, but in a recorded recipe, one with
    ``model.layer_options``, only the overrides' knobs); a knob shared by the cells of a grid need only be declared
    by some registered mixer here (:func:`zoo.recipes.resolve` checks that some cell declares it)."""
    fail = places.fail
    recorded = data["model"].pop("layer_options", None) if isinstance(data.get("model"), dict) else None
    if recorded is not None and own_knob is None:  # a results row's recipe keeps its grid's knobs
        own_knob = lambda path: places.override_at(key_parts(path)) is not None  # noqa: E731
    _check_top_level_keys(data, fail)
    try:
        config = build_options(RecipeConfig, data)
    except OptionError as err:
        if err.path == "model" and isinstance(data.get("model"), dict):  # the model's keys together
            _check_layer_keys(data["model"], places)
        section = data.get(err.path) if err.path else data
        fail(err.path, err.message, section if isinstance(section, dict) else None)
    layers, written = _layers(config.model, fail)
    state_mixer = _state_mixer(config.model, places)
    _check_builds(config.model, layers, written, places)
    task_cls, task = _task(config.task, fail)
    _check_test_time(config.eval, layers, fail, own_knob or (lambda path: True))
    written_steps = config.train.steps
    _check_task_fit(config, layers, task_cls(task.options), written, fail)
    _refuse_overridden_steps(config.train, written_steps, data, places)
    eval_tasks = resolve_eval_tasks(config.eval.tasks, task, config.eval.seq_lens, fail)
    for length in config.eval.seq_lens:  # the training task is tested at these lengths too
        try:
            task_cls(task.options).check_length(length)
        except ValueError as err:
            fail("eval.seq_lens", f"{err}; drop that length or lower the task's size")
    plain = plain_recipe(config, layers, state_mixer, task, eval_tasks)
    if recorded is not None and recorded != plain["model"]["layer_options"]:  # a recorded recipe's derived copy
        fail("model.layer_options", "disagrees with model.layers and model.mixer_options, from which it is derived; "
                                    "remove model.layer_options (it is only a record)")
    return Recipe(config=config, layers=layers, state_mixer=state_mixer, task=task, plain=plain, source=source_name,
                  eval_tasks=eval_tasks)


def _named_keys(section: str, message: str, given: dict) -> list[str]:
    """The key paths under ``section`` that ``message`` names before its first ``;`` and ``given`` (the mapping at
    ``section``) sets to something other than null, in order, once each."""
    named = []
    for token in _KEY.findall(message.split(";")[0]):
        if section and "." not in token and _given(given, token):  # a section's own check (a task's) names options bare
            token = f"{section}.{token}"
        inside = token[len(section) + 1:] if section and token.startswith(f"{section}.") else None if section else token
        if inside and _given(given, inside) and token not in named:
            named.append(token)
    return named


def _given(data: dict, path_str: str) -> bool:
    """Whether the mapping ``data`` sets the dotted key path ``path_str`` (to something other than null)."""
    node = data
    for part in path_str.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def _check_layer_keys(model: dict, places: Places) -> None:
    """The layers are given one way: ``model.layers``, or ``model.pattern`` repeated to ``model.n_layers``.
    (Where a later level, a child recipe, the overrides or a grid cell, gives them, the other way's keys it
    inherited were dropped before: :func:`zoo.recipes.loading.replace_layers`.)"""
    others = [k for k in LAYER_KEYS[1:] if model.get(k) is not None]
    if model.get("layers") is None or not others:
        return
    where, layers_at = places.blame([f"model.{k}" for k in others]), places("model.layers")
    message = layers_given_twice(others, layers_at if layers_at != where else "")
    raise UserError(f"{where}: {message}" if where else message)


def _built(cls, d_model: int, options) -> None:
    """Build a mixer of ``cls`` on the meta device (no memory, no initialisation, no random numbers drawn), once
    per distinct ``(cls, d_model, options)``: its constructor's checks that need ``d_model`` (divisibility,
    heads that fit) run at validation, where the place of the offending key is known."""
    key = (cls, d_model, repr(options))
    if key in _BUILT:
        return
    try:
        with torch.device("meta"):
            cls(d_model, options)
    except (ArithmeticError, RuntimeError, NotImplementedError, MemoryError):
        return  # sizes the model's own build reports (zoo check, or before training)
    if len(_BUILT) > 4096:
        _BUILT.clear()
    _BUILT.add(key)


def _check_builds(model, layers: list[Spec], written: str, places: Places) -> None:
    """Every layer's mixer can be built at ``model.d_model``: a constructor's refusal is blamed on the overrides of
    ``model.d_model``, the layer or its type's defaults, or of an option below those (a grid cell's
    ``model.mixer_options.<mixer>.<option>`` that the refusal names), else on the
    layer's line."""
    for i, spec in enumerate(layers):
        at = f"{written}.{i if model.layers is not None else i % len(model.pattern)}"
        try:
            _built(MIXERS.get(spec.name), model.d_model, spec.options)
        except (ValueError, TypeError, AssertionError) as err:   # research code checks its options with assert
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            message = failed_assertion(err) if isinstance(err, AssertionError) else message.removeprefix(f"{spec.name}: ")
            where = places.blame(["model.d_model", at, f"model.mixer_options.{spec.name}"], fallback=at,
                                 message=message)
            raise UserError(f"{where}: {at} ({spec.name}): {message}" if where else f"{at} ({spec.name}): {message}") \
                from None


def _check_task_fit(config: RecipeConfig, layers: list[Spec], task: Task, written: str, fail) -> None:
    """The task accepts every layer (e.g. only causal mixers for next-token prediction), a step's batch fits a
    generated training set, and a token budget ``train.tokens`` becomes ``train.steps``."""
    problem = layer_problem(task, layers)
    if problem is not None:
        index, message = problem
        fail(f"{written}.{index if config.model.layers is not None else index % len(config.model.pattern)}", message)
    t = config.train
    num_train = getattr(task.options, "num_train", None)   # a generated training set (a stream has none)
    if isinstance(num_train, int) and t.batch_size > num_train:
        fail("train.batch_size", f"{t.batch_size} exceeds task.num_train={num_train}: a step cannot draw more "
                                 f"examples than the training set holds; lower train.batch_size or raise "
                                 f"task.num_train")
    if t.tokens:
        t.steps = max(1, math.ceil(t.tokens / (t.batch_size * task.seq_len)))
        if t.warmup_steps > t.steps:
            fail("train.warmup_steps", f"{t.warmup_steps} exceeds the {t.steps} steps that train.tokens={t.tokens} "
                                       f"makes; lower warmup_steps or raise tokens")


def _refuse_overridden_steps(t, written_steps: int, data: dict, places: Places) -> None:
    """An override (the command line's, or a grid cell's) that sets ``train.steps`` where ``train.tokens`` sets the
    step count would change nothing: refused, naming the count the token budget gives."""
    train = data.get("train")
    given = isinstance(train, dict) and train.get("steps") is not None
    if not t.tokens or not given or written_steps == t.steps or places.override_at(("train", "steps")) is None:
        return
    places.fail("train.steps", f"{written_steps} has no effect: train.tokens={t.tokens} sets the steps ({t.steps} "
                               f"at this batch size and length); set train.tokens=0 to train by train.steps, or change "
                               f"train.tokens")


def _check_test_time(ev, layers: list[Spec], fail, own_knob: Callable[[str], bool]) -> None:
    """Every ``eval.test_time`` / ``eval.test_time_sweep`` knob is declared by some mixer and, where it was given
    for this model (``own_knob``), by a layer of it; and every value is valid for each layer that declares it
    (checked as the option it overrides)."""
    declared = sorted({k for n in MIXERS.names() for k in MIXERS.get(n).test_time_knobs})
    own = sorted({k for spec in layers for k in MIXERS.get(spec.name).test_time_knobs})
    for section, values in (("eval.test_time", ev.test_time), ("eval.test_time_sweep", ev.test_time_sweep)):
        for knob, value in values.items():
            if knob not in declared:
                fail(f"{section}.{knob}", f"no registered mixer declares a test-time knob {knob!r}"
                                          f"{nearest(knob, declared)} (declared: {', '.join(declared) or 'none'})")
            if knob not in own and own_knob(f"{section}.{knob}"):
                fail(f"{section}.{knob}", undeclared_knob(knob, [spec.name for spec in layers], own, "this model"))
            if section == "eval.test_time_sweep" and (not isinstance(value, list) or not value):
                fail(f"{section}.{knob}", f"expected a non-empty list of values, got {value!r}")
            for v in value if section == "eval.test_time_sweep" else [value]:
                for spec in layers:
                    if knob in MIXERS.get(spec.name).test_time_knobs:
                        try:
                            build_options(type(spec.options), {**plain_options(spec.options), knob: v}, "")
                        except OptionError as err:
                            fail(f"{section}.{knob}", f"{v!r} is not a valid {knob} for {spec.name}: {err.message}")


def undeclared_knob(knob: str, names: list[str], own: list[str], whose: str) -> str:
    """The refusal of a test-time knob that no layer of ``whose`` (named ``names``) declares."""
    layers = ", ".join(dict.fromkeys(names))
    return (f"no layer of {whose} declares the test-time knob {knob!r}, so it would change nothing (layers: "
            f"{layers}; the knobs they declare: {', '.join(own) or 'none'}){nearest(knob, own)}; drop it")


# --------------------------------------------------------------------------------------- eval.tasks
def _eval_task_label(values: dict, name: str, at: str, seen: set, fail) -> str:
    label = values.pop("label", name)
    if not isinstance(label, str) or not _EVAL_TASK_LABEL.match(label):
        fail(f"{at}.label", f"expected a short name of letters, digits and _.+- (it names the metric "
                            f"test_accuracy@task=<label>), got {label!r}")
    if label in seen:
        fail(f"{at}.label", f"{label!r} is used by two eval.tasks entries; give each a distinct label")
    seen.add(label)
    return label


def _eval_task(entry, at: str, inherited: dict, train_vocab: int, seq_lens: list[int], seen: set,
               fail) -> tuple[str, Spec]:
    """One ``eval.tasks`` entry: the training task's options it shares, overridden by its own; the same
    vocabulary as the training task; every ``eval.seq_lens`` length possible."""
    values = dict(entry)
    name = values.pop("name", None)
    if not isinstance(name, str):
        fail(f"{at}.name", f"expected a task name, got {name!r}; choose one of {', '.join(TASKS.names())}")
    label = _eval_task_label(values, name, at, seen, fail)
    cls = _registered(TASKS, name, f"{at}.name", fail)
    own = {f.name for f in fields(cls.Options)}
    spec = Spec(name, _options(cls, {**{k: v for k, v in inherited.items() if k in own}, **values}, at, fail))
    task = cls(spec.options)
    if task.vocab_size != train_vocab:
        fail(at, f"task {name!r} here has vocabulary size {task.vocab_size} but the model is trained with "
                 f"{train_vocab}; set its options so the vocabularies match (e.g. vocab_size)")
    for length in seq_lens:
        try:
            task.check_length(length)
        except ValueError as err:
            fail(at, f"{err}; eval.seq_lens asks for {length}: drop that length or lower this entry's facts")
    return label, spec


def resolve_eval_tasks(entries: list, train_task: Spec, seq_lens: list[int],
                       fail: Callable[[str, str], None]) -> list[tuple[str, Spec]]:
    """``[(label, Spec)]`` of the ``eval.tasks`` entries, validated (also against the ``eval.seq_lens``
    they will be generated at); ``fail(path, message)`` raises."""
    train_vocab = Task.from_spec(train_task).vocab_size
    inherited = {f.name: getattr(train_task.options, f.name) for f in fields(train_task.options)}
    seen: set = set()
    return [_eval_task(entry, f"eval.tasks.{i}", inherited, train_vocab, seq_lens, seen, fail)
            for i, entry in enumerate(entries)]
