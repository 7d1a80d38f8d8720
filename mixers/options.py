"""Typed, strictly validated option dataclasses (used by mixers and by the zoo's recipes).

An option class is a plain ``@dataclass`` whose fields carry a ``help`` string in their metadata.
:func:`build_options` turns a mapping into an instance and rejects unknown keys (suggesting the
nearest valid names), wrong types and values outside a field's ``choices``; every error names the
key path so a recipe error can point at the offending line. A wrong type is refused in a recipe's words
(:class:`TypeRefusal`): the kind of value expected, with an example, the value given and, where that value is
text that reads as the expected kind (``"0,1"`` for a list), how to write it.
"""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import typing
from typing import Any, Mapping

import yaml

from kernels.device import CPU, GPU, plan_for


class OptionError(ValueError):
    """A bad option. ``path`` is the dotted key path, ``message`` the human explanation."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def failed_assertion(err: AssertionError, where: str = "its constructor") -> str:
    """How a refusal words a failed ``assert`` of a mixer's constructor (or of ``where``, its options'
    ``__post_init__``): how research code checks its options."""
    said = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"an assertion of {where} failed{f' ({said})' if said else ''}; check the options it asserts on"


def opt(default: Any, help: str, choices: tuple | None = None, default_factory=None,
        at_least: float | None = None, above: float | None = None, at_most: float | None = None,
        below: float | None = None, omit_at_default: bool = False) -> Any:
    """A dataclass field with a help text, optional allowed values and an optional numeric range
    (``at_least`` <= value, ``above`` < value, value <= ``at_most``, value < ``below``; for a list, every
    element). A single field's range is declared here, never checked in ``__post_init__``: it is then
    validated with the key path and shown by ``zoo list --options``.

    ``omit_at_default``: leave the option out of the resolved recipe while it holds its default (see
    :func:`plain_options`); for an option added after results were recorded, so that the recipes of
    those results keep their keys."""
    meta = {"help": help, "choices": choices, "range": (at_least, above, at_most, below),
            "omit_at_default": omit_at_default}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def backend_opt(backends: tuple, help: str = "kernel backend") -> Any:
    """The ``backend`` option of a mixer: ``auto`` or one of its kernel family's ``BACKENDS``, so the
    choices are listed once, by the family that implements them."""
    return opt("auto", help, choices=("auto", *backends))


def chunk_size_opt(family: str, help: str) -> Any:
    """The ``chunk_size`` option of a mixer whose chunk length is a compute knob, not semantics: unset
    (``None``, the default) it is the device plan's chunk length for the kernel family ``family``, resolved
    at forward time from the input (:func:`chunk_size_for`): a CPU keeps the small chunks
    measured fastest there, a GPU takes chunks that fill tensor-core tiles.

    The plain (hashed) form of an unset chunk size is the CPU plan's length (:func:`plain_options`), which
    was the option's fixed default before it followed the device: every recorded recipe keeps its hash,
    and a CPU run of it computes exactly what it did. A GPU run computes the same function with its own
    chunk (the option declares ``chunk_size_changes_output = False``, which the contract checks), as any
    GPU run of a recipe differs from a CPU run in rounding only; the device is recorded beside each row."""
    cpu, gpu = CPU.chunk_size(family), GPU.chunk_size(family)
    meta = {"help": f"{help} (unset: the device's, {cpu} on a CPU and {gpu} on a GPU)", "choices": None,
            "range": (1, None, None, None), "omit_at_default": False, "device_chunk": family}
    return dataclasses.field(default=None, metadata=meta)


def chunk_size_for(x, family: str, chunk_size: int | None) -> int:
    """A :func:`chunk_size_opt` option's value: ``chunk_size`` when set, else the chunk length of the kernel
    family ``family`` in the device plan of the tensor ``x`` (:func:`kernels.device.plan_for`)."""
    return chunk_size if chunk_size is not None else plan_for(x).chunk_size(family)


def plain_options(options) -> dict:
    """``dataclasses.asdict(options)`` without the ``omit_at_default`` options that hold their default, and
    with an unset device chunk size (:func:`chunk_size_opt`) written as the CPU plan's."""
    out = dataclasses.asdict(options)
    for f in dataclasses.fields(options):
        family = f.metadata.get("device_chunk")
        if family is not None and out[f.name] is None:
            out[f.name] = CPU.chunk_size(family)
        if f.metadata.get("omit_at_default"):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if out[f.name] == default:
                del out[f.name]
    return out


def nearest(name: str, candidates) -> str:
    """'did you mean' text for ``name`` among ``candidates`` (empty when nothing is close)."""
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _is_union(origin) -> bool:
    return origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>")


