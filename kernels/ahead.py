"""Compile the Triton kernels a run will launch before it launches them: all at once, one per CPU core.

Triton compiles a kernel the first time it is launched with a new specialisation (argument types, which
pointers and integers are multiples of 16, constexpr values), and it does so at the launch, one kernel after
another on one core. A layer's first forward+backward is therefore as slow as the sum of its kernels' compile
times: for sm_90 one core takes about 14 s for Gated KalmaNet's 18 kernels, 8 s for the Kronecker slots' 12
and 7 s for the delta rule's 14 (``python -m zoo.benchmark.first_compile``), although no kernel takes more
than 2 s alone.

:func:`compile_ahead` calls a function once with every launch made through :func:`kernels.launch.launch`
replaced by Triton's warm-up of that kernel for those very arguments (``JITFunction.warmup``: the launcher's
own specialisation, so the compiled kernel lands in the entry the real launch looks up), submitted to a pool
of threads through Triton's asynchronous compile mode (``triton.runtime._async_compile``; its compiler
releases the GIL in its passes and runs ``ptxas`` as a process of its own), and returns once every kernel
is compiled. The real first call then finds them all. Without that mode (an older Triton) the kernels
compile one after another, still before the run.

A compiled kernel is not yet ready to launch: its first launch loads it onto the device and, with Triton up to
3.6, builds its launcher by compiling a small C module with the system's C compiler (about 0.3 s a kernel, one
after another: 4 s of Gated DeltaNet's first forward+backward on an H200 after its kernels were compiled
ahead). :func:`compile_ahead` therefore also loads every kernel it compiled (:func:`load_kernels`), on the same
threads, so that the first call launches at once.

Inside :func:`compile_ahead` no kernel runs: its outputs keep whatever their launcher allocated, so the
function must not depend on values (the zoo's launchers never read device values on the host).
:func:`forward_backward_ahead` gives a module's forward and backward this way (:func:`dry_forward_backward`),
without touching any ``.grad`` or the random streams. Only CUDA tensors have anything to compile: on a CPU, and under the
Triton interpreter, nothing is compiled and the report says why.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .backend import triton_importable, triton_interpreting

#: most threads one compile-ahead uses (each compile is one core's work; more threads than kernels are idle)
MAX_WORKERS = 32

_active: _Ahead | None = None


@dataclass
class AheadReport:
    """What one :func:`compile_ahead` did."""

    launches: int = 0              # launches the run made (each warmed up instead of run)
    compiled: int = 0              # kernels compiled (distinct specialisations; a cached one counts too)
    loaded: int = 0                # of those, kernels loaded onto their device (launcher built) ahead
    workers: int = 0               # compile threads (1: one after another, as the launches would)
    seconds: float = 0.0           # wall time of the whole compile-ahead, the run included
    run_seconds: float = 0.0       # of it, the run itself (its launches submitted; with one thread, compiled)
    wait_seconds: float = 0.0      # then the wait for the compiles still running when the run returned
    load_seconds: float = 0.0      # then the loading onto the device (:func:`load_kernels`)
    skipped: str | None = None     # why nothing was compiled

    def describe(self) -> str:
        if self.skipped:
            return f"no kernels compiled ahead: {self.skipped}"
        return (f"compiled {self.compiled} Triton kernels for {self.launches} launches ahead ({self.loaded} loaded "
                f"onto the device) in {self.seconds:.1f} s on {self.workers} thread{'s' if self.workers != 1 else ''} "
                f"(the run {self.run_seconds:.1f} s, then waiting for compiles {self.wait_seconds:.1f} s, loading "
                f"{self.load_seconds:.1f} s)")


def available_cores() -> int:
    """CPU cores this process may use, shared among the processes of a ``torchrun`` job on this host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def compiler_refusal() -> str | None:
    """Why this process compiles no Triton kernel at all, or None."""
    if triton_interpreting():
        return "the Triton interpreter (TRITON_INTERPRET=1) compiles nothing"
    if not triton_importable():
        return "triton is not installed"
    return None


def skip_reason(device: torch.device) -> str | None:
    """Why a run on ``device`` has no Triton kernels to compile, or None when it has."""
    if device.type != "cuda":
        return f"Triton kernels compile for CUDA devices, and these tensors are on {device.type}"
    return compiler_refusal()


def _async_compile_module():
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    return _async_compile if hasattr(_async_compile, "AsyncCompileMode") else None


def _jit_function(kernel):
    """The JITFunction under autotune/heuristics wrappers (they keep it as ``.fn``)."""
    while not hasattr(kernel, "device_caches"):
        kernel = kernel.fn
    return kernel


def _compiled_by_device(fn) -> dict:
    """``{(device, cache key): compiled kernel}`` of a JITFunction's caches."""
    return {(device, key): kernel for device, caches in list(fn.device_caches.items())
            for key, kernel in list(caches[0].items())}


def _load(device, kernel) -> bool:
    """Load one compiled kernel onto ``device`` as its first launch would (Triton's ``_init_handles``: the
    binary onto the device, the launcher built). False where this Triton has no such step or it fails: the
    first launch then does it, and raises what it raises."""
    init = getattr(kernel, "_init_handles", None)
    if init is None or getattr(kernel, "module", None) is not None:
        return False
    on_device = torch.cuda.device(device) if isinstance(device, int) and torch.cuda.is_available() \
        else contextlib.nullcontext()               # the device whose launches look the kernel up
    try:
        with on_device:
            init()
        return True
    except Exception:  # noqa: BLE001 - shared memory over the card's, say: the launch reports it
        return False


