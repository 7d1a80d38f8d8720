"""Where one call's time goes, kernel by kernel: the breakdown a GPU speed run records beside its timings.

On CUDA, ``torch.profiler`` lists every device kernel (and copy) a call runs, with its duration on the
device. On a CPU there are no device kernels: the ATen operators dispatched below autograd (views
included) stand in, each timed by the wall clock around it, and so does each Triton launch the
interpreter runs (named after its kernel, as the profiler names it on CUDA; the interpreter's own torch
operations inside a launch are the launch), so that a dry run exercises the same pipeline (its numbers
mean nothing).

:func:`breakdown` returns the count (the launches target: it does not depend on the timings), the summed
device time, and the kernels grouped by name, longest first. Comparing ``device_ms`` with the wall time of
the same call says how launch-bound it is: a GPU busy for 5 ms of a 50 ms call waits on the host.

:func:`host_issue` says why: the host's own time to issue the call (on CUDA the call returns once its work is
queued, so a host time near the wall time means the device waits on Python, autograd and the launchers), and
the places where the call waits for the device (CUDA's sync debug mode: a read of a device value on the host,
say), each of which empties the queue and leaves the device idle while the host catches up.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.launch import counting, launching

#: longest kernel name kept (C++ kernel names carry whole template argument lists)
NAME_CHARS = 96


@dataclass
class Breakdown:
    """One call's kernels: ``kernels`` holds ``{"name", "calls", "ms"}`` per distinct name, longest first."""

    launches: int = 0
    device_ms: float = 0.0
    kernels: list = field(default_factory=list)

    def as_row(self) -> dict:
        return {"launches": self.launches, "device_ms": round(self.device_ms, 4), "kernels": self.kernels}


def short_name(name: str) -> str:
    """A kernel's name as a table shows it: without the ``void`` of a C++ signature, whitespace collapsed,
    cut to :data:`NAME_CHARS` characters."""
    name = " ".join(name.split())
    if name.startswith("void "):
        name = name[len("void "):]
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 3] + "..."


def profiler_name(kernel: str) -> str:
    """The name the CUDA profiler gives a Triton kernel (its function's), from
    :func:`kernels.launch.kernel_name`'s ``family.function``."""
    return kernel.rsplit(".", 1)[-1]


def group(timed: list[tuple[str, float]]) -> Breakdown:
    """``(name, microseconds)`` per launch -> a :class:`Breakdown` (milliseconds, longest name first)."""
    by_name: dict[str, list] = {}
    for name, us in timed:
        entry = by_name.setdefault(short_name(name), [0, 0.0])
        entry[0] += 1
        entry[1] += us / 1e3
    kernels = [{"name": n, "calls": c, "ms": round(ms, 4)}
               for n, (c, ms) in sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))]
    return Breakdown(len(timed), sum(us for _, us in timed) / 1e3, kernels)


def profiled_events(fn, activity: ProfilerActivity, device_type) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every ``torch.profiler`` event of ``device_type`` that ``fn()`` records
    under ``activity`` (CPU activity is always on: the profiler needs it to place device events)."""
    activities = [ProfilerActivity.CPU] if activity == ProfilerActivity.CPU else [ProfilerActivity.CPU, activity]
    with profile(activities=activities) as prof:
        fn()
        if activity == ProfilerActivity.CUDA:
            torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == device_type and not is_annotation(e)]


def is_annotation(event) -> bool:
    """Whether a profiler event is a ``record_function`` range rather than work: on CUDA such a range is also
    drawn on the device's timeline (the optimizer's ``Optimizer.step#AdamW.step`` spans its kernels), and
    counting it would add a launch and its span, already counted in its kernels, to the device time."""
    kind = str(getattr(event, "activity_type", "") or "").lower()
    return bool(getattr(event, "is_user_annotation", False)) or kind.endswith("user_annotation")


def cuda_breakdown(fn) -> Breakdown:
    """The device kernels and copies ``fn()`` runs on CUDA, with their durations."""
    torch.cuda.synchronize()
    return group(profiled_events(fn, ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA))


class _TimeOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.timed: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launching():   # the interpreter running a kernel: timed as the launch
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.timed.append((str(func), (time.perf_counter() - start) * 1e6))
        return out


def cpu_breakdown(fn) -> Breakdown:
    """The ATen operators ``fn()`` dispatches below autograd and the Triton kernels it launches (interpreted),
    each timed by the wall clock: the CPU stand-in."""
    with counting(timed=True) as launches, _TimeOperators() as mode:
        fn()
    kernels = [(profiler_name(name), seconds * 1e6) for name, seconds in launches.timed]
    return group(mode.timed + kernels)


#: how a call's kernels are found, by device type
BREAKDOWNS = {"cuda": cuda_breakdown, "cpu": cpu_breakdown}


def breakdown(fn, device: torch.device) -> Breakdown:
    """:class:`Breakdown` of ``fn()`` on ``device`` (CUDA: device kernels; CPU: operators dispatched)."""
    return BREAKDOWNS[device.type](fn)


#: the words of CUDA's sync debug mode warning (torch.cuda.set_sync_debug_mode)
SYNC_WARNING = "synchronizing"


def host_issue(fn, device: torch.device) -> dict:
    """``host_ms``: wall time of ``fn()`` from an idle device until the call returns, without waiting for the
    device at its end (on a CPU: the call). ``syncs``: how many times ``fn()`` waited for the device (CUDA's
    sync debug mode, in a second call, on the calling thread; None off CUDA) and ``sync_sites``: where, as
    ``file:line`` of the Python code that asked (at most 5 distinct)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - start) * 1e3
    if device.type != "cuda":
        return {"host_ms": round(host_ms, 4), "syncs": None, "sync_sites": []}
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings_of_this_thread(SYNC_WARNING) as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # only fn's own: switching the mode may wait once itself, the first time in a process
            # (torch.cuda's set_sync_debug_mode, measured on an H200 with torch 2.11)
            first = len(found)
            fn()
            syncs = found[first:]
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return {"host_ms": round(host_ms, 4), "syncs": len(syncs), "sync_sites": list(dict.fromkeys(syncs))[:5]}


@contextlib.contextmanager
def warnings_of_this_thread(marker: str):
    """Within the block, every warning whose message holds ``marker`` and that the calling thread raises (each
    time, not once per place) is listed as ``file:line`` in the list the block gets. The warnings filter is
    the process's: another thread's warnings of the same time (a compile-ahead's, say) are not the block's."""
    caller, found = threading.get_ident(), []

    def keep(message, category, filename, lineno, file=None, line=None):
        if threading.get_ident() == caller and marker in str(message):
            found.append(f"{filename}:{lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        yield found