#: how a type refusal ends when the value given reads as the expected kind; the value, as YAML, follows
WRITE_AS = "; write it as "
#: no value (no example, no way to write the given value as the expected kind)
_NOTHING = object()
#: set while a value is only tried against a type (:func:`_accepts`): its refusal then explains nothing
_TRYING = contextvars.ContextVar("trying", default=False)


def yaml_text(value: Any, limit: int = 60) -> str:
    """``value`` as one line of YAML (``[0, 1]``, ``null``, ``true``), cut to ``limit`` characters."""
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
    except yaml.YAMLError:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _given(value: Any) -> str:
    """The value a recipe gave, in its words: ``the string '0,1'``, ``3``, ``null``, ``the list [a, b]``."""
    if isinstance(value, str):
        quoted = yaml.safe_dump(value, default_style="'", width=10**6).strip().removesuffix("...").strip()
        return f"the string {quoted if len(quoted) <= 60 else quoted[:57] + '...'}"
    if isinstance(value, (list, tuple)):
        return f"the list {yaml_text(list(value))}"
    if isinstance(value, Mapping):
        return f"the mapping {yaml_text(dict(value))}"
    return yaml_text(value)


def _generic_example(tp) -> Any:
    """A value of the type ``tp`` (``[0, 1]`` for a list of integers), for a type without a usable default."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is list or origin is list:
        item = args[0] if args else Any
        return {int: [0, 1], float: [0.5, 1.0], str: ["a", "b"], Any: ["a", "b"]}.get(item, [_generic_example(item)])
    if tp is dict or origin is dict:
        return {"key": _generic_example(args[1] if args else Any)}
    if origin is typing.Literal:
        return args[0]
    if dataclasses.is_dataclass(tp):
        for f in dataclasses.fields(tp):
            if f.init and f.default is not dataclasses.MISSING and f.default is not None:
                return {f.name: f.default}
        return {}
    return {int: 1, float: 0.5, bool: True, str: "name"}.get(tp, "value")


def _example(tp, example: Any) -> Any:
    """``example`` (a field's default) when it is a non-empty value of ``tp``, else a value of ``tp`` made up."""
    if example is not _NOTHING and example not in ("", [], {}, None) and _accepts(example, tp):
        return example
    return _generic_example(tp)


def _kind(tp, example: Any = _NOTHING) -> str:
    """The kind of value ``tp`` takes, in a recipe's words, with an example: ``a list such as [0, 1]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(origin):
        kinds = " or ".join(_kind(a, example) for a in args if a is not type(None))
        return f"{kinds} or nothing (null)" if type(None) in args else kinds
    if origin is typing.Literal:
        return f"one of {', '.join(yaml_text(a) for a in args)}"
    if tp is bool:
        return "true or false"
    if tp is Any:
        return "plain data (a string, number, list or mapping)"
    shown = yaml_text(_example(tp, example))
    if dataclasses.is_dataclass(tp):
        return f"a mapping of options such as {shown}"
    words = {list: "a list", dict: "a mapping", int: "an integer", float: "a number", str: "a string"}
    return f"{words.get(origin or tp, _type_name(tp))} such as {shown}"


def _accepts(value: Any, tp, allowed=None) -> bool:
    """Whether :func:`check_type` takes ``value`` as ``tp`` (and ``allowed``, if given, the converted value)."""
    trying = _TRYING.set(True)
    try:
        converted = check_type(value, tp, "")
        return allowed is None or allowed(converted)
    except OptionError:
        return False
    finally:
        _TRYING.reset(trying)


def _read(text: str) -> Any:
    """``text`` read as a YAML value, or :data:`_NOTHING` if it is not one."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        return _NOTHING


def _written_as(value: Any, tp, allowed=None) -> Any:
    """``value`` written as the kind ``tp`` takes, where the value given reads as one: text that reads as the
    value (``"3"``, ``"[0, 1]"``), comma-separated text or a single item for a list (``"0,1"``, ``attention``), a
    number or true/false in quotes for a string; :data:`_NOTHING` when there is none (or ``allowed`` refuses it)."""
    if isinstance(value, str) and len(value) <= 1000:
        read = _read(value)
        candidates = [read]
        if "," in value and not isinstance(read, (list, dict)):
            candidates.append([_read(item.strip()) for item in value.strip().removeprefix("[").removesuffix("]")
                               .split(",")])
        candidates.append([read])
    elif isinstance(value, (bool, int, float)):
        candidates = [yaml_text(value)]
    else:
        return _NOTHING
    for candidate in candidates:
        if candidate is _NOTHING or candidate == value or _NOTHING in (candidate if isinstance(candidate, list) else []):
            continue
        if _accepts(candidate, tp, allowed):
            return candidate
    return _NOTHING


class TypeRefusal(OptionError):
    """A value of the wrong type, refused in a recipe's words: the kind expected with an example (``example``, a
    field's default, when it is one), the value given and, where the value reads as the expected kind (and
    ``allowed`` takes it), how to write it (after :data:`WRITE_AS`)."""

    def __init__(self, path: str, tp, value: Any, example: Any = _NOTHING, allowed=None):
        self.tp, self.value = tp, value
        if _TRYING.get():  # only tried: nobody reads this refusal
            self.written = _NOTHING
            super().__init__(path, "expected another type")
            return
        self.written = _written_as(value, tp, allowed)
        fix = "" if self.written is _NOTHING else f"{WRITE_AS}{yaml_text(self.written, limit=200)}"
        super().__init__(path, f"expected {_kind(tp, example)}, got {_given(value)}{fix}")


def _check_union(value: Any, args: tuple, path: str) -> Any:
    """``A | B | None``: None when allowed and given, else the first member type that accepts the value."""
    if value is None and type(None) in args:
        return None
    members = [arg for arg in args if arg is not type(None)]
    if value is not None and len(members) == 1:  # ``X | None`` given a value: refused as an X is, item by item
        return check_type(value, members[0], path)
    for arg in args:
        if arg is type(None):
            continue
        try:
            return check_type(value, arg, path)
        except OptionError:
            pass
    raise TypeRefusal(path, typing.Union[args], value)


def _check_list(value: Any, args: tuple, path: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeRefusal(path, list[args[0]] if args else list[Any], value)
    return [check_type(v, args[0] if args else Any, f"{path}.{i}") for i, v in enumerate(value)]


def _check_dict(value: Any, args: tuple, path: str) -> dict:
    if not isinstance(value, Mapping):
        raise TypeRefusal(path, dict[args] if args else dict[str, Any], value)
    return {k: check_type(v, args[1] if args else Any, f"{path}.{k}") for k, v in value.items()}


def _check_float(value: Any, path: str) -> float:
    """A finite number; an int becomes a float, and so does a number YAML 1.1 read as a string (1e-3)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeRefusal(path, float, value)
    try:
        value = float(value)
    except OverflowError:
        raise OptionError(path, f"{value!r} is too large for a number") from None
    if not math.isfinite(value):
        raise OptionError(path, f"expected a finite number, got {value!r}")
    return value


#: generic containers by their origin: the check of a value against ``origin[args]``
_CONTAINERS = {list: _check_list, dict: _check_dict}
#: scalar types taken as they are: what a value must be
_SCALARS = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            bool: lambda v: isinstance(v, bool),
            str: lambda v: isinstance(v, str)}


def check_type(value: Any, tp, path: str) -> Any:
    """Return ``value`` converted to ``tp`` where lossless (int -> float), else raise :class:`TypeRefusal`."""
    if tp is list or tp is dict:  # bare list / dict: free-form items
        tp = list[Any] if tp is list else dict[str, Any]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return check_plain(value, path)
    if _is_union(origin):
        return _check_union(value, args, path)
    if origin in _CONTAINERS:
        return _CONTAINERS[origin](value, args, path)
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise TypeRefusal(path, tp, value)
        return value
    if tp is float:
        return _check_float(value, path)
    if tp in _SCALARS:
        if not _SCALARS[tp](value):
            raise TypeRefusal(path, tp, value)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise TypeRefusal(path, tp, value)
        return build_options(tp, value, path)
    return value


def check_plain(value: Any, path: str) -> Any:
    """``value`` if it is plain data (str, number, bool, null, lists and string-keyed mappings of them),
    as a free-form option must be to be stored and hashed; else OptionError. YAML can also write sets,
    dates and bytes."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Mapping):
            for key, child in item.items():
                if not isinstance(key, str):
                    raise OptionError(where, f"keys must be strings, got {key!r}")
                stack.append((child, f"{where}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{where}.{i}") for i, child in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            raise OptionError(where, f"expected a finite number, got {item!r}")
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            raise OptionError(where, f"expected plain data (a string, number, list or mapping), got {item!r}")
    return value


def _bounds(bounds) -> tuple:
    """``(at_least, above, at_most, below)`` from a field's declared range (None: unbounded)."""
    return tuple(bounds or ()) + (None,) * (4 - len(bounds or ()))


def has_range(field: dataclasses.Field) -> bool:
    """Whether ``field`` declares at least one numeric bound."""
    return any(b is not None for b in _bounds(field.metadata.get("range")))


def range_text(bounds) -> str:
    """``'>= 1'``, ``'> 0 and < 1'``... for a field's ``(at_least, above, at_most, below)``; empty if
    unbounded."""
    show = lambda b: str(b) if isinstance(b, int) else f"{b:g}"  # noqa: E731 - ints in full, not 1.04858e+06
    signs = (">=", ">", "<=", "<")
    return " and ".join(f"{sign} {show(b)}" for sign, b in zip(signs, _bounds(bounds)) if b is not None)


def check_range(value: Any, bounds, path: str) -> None:
    """Raise OptionError when a number (or a number in a list) is outside ``bounds``."""
    if not bounds or all(b is None for b in bounds):
        return
    at_least, above, at_most, below = _bounds(bounds)
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_range(item, bounds, f"{path}.{i}")
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value != value or (at_least is not None and value < at_least) or (above is not None and value <= above) \
            or (at_most is not None and value > at_most) or (below is not None and value >= below):
        raise OptionError(path, f"{value!r} is out of range: must be {range_text(bounds)}")


def build_options(cls, values: Mapping[str, Any] | None, path: str = ""):
    """Instantiate the option dataclass ``cls`` from ``values`` with strict validation."""
    values = values if values is not None else {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    if not isinstance(values, Mapping):
        raise OptionError(path, f"expected a mapping of options, got {values!r}")
    for key in values:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise OptionError(where, f"unknown option {key!r}{nearest(key, fields)} (valid: {', '.join(fields)})")
    kwargs = {}
    for name, value in values.items():
        where = f"{path}.{name}" if path else name
        try:
            value = check_type(value, hints[name], where)
        except TypeRefusal as err:
            if err.path != where:
                raise
            fits = lambda v, f=fields[name]: _fits(v, f)  # noqa: E731 - a way to write it must be a valid value
            raise TypeRefusal(where, hints[name], value, _default(fields[name]), fits) from None
        choices = fields[name].metadata.get("choices")
        if choices is not None and value not in choices:
            raise OptionError(where, f"{value!r} is not one of {', '.join(map(repr, choices))}{nearest(value, choices)}")
        check_range(value, fields[name].metadata.get("range"), where)
        kwargs[name] = value
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f"{path}.{missing[0]}" if path else missing[0]
        raise OptionError(where, f"missing required field {missing[0]!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:  # __post_init__ checks
        raise OptionError(path, str(err)) from None
    except AssertionError as err:  # a __post_init__ that asserts, as research code does
        raise OptionError(path, failed_assertion(err, f"{cls.__qualname__}.__post_init__")) from None


def default_problem(cls) -> str | None:
    """What is wrong with the option dataclass ``cls`` itself, or None: a type annotation that does not resolve
    (a name its module never imports), a default its own field refuses (a wrong type, a value outside its
    ``choices`` or its declared range), or defaults its ``__post_init__`` refuses together. Each would pass unseen
    until a recipe leaves the options at their defaults (or sets one, for the annotation), so a registry refuses
    such a class when it is registered."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as err:  # noqa: BLE001 - NameError, TypeError, SyntaxError of a string annotation alike
        return (f"a field's type annotation cannot be resolved ({type(err).__name__}: {err}); import the names it "
                f"uses at the top of the module that defines it")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    for f in fields:
        default = _default(f)
        if default is _NOTHING:
            continue
        if default is None and not _accepts(None, hints[f.name]):
            return (f"option {f.name!r} defaults to None but is annotated {_type_name(hints[f.name])}; annotate it "
                    f"{_type_name(hints[f.name])} | None")
        try:
            value = check_type(default, hints[f.name], f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise OptionError(f.name, f"{value!r} is not one of {', '.join(map(repr, choices))}")
            check_range(value, f.metadata.get("range"), f.name)
        except OptionError as err:
            return f"the default of option {f.name!r} is refused by its own declaration ({err.message}); fix the default"
    if all(_default(f) is not _NOTHING or f.default_factory is not dataclasses.MISSING for f in fields):
        try:
            build_options(cls, {})
        except OptionError as err:
            return f"its Options refuse their own defaults ({err}); make the defaults agree"
    return None


def _default(field: dataclasses.Field) -> Any:
    """The default value of ``field`` (:data:`_NOTHING` for a required field, or a section of options, whose
    default may not build on its own)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is dataclasses.MISSING or isinstance(field.default_factory, type):
        return _NOTHING
    try:
        return field.default_factory()
    except Exception:  # noqa: BLE001 - a default that does not build is no example
        return _NOTHING


def _fits(value: Any, field: dataclasses.Field) -> bool:
    """Whether the (type-checked) ``value`` is one of ``field``'s choices and inside its range."""
    choices = field.metadata.get("choices")
    if choices is not None and value not in choices:
        return False
    try:
        check_range(value, field.metadata.get("range"), "")
    except OptionError:
        return False
    return True


def describe_options(cls) -> list[dict]:
    """[{name, type, default, help, choices}] for documentation and ``zoo list``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(hints[f.name]):
            default = f.default_factory()
        else:
            default = None  # a required field, or a nested section (listed on its own)
        if not f.init:
            continue
        out.append({"name": f.name, "type": _type_name(hints[f.name]), "default": default,
                    "help": f.metadata.get("help", ""), "choices": f.metadata.get("choices"),
                    "range": range_text(f.metadata.get("range"))})
    return out
