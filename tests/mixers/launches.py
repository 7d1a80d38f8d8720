"""Counting the kernel launches of a piece of code without a GPU: what ``tests/mixers/test_launches.py``
asserts about every registered mixer's layer on the GPU path (:func:`kernels.device.gpu_path_on_cpu`,
Triton kernels through the interpreter), and what the kernel tests (``tests/kernels/test_slots.py``,
``test_blockscan.py``) assert about a family's launchers, run on ``meta`` tensors with the kernels counted but
not run (any length costs nothing).

What counts as a launch (what ``torch.profiler`` lists as CUDA kernels and copies for the same code on a
GPU):

- every ATen operation that reaches the dispatcher below autograd (a :class:`TorchDispatchMode` sees it)
  and computes or moves data: arithmetic, reductions, matmuls, copies and casts (``copy_``,
  ``_to_copy``, ``clone``), fills (``zeros``, ``zero_``, ``fill_``) and ``.item()`` (a device-to-host copy
  that also waits for the device);
- every Triton kernel launched through :func:`kernels.launch.launch` (the zoo's one launch point), counted
  once; the torch operations the interpreter itself runs inside a launch are not counted (on a GPU they
  are the kernel).

Not counted, because no kernel runs for them: views and aliases (an operator whose schema says its
output aliases an input without writing it: ``view``, ``transpose``, ``expand``, ``select``, ``split``,
``unbind``, ``as_strided``, ``detach``...; and ``_unsafe_view``, a view the schema does not mark),
allocation without initialisation (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``...),
``lift_fresh`` (wrapping a constant) and operators without a tensor output (``promote_types``: host-side
dtype arithmetic).
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.launch import counting, launching

aten = torch.ops.aten

#: operators that run no kernel although their schema does not mark an alias (see the module docstring)
NO_KERNEL = {
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten._unsafe_view.default, aten.lift_fresh.default,
}


def runs_a_kernel(func) -> bool:
    """Whether the ATen operator ``func`` runs a kernel on a GPU (the module docstring's rule)."""
    if func in NO_KERNEL:
        return False
    if func is aten._local_scalar_dense.default:
        return True
    returns = func._schema.returns
    if not any(isinstance(r.type, (torch.TensorType, torch.ListType, torch.OptionalType))
               and "Tensor" in str(r.type) for r in returns):
        return False                          # no tensor out: a dtype or shape computation on the host
    aliases = [r.alias_info for r in returns if r.alias_info is not None]
    return not (aliases and all(not a.is_write for a in aliases))


#: allocations without initialisation: poisoned when the kernels do not run (see :func:`count_launches`)
ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
               aten.new_empty.default, aten.new_empty_strided.default}


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with what no computation may read: NaN, or the largest integer of its dtype (an index out
    of every range)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif not t.is_complex() and t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


class _CountAten(TorchDispatchMode):
    def __init__(self, poison_allocations: bool):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.poison_allocations = poison_allocations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not launching() and runs_a_kernel(func):
            self.counts[func.name()] += 1
        out = func(*args, **(kwargs or {}))
        if self.poison_allocations and func in ALLOCATIONS:
            poison(out)
        return out


def count_launches(fn, execute: bool = True) -> tuple[int, collections.Counter]:
    """Run ``fn()`` and return ``(launches, by operator or kernel name)`` (the module docstring's rule).

    ``execute=False``: the Triton kernels are counted without running (:func:`kernels.launch.counting`), so
    the interpreter's time per program does not make a count of long inputs slow; the values computed
    inside are then arbitrary, which does not change the count of code without data-dependent branches.
    Every allocation is then poisoned (:func:`poison`): what a kernel would have written holds NaN or an index
    out of range, so glue that indexes with a kernel's output fails here, where on a GPU, inside a
    compile-ahead (:mod:`kernels.ahead`: the kernels compiled, not run), it would stop the device with an
    assertion."""
    with counting(execute) as kernels, _CountAten(poison_allocations=not execute) as mode:
        fn()
    by_name = mode.counts + collections.Counter({f"triton:{k}": v for k, v in kernels.items()})
    return sum(by_name.values()), by_name
