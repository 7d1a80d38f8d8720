"""Input checks at the Mixer contract boundary, applied once to every mixer class.

:class:`mixers.base.Mixer` wraps each subclass's ``forward``, ``prefill`` and ``step`` with the wrappers
below (in ``__init_subclass__``), so no mixer checks its own inputs and an out-of-tree mixer gets the same
checks. A malformed call fails with one line that names the method, the argument, the expected shape or
dtype and the one given, before any projection runs:

- ``x`` of ``forward`` / ``prefill``: a floating tensor ``(batch, T, d_model)``; ``x_t`` of ``step``:
  ``(batch, d_model)`` (a ``(batch, T, d_model)`` input to ``step`` is pointed to ``prefill``);
- the dtype of the module's parameters (an integer, bool or float64 input to an fp32 module is refused,
  not silently cast); inside an autocast region the autocast dtype is accepted too;
- ``mask``: ``None`` or a tensor of shape ``(batch, T)``, the first two dimensions of ``x``;
- ``state`` of ``step``: a mapping with the keys and shapes of ``init_state(batch)`` for the batch of
  ``x_t`` (a dimension of size 0 there, the length of a KV cache, may take any size), each tensor in the dtype
  ``init_state`` gives it for the module's dtype or one that converts to it exactly (a state a prefill under
  autocast left in the autocast dtype), which is raised to it; a wider or unrelated dtype (an fp64 state kept
  from before ``mixer.float()``) is refused rather than mixed into the step's matmuls or carried on in fp64;
- the state ``step`` returns: its keys must be those of ``init_state`` (a mixer's wrong layout is named at the
  step that made it, not at the next one; the layout is the one the input state was checked against, so this
  costs one set comparison);
- what the methods return: ``forward`` an output of the input's shape, ``prefill`` ``(y, state)`` with ``y`` of the
  input's shape (``forward`` is ``prefill(x)[0]``: a bare ``y`` would give the first sequence's output), ``step``
  ``(y_t, state)`` with ``y_t`` of shape ``(batch, d_model)``, ``init_state`` a non-empty dict of tensors, each
  floating one in the dtype it was asked for (or a wider one). These refusals are :class:`MixerContractError`, an
  option error the command line reports in one line (``zoo check`` meets them in its trial forward pass);
- ``batch_size`` of ``init_state`` and ``seq_len`` of ``state_size`` / ``active_state_size``: non-negative ints, and
  so is what ``state_size`` / ``active_state_size`` return;
- ``batch = 0`` is refused (every mixer alike); ``T = 0`` returns an empty ``(batch, 0, d_model)`` output
  and, from ``prefill``, the state of ``init_state`` (nothing consumed).

``init_state(batch_size)`` without a ``device`` or ``dtype`` lays the state out for the mixer's own (those of its
first floating parameter), as ``init_state(batch_size, device, dtype)`` with them would: a 16-bit or CUDA mixer
then steps from it as from the state ``prefill`` returns (torch's defaults, fp32 on the CPU, made ``step`` fail
on a bf16 model's mixed operands or move its short-convolution buffers to fp32).

``step`` also runs with autocast switched off for its device: one decode token is cheap, and the
recurrent state update must be computed in fp32 as the parallel kernels do (bf16 matmuls inside a
per-token solve or state update drift from ``forward`` by far more than bf16 rounding). An ``x_t`` in the
autocast dtype is raised (exactly) to the module's dtype first.
"""
from __future__ import annotations

import functools
import itertools
import numbers
from typing import Mapping

import torch

from kernels.common import autocast_dtype, autocast_off

from .options import OptionError


class MixerContractError(OptionError, TypeError):
    """A mixer's method returned what the contract refuses (an output of another shape, a state not laid out as
    ``init_state`` lays it out, found when it returns or at the ``step`` that reads it): where the zoo passes the
    mixer its own state (``zoo generate``), the fix is in the mixer's code. An :class:`~mixers.options.OptionError`
    (so a ``ValueError``, which the command line reports in one line, as it does a bad option) and a ``TypeError``."""

    def __init__(self, message: str):
        super().__init__("", message)


#: attribute set on a wrapped method, so that inherited or re-assigned methods are wrapped once
WRAPPED = "_mixer_boundary_checked"


