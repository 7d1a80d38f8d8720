"""The one place every Triton kernel of the zoo is launched from, so its launches can be listed.

Each ``triton.py`` launches its kernels with :func:`launch` (``launch(kernel, grid, *args, **kwargs)``
instead of ``kernel[grid](*args, **kwargs)``). Normally that is the same call. Inside
:func:`recording` nothing runs: each launch is recorded as a :class:`Launch` — the kernel, the type
of every runtime argument (pointer element types from the tensors, ``i32``/``i64``/``fp32``
scalars), the constexpr values, ``num_warps`` and ``num_stages`` — with one record per config when
the kernel is autotuned. Running a launcher (forward and backward) on ``meta`` tensors inside
:func:`recording` therefore lists exactly the launches it makes at any size without a GPU, which is
how :mod:`zoo.benchmark.compile_check` finds what to compile: the configurations come from the launchers'
own code, never from a second copy. Inside :func:`counting` every launch is counted by kernel name (and
runs, unless told not to), and :func:`launching` says whether a launch is running (the interpreter runs
torch operations of its own inside a launch, which a count of a layer's operations leaves out: on a GPU
they are the kernel). Inside :func:`kernels.ahead.compile_ahead` every launch is compiled instead of run,
and inside :func:`host_only` it does everything but run. On a CUDA device a launch takes the options its
architecture's launch table measured for exactly its configuration (:mod:`kernels.launch_table`), whichever
of these it is; :meth:`Launch.on_arch` gives a record the same options for the compile check.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import time
from dataclasses import dataclass, field, replace

import torch

from . import launch_table
from .ahead import warming_up

#: Triton's defaults for CUDA launches that do not name them (triton.backends.nvidia CUDAOptions)
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3

_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}

_recorder: list | None = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it (no grid, no data)."""

    kernel: object                       # the @triton.jit function
    signature: tuple                     # ((arg name, triton type), ...) for every runtime argument
    constexprs: tuple                    # ((name, value), ...) sorted by name
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES
    tags: tuple = field(default=(), compare=False)  # where it was recorded (family, dtype, sizes)
    aligned: tuple = ()                  # arguments Triton specialises as divisible by 16 (pointers and ints)

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)

    def key(self):
        return (self.name, self.signature, self.constexprs, self.num_warps, self.num_stages, self.aligned)

    def config(self) -> tuple[bool, dict]:
        """``(sixteen_bit, constexprs)`` as :func:`launch_config` gives them for the launch this records."""
        declared = {name for _, name, _ in constexpr_params(self.kernel)}
        return (any(t in ("*bf16", "*fp16") for _, t in self.signature),
                {k: v for k, v in self.constexprs if k in declared})

    def on_arch(self, arch: int, directory: str | None = None) -> Launch:
        """This launch as a GPU of ``sm_<arch>`` makes it: with the options of the architecture's launch table
        where an entry matches it (:mod:`kernels.launch_table`), else unchanged."""
        options = launch_table.lookup(arch, self.name, *self.config(), directory or launch_table.directory())
        return replace(self, **options) if options else self


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return f"{fn.__module__.rsplit('.', 2)[-2]}.{fn.__name__}"


def _arg_type(name, value) -> str:
    if torch.is_tensor(value):
        if value.dtype not in _TORCH_TO_TRITON:
            raise TypeError(f"launch: argument {name} has dtype {value.dtype}, which no kernel accepts")
        return "*" + _TORCH_TO_TRITON[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"launch: argument {name} of type {type(value).__name__} cannot be passed to a kernel")


def jit_function(kernel):
    """The JITFunction under autotune/heuristics wrappers (they keep it as ``.fn``)."""
    while not hasattr(kernel, "arg_names") or type(kernel).__name__ in ("Autotuner", "Heuristics"):
        kernel = kernel.fn
    return kernel


def _records(kernel, args, kwargs, tags):
    fn = jit_function(kernel)
    configs = getattr(kernel, "configs", None) or [None]
    out = []
    for cfg in configs:
        kw = dict(kwargs)
        if cfg is not None:
            kw.update(cfg.kwargs)
            kw.setdefault("num_warps", cfg.num_warps)
            kw.setdefault("num_stages", cfg.num_stages)
        warps = kw.pop("num_warps", DEFAULT_NUM_WARPS)
        stages = kw.pop("num_stages", DEFAULT_NUM_STAGES)
        bound = dict(zip(fn.arg_names, args))
        bound.update(kw)
        missing = [n for n in fn.arg_names if n not in bound]
        if missing:
            raise TypeError(f"launch: {kernel_name(fn)} is missing arguments {missing}")
        const_names = {fn.arg_names[i] for i in fn.constexprs}
        specialised = _specialisation(fn, bound, const_names)
        ones = {n for n, how in specialised.items() if how == "one"}
        sig = tuple((n, _arg_type(n, bound[n])) for n in fn.arg_names if n not in const_names | ones)
        consts = tuple(sorted((n, bound[n]) for n in const_names | ones))
        aligned = tuple(n for n in fn.arg_names if specialised.get(n) == "aligned")
        out.append(Launch(fn, sig, consts, warps, stages, tags, aligned))
    return out