def load_kernels(kernels: list[tuple[object, object]], workers: int) -> int:
    """Load every ``(device, compiled kernel)`` (:func:`_load`), ``workers`` at a time; returns how many were
    loaded. The launchers' C compiles run as processes of their own, so threads overlap them."""
    if not kernels:
        return 0
    if workers <= 1:
        return sum(_load(device, kernel) for device, kernel in kernels)
    with ThreadPoolExecutor(min(workers, len(kernels)), thread_name_prefix="load-ahead") as pool:
        return sum(pool.map(lambda item: _load(*item), kernels))


class _Ahead:
    """The launches of one compile-ahead, each turned into a warm-up of its kernel."""

    def __init__(self, mode, async_module):
        self.mode, self.async_module, self.launches = mode, async_module, 0
        self.before: dict[int, tuple[object, set]] = {}  # id(JITFunction) -> (it, its cache keys before)

    def new_kernels(self) -> list[tuple[object, object]]:
        """``(device, compiled kernel)`` of every kernel added to the JIT caches of the functions launched since
        the start (a kernel Triton found in its disk cache counts too)."""
        return [(key[0], kernel) for fn, keys in self.before.values()
                for key, kernel in _compiled_by_device(fn).items() if key not in keys]

    def warm(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        self.launches += 1
        fn = _jit_function(kernel)
        if id(fn) not in self.before:
            self.before[id(fn)] = (fn, set(_compiled_by_device(fn)))
        if self.mode is None:
            kernel.warmup(*args, grid=grid, **kwargs)
            return
        # Triton reads its async mode from a context variable; autograd runs a CUDA backward on threads of
        # its own, which do not see the caller's, so it is set around every warm-up, in whichever thread
        token = self.async_module.active_mode.set(self.mode)
        try:
            kernel.warmup(*args, grid=grid, **kwargs)
        finally:
            self.async_module.active_mode.reset(token)


def warming_up() -> _Ahead | None:
    """The active compile-ahead (:func:`kernels.launch.launch` warms its kernels up instead of running them)."""
    return _active


def compile_ahead(run: Callable[[], object], workers: int | None = None) -> AheadReport:
    """Call ``run()`` with its Triton launches compiled instead of run, ``workers`` (default: every core this
    process may use) at a time; returns once every kernel is compiled. ``workers=1`` compiles each kernel at its
    launch, one after another, as a first call does. Inside another compile-ahead, ``run`` joins the outer
    one. Where nothing compiles (:func:`compiler_refusal`), ``run`` is not called."""
    global _active
    start = time.perf_counter()
    why = compiler_refusal()
    if why is not None:
        return AheadReport(skipped=why)
    if _active is not None:
        before = _active.launches
        run()
        return AheadReport(launches=_active.launches - before, seconds=time.perf_counter() - start,
                           skipped="joined the compile-ahead already running")
    async_module = _async_compile_module()
    workers = 1 if async_module is None else max(1, min(workers or available_cores(), MAX_WORKERS))
    if workers == 1:
        async_module = None
    report = AheadReport(workers=workers)
    with contextlib.ExitStack() as stack:
        mode = None
        if async_module is not None:
            pool = stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="compile-ahead"))
            # its exit waits for every compile and files each kernel where its launches will look it up
            mode = stack.enter_context(async_module.AsyncCompileMode(pool))
        ahead = _active = _Ahead(mode, async_module)
        try:
            run()
        finally:
            _active = None
            ran = time.perf_counter()
    waited = time.perf_counter()
    compiled = ahead.new_kernels()
    report.launches, report.compiled = ahead.launches, len(compiled)
    report.loaded = load_kernels(compiled, workers)
    report.seconds = time.perf_counter() - start
    report.run_seconds, report.wait_seconds = ran - start, waited - ran
    report.load_seconds = report.seconds - (waited - start)
    return report


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or those of a list, tuple or dict, at any depth."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def _device_of(module: torch.nn.Module, inputs: tuple) -> torch.device:
    devices = {t.device for t in tensors_in(inputs)} or {p.device for p in module.parameters()}
    return next(iter(devices), torch.device("cpu"))


def dry_forward_backward(module: torch.nn.Module, *inputs, **kwargs) -> None:
    """``module(*inputs, **kwargs)`` and its backward to the parameters and the floating-point inputs, leaving
    no ``.grad`` and the random streams where they were (what :func:`forward_backward_ahead` compiles)."""
    device = _device_of(module, inputs)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        xs = [x.detach().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
        outs = [t for t in tensors_in(module(*xs, **kwargs)) if t.requires_grad]
        wrt = [p for p in module.parameters() if p.requires_grad] + [x for x in xs if torch.is_tensor(x)
                                                                      and x.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)


def forward_backward_ahead(module: torch.nn.Module, *inputs, workers: int | None = None, **kwargs) -> AheadReport:
    """Compile ahead every kernel of ``module(*inputs, **kwargs)`` and of its backward
    (:func:`dry_forward_backward`, with its kernels compiled, not run).

    Run it under the autocast region the real calls use: the kernels compiled are those of the dtypes
    that reach them."""
    why = skip_reason(_device_of(module, inputs))
    if why is not None:
        return AheadReport(skipped=why)
    return compile_ahead(lambda: dry_forward_backward(module, *inputs, **kwargs), workers)