def _shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def module_dtype(mixer: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the mixer's first floating parameter (or buffer); None if it has none. (Runs at every call:
    the generators stop at the first floating tensor instead of listing the module tree.)"""
    for tensor in itertools.chain(mixer.parameters(), mixer.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def check_input(mixer, x, where: str, arg: str, rank: int) -> None:
    """``x`` must be a floating tensor of ``rank`` dims (3: (batch, T, d_model), 2: (batch, d_model)) in the
    module's dtype, with a nonzero batch."""
    D = mixer.d_model
    expected = f"(batch, T, d_model={D})" if rank == 3 else f"(batch, d_model={D})"
    head = f"{mixer.name}.{where}: {arg}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{head} must be a torch.Tensor of shape {expected}, got {type(x).__name__}")
    if x.ndim != rank or x.shape[-1] != D:
        hint = ""
        if rank == 2 and x.ndim == 3:
            hint = "; step takes one token per sequence: run a whole sequence with prefill(x)"
        elif rank == 3 and x.ndim == 2:
            hint = "; for one token per sequence use x[:, None] or step(x_t, state)"
        raise ValueError(f"{head} must have shape {expected}, got {tuple(x.shape)}{hint}")
    want = module_dtype(mixer)
    if not x.is_floating_point():
        raise TypeError(f"{head} must be a floating-point tensor ({want or 'the module dtype'}), got {x.dtype}; "
                        f"token ids go through the model's embedding, not a mixer")
    if want is not None and x.dtype != want and autocast_dtype(x.device.type) != x.dtype:
        raise TypeError(f"{head} is {x.dtype} but the mixer's parameters are {want}; convert the input "
                        f"({arg}.to({want})) or the mixer (mixer.to({x.dtype}))")
    if x.shape[0] == 0:
        raise ValueError(f"{head} has batch size 0 (shape {tuple(x.shape)}); pass at least one sequence")


def check_mask(mixer, mask, x, where: str) -> None:
    if mask is None:
        return
    expected = tuple(x.shape[:2])
    head = f"{mixer.name}.{where}: mask"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{head} must be None or a tensor of shape (batch, T) = {expected}, got {type(mask).__name__}")
    if tuple(mask.shape) != expected:
        raise ValueError(f"{head} must have shape (batch, T) = {expected} like x {tuple(x.shape)}, "
                         f"got {tuple(mask.shape)}")


def state_layout(mixer, batch: int, dtype: torch.dtype | None = None) -> dict[str, tuple]:
    """``{key: shape}`` of ``init_state(batch)``, a dimension of size 0 (a cache length) as None; cached per
    batch size (built on the meta device, so it allocates nothing)."""
    return _layout(mixer, batch, dtype or torch.float32)[0]


def state_dtypes(mixer, batch: int, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``{key: dtype}`` of ``init_state(batch, dtype=dtype)`` (what ``prefill`` and ``step`` return for a module in
    ``dtype``)."""
    return _layout(mixer, batch, dtype)[1]


def _layout(mixer, batch: int, dtype: torch.dtype) -> tuple[dict[str, tuple], dict[str, torch.dtype]]:
    """``({key: shape}, {key: dtype})`` of ``init_state(batch, dtype=dtype)``, cached per batch size and dtype (read
    at every decode step)."""
    cache = mixer.__dict__.setdefault("_state_layouts", {})
    if (batch, dtype) not in cache:
        state = mixer.init_state(batch, device="meta", dtype=dtype)
        cache[(batch, dtype)] = ({k: tuple(None if s == 0 else s for s in v.shape) for k, v in state.items()},
                                 {k: v.dtype for k, v in state.items()})
    return cache[(batch, dtype)]


def check_state(mixer, state, x_t) -> dict:
    """``state`` checked against the layout of ``init_state``, with every tensor in a dtype that converts exactly
    to the one ``init_state`` gives it (a 16-bit state from a prefill under autocast) raised to that dtype."""
    head = f"{mixer.name}.step: state"
    if not isinstance(state, Mapping):
        raise TypeError(f"{head} must be the dict of tensors from init_state(batch_size) or prefill(x), "
                        f"got {type(state).__name__}")
    if not state:
        raise ValueError(f"{head} is empty; start from mixer.init_state(batch_size) or the state prefill(x) returns")
    B, want = x_t.shape[0], module_dtype(mixer)
    layout = state_layout(mixer, B, want)
    if set(state) != set(layout):
        raise MixerContractError(f"{head} must have the keys {sorted(layout)} (as init_state returns), got "
                                 f"{sorted(state)}")
    for key, shape in layout.items():
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise MixerContractError(f"{head}[{key!r}] must be a tensor of shape {_shape(shape)}, got "
                                     f"{type(value).__name__}")
        if value.ndim != len(shape) or any(s is not None and s != g for s, g in zip(shape, value.shape)):
            other = " (a state from another batch size?)" if value.ndim == len(shape) and value.shape[0] != B else ""
            raise MixerContractError(f"{head}[{key!r}] must have shape {_shape(shape)} for x_t of batch {B}, "
                                     f"got {tuple(value.shape)}{other}")
    if want is None:
        return state
    dtypes, convert = state_dtypes(mixer, B, want), False
    for key, dtype in dtypes.items():
        given = state[key].dtype
        if given == dtype:
            continue
        convert = True
        if dtype.is_floating_point and torch.promote_types(dtype, want) != dtype:  # narrower than the module's
            raise MixerContractError(f"{head}[{key!r}] is {given}, but init_state(batch_size, dtype={want}) of "
                                     f"this {want} {mixer.name} lays it out in {dtype}: init_state must create each "
                                     f"floating state tensor in the dtype it is given (torch.zeros(..., "
                                     f"device=device, dtype=dtype))")
        if not (given.is_floating_point and dtype.is_floating_point and torch.promote_types(given, dtype) == dtype):
            raise MixerContractError(f"{head}[{key!r}] is {given}, which does not convert exactly to the {dtype} "
                                     f"a {mixer.name} in {want} keeps it in (as init_state(batch_size) lays it out): "
                                     f"a state kept from the mixer in another dtype, or a prefill or step of this "
                                     f"mixer that returns it in another dtype than init_state's? Return each state "
                                     f"tensor in init_state's dtype, start again from init_state(batch_size) or "
                                     f"prefill(x), or convert the state (state[{key!r}].to({dtype}))")
    return {key: value.to(dtypes[key]) for key, value in state.items()} if convert else state


def check_returned_state(mixer, result, where: str, batch: int, dtype: torch.dtype | None):
    """``result`` of ``step``: ``(output, state)`` with the state's keys those of ``init_state`` (a wrong layout is
    named here, at the step that made it, not at the next one that reads it). Keys only, against the layout cached
    when the input state was checked: a decode step pays one set comparison. (``prefill`` is not checked: its
    layout would be built inside a training step's forward; the next ``step`` names a wrong one.)"""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        raise MixerContractError(f"{mixer.name}.{where} must return (output, state) with the state a dict laid out "
                                 f"as init_state(batch_size) returns it, got {type(result).__name__}")
    check_output(mixer, result[0], where, (batch, mixer.d_model), "(batch, d_model)")
    layout = state_layout(mixer, batch, dtype)
    if result[1].keys() != layout.keys():
        raise MixerContractError(f"{mixer.name}.{where} returned a state with the keys {sorted(result[1])}, but "
                                 f"init_state lays it out with {sorted(layout)}: return the state in init_state's "
                                 f"layout")
    return result


