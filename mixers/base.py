"""The Mixer contract and the registry of sequence mixers and state mixers.

A sequence mixer maps ``(batch, T, d_model) -> (batch, T, d_model)`` causally and can also run as a
recurrence with an explicit, fixed-layout state (a ``dict`` of tensors):

- ``forward(x, mask=None)``: the parallel / chunked form for training and prefill;
- ``init_state(batch, device, dtype)``: the state before any token;
- ``step(x_t, state) -> (y_t, state)``: one token, ``x_t`` of shape ``(batch, d_model)``;
- ``prefill(x, mask=None) -> (y, state)``: the parallel form that also returns the final state, so
  ``prefill`` then ``step`` equals ``forward`` over the whole sequence;
- ``state_size(seq_len)``: decode-state elements per sequence (attention's grows with ``seq_len``);
- construction from ``(d_model, **options)``, every option validated against the mixer's ``Options``
  dataclass (:mod:`mixers.options`).

``mask`` is an optional ``(batch, T)`` 0/1 tensor (a prefix or "action" mask) a task can pass through
the model; mixers that do not use one ignore it (``uses_mask = False``).

Register a mixer with ``@register_mixer`` and it is picked up by the CLI, the recipes and the
parametrised contract tests in ``tests/mixers/test_contract.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from .options import OptionError, build_options, describe_options, nearest

State = dict[str, torch.Tensor]


class Mixer(nn.Module):
    """Base class of every sequence mixer (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: decode-state size per sequence as a formula of the options and T, for ``zoo list``
    state_formula: ClassVar[str] = ""
    Options: ClassVar[type]
    uses_mask: ClassVar[bool] = False
    #: option overrides that make the mixer small and strictly causal for the contract tests
    contract_options: ClassVar[dict] = {}
    #: fp32 tolerance of the contract's parallel == recurrent checks. 1e-5 unless a mixer documents why its
    #: fp32 rounding is amplified (the same checks also run in fp64 at 1e-9 for every mixer)
    contract_fp32_rtol: ClassVar[float] = 1e-5

    def __init__(self, d_model: int, options):
        super().__init__()
        if not isinstance(d_model, int) or d_model <= 0:
            raise ValueError(f"{self.name}: d_model must be a positive integer, got {d_model!r}")
        self.d_model = d_model
        self.options = options

    # --- parallel form -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    # --- recurrent form ------------------------------------------------------------------------
    def init_state(self, batch_size: int, device=None, dtype=None) -> State:
        raise NotImplementedError

    def step(self, x_t: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def prefill(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """Parallel forward plus the final state. Default: the recurrence, token by token."""
        return self.forward_recurrent(x)

    def forward_recurrent(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Run ``step`` over the whole sequence from ``init_state`` (slow; the contract's yardstick)."""
        state = self.init_state(x.shape[0], device=x.device, dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            y, state = self.step(x[:, t], state)
            ys.append(y)
        return torch.stack(ys, dim=1), state

    def state_size(self, seq_len: int) -> int:
        raise NotImplementedError

    def extra_repr(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.options, f.name)!r}" for f in dataclasses.fields(self.options))
        return f"d_model={self.d_model}, {fields}"


class StateMixer(nn.Module):
    """Position-wise block after the sequence mixer (an MLP). ``(B, T, D) -> (B, T, D)``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type]

    def __init__(self, d_model: int, options):
        super().__init__()
        self.d_model = d_model
        self.options = options


@dataclasses.dataclass(frozen=True)
class Registry:
    kind: str
    entries: dict[str, type]

    def add(self, cls: type) -> type:
        if not cls.name:
            raise ValueError(f"{cls.__name__} has no registry name")
        if cls.name in self.entries and self.entries[cls.name] is not cls:
            raise ValueError(f"{self.kind} {cls.name!r} registered twice")
        if not dataclasses.is_dataclass(getattr(cls, "Options", None)):
            raise ValueError(f"{cls.__name__}.Options must be a dataclass")
        self.entries[cls.name] = cls
        return cls

    def get(self, name: str, path: str = "") -> type:
        _load_builtin()
        if name not in self.entries:
            raise OptionError(path, f"unknown {self.kind} {name!r}{nearest(name, self.entries)} "
                                    f"(registered: {', '.join(sorted(self.entries))})")
        return self.entries[name]

    def names(self) -> list[str]:
        _load_builtin()
        return sorted(self.entries)

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
                row["uses_mask"] = cls.uses_mask
            rows.append(row)
        return rows


MIXERS = Registry("mixer", {})
STATE_MIXERS = Registry("state mixer", {})


def register_mixer(cls: type) -> type:
    return MIXERS.add(cls)


def register_state_mixer(cls: type) -> type:
    return STATE_MIXERS.add(cls)


def build_mixer(name: str, d_model: int, options: Mapping[str, Any] | None = None, path: str = "") -> Mixer:
    return MIXERS.build(name, d_model, options, path)


def build_state_mixer(name: str, d_model: int, options: Mapping[str, Any] | None = None, path: str = "") -> StateMixer:
    return STATE_MIXERS.build(name, d_model, options, path)


def _load_builtin() -> None:
    # importing the package registers every built-in mixer exactly once
    import mixers  # noqa: F401
