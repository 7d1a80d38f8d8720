"""The Mixer contract and the registry of sequence mixers and state mixers.

A sequence mixer maps ``(batch, T, d_model) -> (batch, T, d_model)`` causally and can also run as a
recurrence with an explicit, fixed-layout state (a ``dict`` of tensors). The contract, smallest first:

- ``prefill(x, mask=None) -> (y, state)``: the parallel / chunked form, which also returns the final
  state (required; there is no silent token-loop default). ``forward(x, mask)`` is derived from it;
- ``init_state(batch, device, dtype)`` (``device`` and ``dtype`` default to the mixer's own) and
  ``step(x_t, state) -> (y_t, state)`` (``x_t`` of shape
  ``(batch, d_model)``): the recurrence, so ``prefill`` then ``step`` equals ``forward`` over the whole
  sequence. Without autograd a step may update the given state's tensors in place and return them (the
  Kronecker slot memory writes its K rows where copying would move the whole memory each token): to decode two
  continuations from one state, step from a copy (``{k: v.clone() for k, v in state.items()}``);
- ``state_size(seq_len)``: decode-state elements per sequence (``active_state_size``: those one step
  touches, for sparse memories);
- construction as ``Cls(d_model, options)`` with ``options`` an instance of the mixer's ``Options``
  dataclass, validated by :func:`mixers.options.build_options` (``build_mixer(name, d_model, mapping)``
  does both);
- declarations instead of discovery: every property other code reads is a class attribute declared on
  :class:`Mixer` with one line of documentation (``uses_mask``, ``chunk_size_changes_output``,
  ``state_grows_with_seq_len``, ``test_time_knobs``, ...).

``mask`` is an optional ``(batch, T)`` 0/1 tensor (a prefix or "action" mask) a task can pass through
the model; mixers that do not declare ``uses_mask`` ignore it.

Every subclass's ``forward``, ``prefill`` and ``step`` check their inputs at this boundary (shape, dtype,
mask, state layout; ``T = 0`` gives an empty output, ``batch = 0`` is refused) and the shape of what they return
through :mod:`mixers.boundary`, applied here once; ``step`` runs with autocast off. From its options a mixer also
says whether it is causal (``non_causal_reason``) and whether it can contribute at all at a sequence
length (``dead_at``), so a recipe with a layer that never reads anything is refused before training. A subclass's
``__init__`` that does not call ``super().__init__(d_model, options)`` is refused in one line when the mixer is built
(:func:`checked_init`), not left to fail inside torch or at the mixer's first call.

Register a mixer with ``@register_mixer`` and it is picked up by the CLI, the recipes and the
parametrised contract tests (``tests/mixers/test_contract.py``), which read the declarations. Registration refuses,
in one line, a class that cannot work whatever its weights (:meth:`Registry.add`, :func:`mixer_class_problem`): not a
:class:`Mixer`, no ``name`` or one another class holds, ``Options`` that are not a dataclass or whose defaults their
own declarations refuse, ``test_time_knobs`` that name no option, a method the zoo cannot call with its arguments.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn

from .boundary import (
    MixerContractError,
    checked_forward,
    checked_prefill,
    checked_state_size,
    checked_step,
    wrap_methods,
)
from .options import OptionError, build_options, default_problem, describe_options, nearest

State = dict[str, torch.Tensor]

#: the declared properties of a mixer that other code reads (documented on :class:`Mixer`)
MIXER_FLAGS = ("uses_mask", "chunk_size_changes_output", "state_grows_with_seq_len", "test_time_knobs")


class Mixer(nn.Module):
    """Base class of every sequence mixer (see the module docstring for the contract).

    A subclass implements ``prefill``, ``init_state``, ``step`` and ``state_size`` and sets the class
    attributes below; every attribute other code reads is declared here, with its meaning.
    """

    #: registry name (``model.layers`` entries, ``zoo list``)
    name: ClassVar[str] = ""
    #: one line for ``zoo list``
    description: ClassVar[str] = ""
    #: decode-state size per sequence as a formula of the options and T, for ``zoo list``
    state_formula: ClassVar[str] = ""
    #: the typed option dataclass; ``__init__`` receives a validated instance of it
    Options: ClassVar[type]
    #: reads the optional (batch, T) prefix / "action" mask; mixers that do not ignore it
    uses_mask: ClassVar[bool] = False
    #: the ``chunk_size`` option changes the output (it is semantics, not only a compute knob); when
    #: False, the contract checks that every chunk size gives the same output
    chunk_size_changes_output: ClassVar[bool] = False
    #: the decode state grows with the sequence length (a KV cache); when False, ``state_size(T)`` must be
    #: the same for every T
    state_grows_with_seq_len: ClassVar[bool] = False
    #: names of options that evaluation may change on a trained model without retraining (test-time
    #: compute: solver iterations, power order, ...). ``HybridLM.test_time(**values)`` sets them on
    #: every mixer that declares them; read them with :meth:`knob`
    test_time_knobs: ClassVar[tuple[str, ...]] = ()
    #: option overrides that make the mixer small and strictly causal for the contract tests
    contract_options: ClassVar[dict] = {}
    #: fp32 tolerance of the contract's parallel == recurrent checks. 1e-5 unless a mixer documents why its
    #: fp32 rounding is amplified (the same checks also run in fp64 at 1e-9 for every mixer)
    contract_fp32_rtol: ClassVar[float] = 1e-5
    #: on the GPU plan ``forward`` and ``prefill`` read their input through one linear layer only (one matmul;
    #: its shape, device and dtype aside): the block's pre-norm may hand it over in the autocast dtype
    #: (:class:`mixers.layers.RMSNorm`'s ``to_linear``), which gives the same values and gradients. False for a
    #: mixer that computes with the input otherwise (an fp32 key path, say) or feeds it to two matmuls, whose
    #: input gradients autograd would then sum in the autocast dtype instead of fp32
    input_to_linear: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        wrap_methods(cls)  # the boundary checks of mixers.boundary, once per defined method
        init = cls.__dict__.get("__init__")
        if callable(init) and not getattr(init, _CHECKED_INIT, False):
            cls.__init__ = checked_init(init)

    def __init__(self, d_model: int, options):
        super().__init__()
        if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model <= 0:
            raise ValueError(f"{self.name}: d_model must be a positive integer, got {d_model!r}")
        if not isinstance(options, self.Options):
            raise TypeError(f"{self.name}: options must be a {type(self).__name__}.Options instance "
                            f"(build it with mixers.build_mixer(name, d_model, {{...}}) from a mapping)")
        self.d_model = d_model
        self.options = options
        self._test_time: dict[str, Any] = {}

    # --- parallel form -------------------------------------------------------------------------
    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """The parallel / chunked form over ``x (batch, T, d_model)``: ``(y, final_state)``. Required."""
        raise NotImplementedError(f"{type(self).__name__} must implement a parallel prefill(x, mask)")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``prefill`` without the state; override only to skip building a state that costs extra."""
        return self.prefill(x, mask)[0]

    # --- recurrent form ------------------------------------------------------------------------
    def init_state(self, batch_size: int, device=None, dtype=None) -> State:
        raise NotImplementedError(f"{type(self).__name__} must implement init_state(batch_size, device, dtype)")

    def step(self, x_t: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(x_t, state)")

    def forward_recurrent(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Run ``step`` over the whole sequence from ``init_state`` (slow; the contract's yardstick)."""
        state = self.init_state(x.shape[0], device=x.device, dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            y, state = self.step(x[:, t], state)
            ys.append(y)
        return torch.stack(ys, dim=1), state

    def state_size(self, seq_len: int) -> int:
        """Decode-state elements per sequence after ``seq_len`` tokens (what ``step`` carries)."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_size(seq_len)")

    def active_state_size(self, seq_len: int) -> int:
        """State elements one decode step reads or writes (sparse-memory mixers touch only part of it)."""
        return self.state_size(seq_len)

    # --- what the options make of the mixer ---------------------------------------------------------
    @classmethod
    def non_causal_reason_for(cls, options) -> str | None:
        """None when, with these options, every output depends only on the inputs at or before its position;
        else one line naming the option that makes it read later tokens (a language-model task refuses it).
        A class method of the options alone, so a recipe can be checked before any layer is built."""
        return None

    @property
    def non_causal_reason(self) -> str | None:
        return type(self).non_causal_reason_for(self.options)

    @property
    def is_causal(self) -> bool:
        return self.non_causal_reason is None

    def dead_at(self, seq_len: int) -> str | None:
        """None when the layer can contribute at length ``seq_len``; else one line naming the option that makes
        every output independent of the input at that length (no gradient reaches the layer) and a value
        that works. Structural only: from the options and the length, not from the weights or a mask."""
        return None

    def decode_differs(self) -> str | None:
        """None when ``prefill`` then ``step`` reproduce ``forward`` token for token (the contract); else one line
        saying how decoding differs with these options (what generation reads that training did not) and the
        option value that makes them agree."""
        return None

    # --- test-time knobs -----------------------------------------------------------------------
    def knob(self, name: str):
        """The value of test-time knob ``name``: the evaluation override when one is set and the module
        is not training, else the option."""
        if name not in self.test_time_knobs:  # a one-line refusal: an author's knob() of an undeclared option
            raise MixerContractError(f"{self.name}: {name!r} is not a declared test-time knob "
                                     f"(test_time_knobs = {self.test_time_knobs!r}): add it to the class's "
                                     f"test_time_knobs, or read self.options.{name}")
        if not self.training and name in self._test_time:
            return self._test_time[name]
        return getattr(self.options, name)

    def set_test_time(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Set evaluation overrides for the declared knobs among ``values`` (others are ignored, so one
        mapping can serve a mixed stack); validates them with the option's type and ``__post_init__``.
        Returns the previous overrides (pass them back to restore)."""
        previous = dict(self._test_time)
        mine = {k: v for k, v in values.items() if k in self.test_time_knobs}
        if mine:
            fields = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
            build_options(self.Options, {**fields, **mine}, self.name)
        self._test_time = {**self._test_time, **mine}
        return previous

    def restore_test_time(self, previous: Mapping[str, Any]) -> None:
        self._test_time = dict(previous)

    def extra_repr(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.options, f.name)!r}" for f in dataclasses.fields(self.options))
        return f"d_model={self.d_model}, {fields}"


#: attribute set on a subclass's wrapped ``__init__`` (wrapped once, also when a class re-assigns it)
_CHECKED_INIT = "_mixer_init_checked"


def _base_init_ran(mixer) -> bool:
    """Whether :meth:`Mixer.__init__` ran on ``mixer`` (it is the only code that sets ``_test_time``)."""
    return "_test_time" in mixer.__dict__


def _missing_base_init(err: AttributeError) -> bool:
    """Whether ``err``, raised by a subclass's ``__init__``, comes from skipping ``super().__init__``: torch refusing
    a layer before ``nn.Module.__init__``, or ``self.d_model`` / ``self.options`` read before they were set. Another
    AttributeError (a typo in an option's name) is the author's own."""
    said = str(err)
    return "before Module.__init__() call" in said or said.endswith(("attribute 'd_model'", "attribute 'options'",
                                                                     "attribute '_parameters'", "attribute '_modules'"))


def checked_init(fn):
    """``fn``, a mixer subclass's ``__init__``, refusing in one line (a :class:`MixerContractError`, which a recipe
    reports naming the layer) a constructor that never called ``super().__init__(d_model, options)``: torch's
    ``cannot assign module before Module.__init__() call``, or a mixer without ``d_model`` and ``options``
    that fails later, at its first call."""
    @functools.wraps(fn)
    def __init__(self, *args, **kwargs):
        try:
            fn(self, *args, **kwargs)
        except AttributeError as err:
            if not _base_init_ran(self) and _missing_base_init(err):
                raise MixerContractError(_no_base_init(fn)) from err
            raise
        if not _base_init_ran(self):
            raise MixerContractError(_no_base_init(fn))
    setattr(__init__, _CHECKED_INIT, True)
    return __init__


def _no_base_init(fn) -> str:
    return (f"{fn.__module__}.{fn.__qualname__} does not call super().__init__(d_model, options): call it first, "
            f"before creating any layer (it sets up the module and self.d_model and self.options, which the zoo "
            f"reads)")


# the base methods are wrapped too, so a subclass that inherits them (forward from prefill) is checked
Mixer.forward = checked_forward(Mixer.forward)
Mixer.prefill = checked_prefill(Mixer.prefill)
Mixer.step = checked_step(Mixer.step)
Mixer.active_state_size = checked_state_size(Mixer.active_state_size)


class StateMixer(nn.Module):
    """Position-wise block after the sequence mixer (an MLP). ``(B, T, D) -> (B, T, D)``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type]
    #: the block is the identity: the builder leaves the state-mixer sub-block (and its norm) out
    is_identity: ClassVar[bool] = False
    #: ``forward`` reads its input through one linear layer only: the block's pre-norm may hand it over in the
    #: autocast dtype (see :attr:`Mixer.input_to_linear`)
    input_to_linear: ClassVar[bool] = False

    def __init__(self, d_model: int, options):
        super().__init__()
        self.d_model = d_model
        self.options = options


@dataclasses.dataclass(frozen=True)
class Registry:
    """Named classes of one kind. The built-in entries are complete whenever the registry can be reached:
    importing any module of a package first imports the package, which imports every module in it."""
    kind: str
    entries: dict[str, type]
    #: the decorator that registers a class, and the class every entry derives from (named in a miss)
    decorator: str = ""
    base: type | None = None
    #: what else a class of this kind must satisfy: ``check(cls)`` is None, or the problem and its fix
    check: Callable[[type], str | None] | None = None

    def add(self, cls: type) -> type:
        """Register ``cls`` under ``cls.name``; a class that cannot work is refused in one line (a ValueError
        naming it, the problem and the fix) when its module is imported, not when a recipe first uses it."""
        where = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
        if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{where} is not a {self.base.__name__} subclass: derive it from "
                             f"{self.base.__module__.split('.')[0]}.{self.base.__name__} to register it with "
                             f"@{self.decorator or 'the registry'}")
        if not cls.name:
            raise ValueError(f"{where} has no registry name: set name = '<name>' on the class (the name recipes and "
                             f"zoo list use)")
        known = self.entries.get(cls.name)
        if known is not None and known is not cls:
            known_at = f"{known.__module__}.{known.__qualname__}"
            again = (" (the same class defined again: a module imported under two names, a reloaded module or a "
                     "re-run notebook cell? import it once, or restart the interpreter)" if known_at == where else "")
            raise ValueError(f"{self.kind} {cls.name!r} registered twice: {known_at} has that name already, and "
                             f"{where} asks for it{again}; give one of them another name")
        options = getattr(cls, "Options", None)
        if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
            raise ValueError(f"{self.kind} {cls.name!r} ({where}): its Options must be a dataclass: decorate the class "
                             f"Options with @dataclass (an empty one when the {self.kind} has no options)")
        problem = default_problem(options) or (self.check(cls) if self.check else None)
        if problem:
            raise ValueError(f"{self.kind} {cls.name!r} ({where}): {problem}")
        self.entries[cls.name] = cls
        return cls

    def get(self, name: str, path: str = "") -> type:
        if name not in self.entries:
            raise OptionError(path, f"unknown {self.kind} {name!r}{nearest(name, self.entries)} "
                                    f"(registered: {', '.join(sorted(self.entries))}){self._unregistered_hint(name)}")
        return self.entries[name]

    def _unregistered_hint(self, name: str) -> str:
        """What a user who wrote a class of that name most likely left out: the decorator, or the import."""
        if not self.decorator:
            return ""
        found, todo = [], list(self.base.__subclasses__()) if self.base else []
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if getattr(cls, "name", None) == name:
                found.append(cls)
        if found:
            cls = found[0]
            return (f"; {cls.__module__}.{cls.__qualname__} is named {name!r} but was never registered: decorate it "
                    f"with @{self.decorator}")
        if nearest(name, self.entries):   # a typo of a registered name, most likely; or a module left out
            return f"; if {name!r} is a {self.kind} of your own, name its module in the recipe's imports: [my_pkg.my_module]"
        return (f"; a {self.kind} of your own: decorate its class with @{self.decorator} and name its module in the "
                f"recipe's imports: [my_pkg.my_module]")

    def names(self) -> list[str]:
        return sorted(self.entries)

    def builtin_names(self, package: str) -> list[str]:
        """The entries defined in ``package`` itself, not by a user's module, a test or an imported recipe
        module: what a benchmark of the library (or a fresh process) sees."""
        return [name for name in self.names() if self.entries[name].__module__.split(".")[0] == package]

    def build(self, name: str, d_model: int, options: Mapping[str, Any] | None = None, path: str = ""):
        cls = self.get(name, path)
        return cls(d_model, build_options(cls.Options, options, path))

    def describe(self) -> list[dict]:
        rows = []
        for name in self.names():
            cls = self.entries[name]
            row = {"name": name, "description": cls.description, "options": describe_options(cls.Options)}
            if self.kind == "mixer":
                row["state_size"] = cls.state_formula
                row.update({flag: getattr(cls, flag) for flag in MIXER_FLAGS})
            rows.append(row)
        return rows


#: what the boundary passes each method of a mixer (positionally, after ``self``), as its definition should read
MIXER_CALLS = {"prefill": "x, mask=None", "forward": "x, mask=None", "step": "x_t, state",
               "init_state": "batch_size, device=None, dtype=None", "state_size": "seq_len",
               "active_state_size": "seq_len", "dead_at": "seq_len"}


def mixer_class_problem(cls: type) -> str | None:
    """What keeps a registered mixer class from working, found from the class alone, or None: a method the zoo
    cannot call with its arguments (``prefill(self, x)`` without ``mask``), or ``test_time_knobs`` naming no option.
    (The missing methods and the rest of the contract are the contract suite's, ``tests/mixers/test_contract.py``.)"""
    for method, params in MIXER_CALLS.items():
        fn = getattr(cls, method)
        if fn is getattr(Mixer, method):
            continue
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # not introspectable (a builtin): taken as it is
            continue
        try:
            signature.bind(cls, *[None] * (params.count(",") + 1))
        except TypeError:
            return (f"{method}{signature} cannot be called as {method}(self, {params.replace('=None', '')}), as the "
                    f"zoo calls it; define it as def {method}(self, {params})")
    knobs = cls.test_time_knobs
    if not isinstance(knobs, (tuple, list)) or not all(isinstance(k, str) for k in knobs):
        return f"test_time_knobs must be a tuple of option names, such as ('num_iter',), got {knobs!r}"
    fields = [f.name for f in dataclasses.fields(cls.Options)]
    for knob in knobs:
        if knob not in fields:
            return (f"test-time knob {knob!r} is not one of its options ({', '.join(fields) or 'none'}): list only "
                    f"options in test_time_knobs{nearest(knob, fields)}")
    return None


MIXERS = Registry("mixer", {}, "register_mixer", Mixer, mixer_class_problem)
STATE_MIXERS = Registry("state mixer", {}, "register_state_mixer", StateMixer)


def register_mixer(cls: type) -> type:
    return MIXERS.add(cls)


def register_state_mixer(cls: type) -> type:
    return STATE_MIXERS.add(cls)


def build_mixer(name: str, d_model: int, options: Mapping[str, Any] | None = None, path: str = "") -> Mixer:
    return MIXERS.build(name, d_model, options, path)


def build_state_mixer(name: str, d_model: int, options: Mapping[str, Any] | None = None, path: str = "") -> StateMixer:
    return STATE_MIXERS.build(name, d_model, options, path)