def outermost_checked(mixer, where: str, batch: int, dtype: torch.dtype | None, fn, *args, **kwargs):
    """``fn(mixer, *args, **kwargs)`` with its returned state checked (against the layout for ``batch`` and the
    module's ``dtype``), unless this call runs inside another
    ``step`` of the same mixer (a subclass that calls ``super().step`` and returns a state of its own layout: its
    outer call is the one checked)."""
    depth = mixer.__dict__.get(_DEPTH, 0)
    mixer.__dict__[_DEPTH] = depth + 1
    try:
        result = fn(mixer, *args, **kwargs)
    finally:
        mixer.__dict__[_DEPTH] = depth
    return check_returned_state(mixer, result, where, batch, dtype) if depth == 0 else result


#: how many checked ``step`` calls of a mixer are running (nested through ``super()``)
_DEPTH = "_boundary_call_depth"


def empty_output(mixer, x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(x.shape[0], 0, mixer.d_model)


def check_output(mixer, y, where: str, shape: tuple, named: str) -> None:
    """The output of ``forward`` / ``prefill`` / ``step`` must be a tensor of the input's ``shape`` (``named`` says
    which dims): a wrong width fails here, naming the method, rather than in the residual sum, or broadcasting
    there silently (a ``(batch, T, 1)`` output, a ``(batch, 1, d_model)`` step)."""
    if not isinstance(y, torch.Tensor):
        raise MixerContractError(f"{mixer.name}.{where} must return its output as a tensor of shape {named} = "
                                 f"{shape}, got {type(y).__name__}")
    if tuple(y.shape) != tuple(shape):
        fix = "; project it back to d_model" if y.ndim and y.shape[-1] != mixer.d_model else ""
        raise MixerContractError(f"{mixer.name}.{where} returned an output of shape {tuple(y.shape)} for an input "
                                 f"of shape {tuple(shape)}: a mixer maps {named} to the same shape{fix}")


def checked_forward(fn):
    @functools.wraps(fn)
    def forward(self, x, mask=None, *args, **kwargs):
        check_input(self, x, "forward", "x", 3)
        check_mask(self, mask, x, "forward")
        if x.shape[1] == 0:
            return empty_output(self, x)
        y = fn(self, x, mask, *args, **kwargs)
        check_output(self, y, "forward", tuple(x.shape), "(batch, T, d_model)")
        return y
    setattr(forward, WRAPPED, True)
    return forward


def checked_prefill(fn):
    @functools.wraps(fn)
    def prefill(self, x, mask=None, *args, **kwargs):
        check_input(self, x, "prefill", "x", 3)
        check_mask(self, mask, x, "prefill")
        if x.shape[1] == 0:
            return empty_output(self, x), self.init_state(x.shape[0], device=x.device, dtype=x.dtype)
        result = fn(self, x, mask, *args, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
            # forward takes prefill(x)[0]: a bare output would give the first sequence's output for every sequence
            raise MixerContractError(f"{self.name}.prefill must return (y, state), the state a dict laid out as "
                                     f"init_state(batch_size) returns it, got {type(result).__name__}")
        check_output(self, result[0], "prefill", tuple(x.shape), "(batch, T, d_model)")
        return result
    setattr(prefill, WRAPPED, True)
    return prefill


def checked_step(fn):
    @functools.wraps(fn)
    def step(self, x_t, state, *args, **kwargs):
        check_input(self, x_t, "step", "x_t", 2)
        state = check_state(self, state, x_t)
        want = module_dtype(self)
        if want is not None and x_t.dtype != want:   # the autocast dtype, accepted above: raised exactly
            x_t = x_t.to(want)
        with autocast_off(x_t.device.type):
            return outermost_checked(self, "step", x_t.shape[0], want, fn, x_t, state, *args, **kwargs)
    setattr(step, WRAPPED, True)
    return step


def module_device(mixer: torch.nn.Module) -> torch.device | None:
    """The device of the mixer's first floating parameter (or buffer); None if it has none."""
    for tensor in itertools.chain(mixer.parameters(), mixer.buffers()):
        if tensor.is_floating_point():
            return tensor.device
    return None


def check_count(mixer, value, where: str, arg: str) -> None:
    """``value`` must be a non-negative integer (a batch size, a sequence length), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{mixer.name}.{where}: {arg} must be a non-negative int, got {type(value).__name__} "
                        f"{value!r}")
    if value < 0:
        raise ValueError(f"{mixer.name}.{where}: {arg} must be a non-negative int, got {value}")


def defaulted_init_state(fn):
    @functools.wraps(fn)
    def init_state(self, batch_size, device=None, dtype=None, *args, **kwargs):
        check_count(self, batch_size, "init_state", "batch_size")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"{self.name}.init_state: dtype must be a floating torch.dtype (or None for the mixer's "
                            f"own), got {dtype!r}")
        device = module_device(self) if device is None else device
        dtype = module_dtype(self) if dtype is None else dtype
        state = fn(self, batch_size, device, dtype, *args, **kwargs)
        if not (isinstance(state, Mapping) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
            raise MixerContractError(f"{self.name}.init_state must return the state as a non-empty dict of "
                                     f"tensors, such as {{'s': torch.zeros(batch_size, ..., device=device, "
                                     f"dtype=dtype)}}, got {_described(state)}")
        return state
    setattr(init_state, WRAPPED, True)
    return init_state


def _described(value) -> str:
    """``value``'s type, and for a mapping the types of its values: what a refusal of a returned state shows."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in value.items()) + "}"
    return type(value).__name__


def checked_state_size(fn, method: str = ""):
    """``state_size`` / ``active_state_size`` (``method``: which, by default ``fn``'s name): ``seq_len`` checked (a
    negative or fractional length gave a negative or fractional count), and so is the count returned."""
    method = method or fn.__name__  # the name it is called by (a lambda's __name__ is "<lambda>")

    @functools.wraps(fn)
    def state_size(self, seq_len, *args, **kwargs):
        check_count(self, seq_len, method, "seq_len")
        size = fn(self, seq_len, *args, **kwargs)
        # a count goes into zoo check's line and every results row: a tensor there ends a finished run unrecorded
        if isinstance(size, bool) or not isinstance(size, (numbers.Integral, torch.SymInt)) or size < 0:
            raise MixerContractError(f"{self.name}.{method}({seq_len}) must return a non-negative int, the "
                                     f"state's elements per sequence, got {type(size).__name__} {size!r}; return "
                                     f"a Python int (int(...) of a tensor or a float)")
        return size
    setattr(state_size, WRAPPED, True)
    return state_size


WRAPPERS = {"forward": checked_forward, "prefill": checked_prefill, "step": checked_step,
            "init_state": defaulted_init_state, "state_size": functools.partial(checked_state_size, method="state_size"),
            "active_state_size": functools.partial(checked_state_size, method="active_state_size")}


def wrap_methods(cls) -> None:
    """Wrap the ``forward`` / ``prefill`` / ``step`` / ``init_state`` / ``state_size`` / ``active_state_size`` that
    ``cls`` itself defines (once each)."""
    for name, wrapper in WRAPPERS.items():
        fn = cls.__dict__.get(name)
        if callable(fn) and not getattr(fn, WRAPPED, False):
            setattr(cls, name, wrapper(fn))