def _specialisation(fn, bound: dict, const_names: set) -> dict:
    """How Triton's launcher specialises each runtime argument, as on a GPU: an integer equal to 1 becomes the
    constant 1 (``"one"``); a pointer whose address (its storage offset, the allocation being aligned) or an
    integer that is a multiple of 16 is compiled as divisible by 16 (``"aligned"``), which lets loads vectorise;
    ``do_not_specialize`` / ``do_not_specialize_on_alignment`` turn these off per argument."""
    out = {}
    for i, name in enumerate(fn.arg_names):
        if name in const_names:
            continue
        value, param = bound[name], fn.params[i]
        if param.do_not_specialize or isinstance(value, bool):
            continue
        if isinstance(value, int) and value == 1:
            out[name] = "one"
        elif param.do_not_specialize_on_alignment:
            continue
        elif isinstance(value, int) and value % 16 == 0:
            out[name] = "aligned"
        elif torch.is_tensor(value) and value.storage_offset() * value.element_size() % 16 == 0:
            out[name] = "aligned"
    return out


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or only a record of it inside :func:`recording`, or only its compile
    inside :func:`kernels.ahead.compile_ahead`; on a CUDA device with the options its architecture's launch
    table measured for this very launch (:mod:`kernels.launch_table`), and with those of :func:`launch_options`
    where given."""
    global _running
    arch = _arch_of(args)
    if arch is not None and not _autotuned(kernel):
        kwargs = _with_table_options(kernel, arch, args, kwargs)
    if _options:
        kwargs = _with_options(kernel, kwargs)
    if _recorder is not None:
        _recorder.extend(_records(kernel, args, kwargs, _recorder_tags[-1] if _recorder_tags else ()))
        return None
    ahead = warming_up()
    if ahead is not None:
        ahead.warm(kernel, grid, args, kwargs)
        return None
    if _counters:
        name = _count(kernel, args, kwargs)
        if not _counters[-1].execute:
            return None
    if _host_only:
        return None
    timers = [c for c in _counters if c.timed is not None]
    start = time.perf_counter() if timers else 0.0
    _running += 1
    try:
        return kernel[grid](*args, **kwargs)
    finally:
        _running -= 1
        for counter in timers:
            counter.timed.append((name, time.perf_counter() - start))


_CAPABILITY: dict = {}


def _arch_of(args) -> int | None:
    """The compute capability (``90`` for sm_90) of the CUDA device of the first tensor argument, or None off
    CUDA (:func:`kernels.launch_table.as_if_arch` forces one)."""
    if launch_table.forced_arch is not None:
        return launch_table.forced_arch
    for a in args:
        if isinstance(a, torch.Tensor):
            return cuda_arch(a.device.index) if a.device.type == "cuda" else None
    return None


def cuda_arch(index: int | None = None) -> int:
    """The compute capability of a CUDA device (default: the current one) as one number, ``90`` for sm_90."""
    if index is None:
        index = torch.cuda.current_device()
    if index not in _CAPABILITY:
        major, minor = torch.cuda.get_device_capability(index)
        _CAPABILITY[index] = 10 * major + minor
    return _CAPABILITY[index]


def launch_config(kernel, args: tuple, kwargs: dict) -> tuple[bool, dict]:
    """``(sixteen_bit, constexprs)`` of a launch: whether any tensor argument is bf16 / fp16, and the value of
    every constexpr argument (what a launch table entry matches, :mod:`kernels.launch_table`)."""
    sixteen = any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16)
                  for a in (*args, *kwargs.values()))
    consts = {name: args[i] if i < len(args) else kwargs.get(name, default)
              for i, name, default in constexpr_params(jit_function(kernel))}
    return sixteen, consts


_CONSTEXPR_PARAMS: dict = {}


def constexpr_params(fn) -> tuple:
    """``(index, name, default)`` of every constexpr parameter of a jitted function (compiled or interpreted:
    the interpreter's functions do not list them, their annotations do)."""
    found = _CONSTEXPR_PARAMS.get(fn)
    if found is None:
        params = inspect.signature(fn.fn).parameters.values()
        found = tuple((i, p.name, p.default) for i, p in enumerate(params)
                      if p.annotation is not inspect.Parameter.empty and "constexpr" in str(p.annotation))
        _CONSTEXPR_PARAMS[fn] = found
    return found


def _with_table_options(kernel, arch: int, args: tuple, kwargs: dict) -> dict:
    table = launch_table.options_by_kernel(arch, launch_table.directory())
    entries = table and table.get(kernel_name(jit_function(kernel)))
    if not entries:                   # no table, or no entry for this kernel: its configuration is not formed
        return kwargs
    options = entries.get(launch_table.config_key(*launch_config(kernel, args, kwargs)))
    return {**kwargs, **options} if options else kwargs


def _autotuned(kernel) -> bool:
    return bool(getattr(kernel, "configs", None))


def _count(kernel, args: tuple, kwargs: dict) -> str:
    """One launch into every active :class:`LaunchCounter`, with the options it is launched with and its
    configuration (:func:`launch_config`); returns the kernel's name."""
    name = kernel_name(jit_function(kernel))
    options = "autotuned" if _autotuned(kernel) else \
        (kwargs.get("num_warps", DEFAULT_NUM_WARPS), kwargs.get("num_stages", DEFAULT_NUM_STAGES))
    config = launch_table.config_key(*launch_config(kernel, args, kwargs))
    for counter in _counters:
        counter[name] += 1
        counter.options.setdefault(name, set()).add(options)
        counter.configs.setdefault(name, set()).add(config)
    return name


_counters: list = []
_running = 0
_options: dict = {}
_host_only = False


def kernels_run() -> bool:
    """Whether a launch now runs its kernel: not while :func:`recording`, warming up ahead
    (:mod:`kernels.ahead`), :func:`counting` with ``execute=False`` or :func:`host_only`, where a kernel's outputs
    keep what the launcher allocated (a check of their values would read uninitialised memory)."""
    return (_recorder is None and warming_up() is None and not _host_only
            and not (_counters and not _counters[-1].execute))


@contextlib.contextmanager
def host_only():
    """Inside, a launch does all its host-side work (the launch table's options, :func:`launch_options`) and
    returns where it would call the kernel, which does not run (its outputs keep what the launcher allocated).
    What remains of a layer's call is the host's share of it apart from Triton's own launcher: Python, autograd
    and torch's dispatch (:mod:`zoo.benchmark.host_cost` times it)."""
    global _host_only
    outer, _host_only = _host_only, True
    try:
        yield
    finally:
        _host_only = outer


@contextlib.contextmanager
def launch_options(options: dict):
    """Launch the kernels named in ``options`` (:func:`kernel_name` -> ``{"num_warps": w, "num_stages": s}``)
    with those options instead of their launchers' inside (the tuning sweep ``python -m
    zoo.benchmark.launch_tune`` times them this way). Warps and pipeline stages change how a kernel is
    scheduled, not what it computes; an autotuned kernel picks its own and is left alone."""
    global _options
    outer, _options = _options, {**_options, **options}
    try:
        yield
    finally:
        _options = outer


def _with_options(kernel, kwargs: dict) -> dict:
    extra = _options.get(kernel_name(jit_function(kernel)))
    if not extra or _autotuned(kernel):
        return kwargs
    return {**kwargs, **extra}


def launching() -> bool:
    """True while a kernel launched by :func:`launch` runs (under the interpreter: its own torch operations)."""
    return _running > 0


class LaunchCounter(collections.Counter):
    """Launches by kernel name (:func:`counting`); ``execute``: whether the kernels run; ``options``: the
    ``(num_warps, num_stages)`` each kernel was launched with (``"autotuned"`` for a kernel that picks its
    own); ``configs``: the ``(sixteen_bit, sorted constexpr items)`` each kernel was launched with
    (:func:`launch_config`); ``timed``: ``(kernel name, seconds)`` per launch run, when asked for."""

    execute: bool = True
    timed: list | None = None
    options: dict
    configs: dict


@contextlib.contextmanager
def counting(execute: bool = True, timed: bool = False):
    """Count the launches made inside, by kernel name; yields the :class:`LaunchCounter`.

    ``execute=False`` counts without running the kernels: their outputs keep whatever the launcher
    allocated (``torch.empty``: arbitrary values), so only what does not depend on values (the number of
    launches and operations of code without data-dependent branches) is meaningful inside. ``timed=True``
    also keeps each launch's wall time (meaningful where a launch returns when its kernel is done: the
    interpreter, not a GPU's asynchronous launches).
    """
    counter = LaunchCounter()
    counter.execute = execute
    counter.timed = [] if timed else None
    counter.options = {}
    counter.configs = {}
    _counters.append(counter)
    try:
        yield counter
    finally:
        # by identity: counters are dicts, and an outer one that has counted the same launches equals this one
        _counters[:] = [c for c in _counters if c is not counter]


_recorder_tags: list = []


@contextlib.contextmanager
def recording(tags: tuple = ()):
    """Record launches instead of running them; yields the list they are appended to.

    Use with ``meta`` tensors: the launchers' torch glue runs (shapes only), the kernels do not.
    """
    global _recorder
    outer = _recorder
    _recorder = [] if outer is None else outer
    _recorder_tags.append(tags)
    try:
        yield _recorder
    finally:
        _recorder_tags.pop()
        _recorder = outer
