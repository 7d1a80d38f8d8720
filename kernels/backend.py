"""Backend selection shared by every kernel family: the one place that decides what can run.

A family lists the backends it implements (``available=``) and :func:`resolve_backend` turns the
requested name into one that can run on the given tensor, or raises :class:`BackendUnavailable`
with what to do instead.

- ``auto`` (:func:`auto_choice`): on the GPU plan (:func:`kernels.device.plan_for`: a CUDA device, or CPU
  tensors inside :func:`kernels.device.gpu_path_on_cpu`) the fastest correct backend the family has, in the
  order of :data:`AUTO_ORDER_CUDA`: another project's tuned CUDA kernels when their package imports and
  the family does not mark them unsupported for these inputs, then our Triton kernels, then the
  chunked PyTorch path (a family may give its own, measured order: attention runs PyTorch's SDPA before
  our Triton kernel); on the CPU plan the chunked PyTorch path (``torch``), or ``reference`` for a family
  without one. The GPU plan on CPU tensors never picks an outside backend (CUDA only) and picks
  ``triton`` only under the interpreter: it runs the code CUDA runs, through the interpreter.
- ``triton`` on a CPU tensor is allowed only under the Triton interpreter (``TRITON_INTERPRET=1``
  set before the first kernel is defined), which is how the test-suite checks the kernels on
  machines without a GPU.
- Outside backends (:data:`OUTSIDE_BACKENDS`: ``flash_attn``, ``fla``, ``mamba_ssm``) are other
  projects' CUDA kernels, used as fast paths and oracles. They need CUDA tensors and their package,
  and are imported lazily by the family only once chosen. One a family marks unsupported for the
  inputs (``unsupported=``) is passed over by ``auto`` and refused by name with the family's reason.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re

import torch

from .device import plan_for

BACKENDS = ("auto", "reference", "torch", "triton")

#: outside backend name -> (module whose import proves it is installed, pip package to suggest)
OUTSIDE_BACKENDS = {
    "flash_attn": ("flash_attn", "flash-attn"),
    "fla": ("fla", "flash-linear-attention"),
    "mamba_ssm": ("mamba_ssm", "mamba-ssm"),
}

ALL_BACKENDS = BACKENDS + tuple(OUTSIDE_BACKENDS)


class BackendUnavailable(RuntimeError):
    """Raised when a requested backend cannot run on this machine or for these inputs."""


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install on an unsupported platform
        return False
    return True


@functools.lru_cache(maxsize=None)
def package_importable(module: str) -> bool:
    """True when ``module`` imports (any failure, e.g. a CUDA-only build on a CPU machine, is False)."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - e.g. a CUDA-only build on a CPU machine
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _version(text: str) -> tuple[int, ...]:
    """``"3.6.0+git1234"`` -> ``(3, 6, 0)``; ``"3.4"`` -> ``(3, 4, 0)`` (a short version compares as its .0)."""
    parts = tuple(int(x) for x in re.findall(r"\d+", text)[:3])
    return parts + (0,) * (3 - len(parts))


def interpreter_refusal(triton_version: str, numpy_version: str) -> str | None:
    """Why the Triton interpreter cannot run the zoo's kernels with these versions, or None.

    Triton's interpreter before 3.7 turns a runtime loop bound (``for c in range(N)``, ``N`` a kernel
    argument) into an index with ``int()`` of a one-element array, which NumPy 2.4 refuses
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``); Triton 3.7 squeezes
    the array first. Every kernel with a loop over chunks or blocks fails there.
    """
    if _version(triton_version) >= (3, 7) or _version(numpy_version) < (2, 4):
        return None
    return (f"the Triton {triton_version} interpreter cannot run with NumPy {numpy_version} (before Triton 3.7 it "
            f"converts loop bounds with int() of an array, which NumPy 2.4 refuses); "
            f"pip install 'numpy<2.4', or Triton >= 3.7 (torch 2.13 pins 3.7.1)")


@functools.lru_cache(maxsize=None)
def triton_interpreter_problem() -> str | None:
    """:func:`interpreter_refusal` for the installed Triton and NumPy (None without Triton)."""
    if not triton_importable():
        return None
    import triton
    try:
        import numpy
    except ImportError:
        return "the Triton interpreter needs NumPy (pip install numpy)"
    return interpreter_refusal(triton.__version__, numpy.__version__)


def triton_refusal(tensor: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on ``tensor`` here (what to do instead), or None when they can."""
    if not triton_importable():
        return "needs the triton package (pip install triton)"
    if tensor.is_cuda:
        return None
    if not (triton_interpreting() and tensor.device.type == "cpu"):
        return ("needs CUDA tensors, or TRITON_INTERPRET=1 set before import to run the kernels on the CPU "
                "through the interpreter; use backend='torch' on a CPU")
    problem = triton_interpreter_problem()
    return None if problem is None else f"cannot run on CPU tensors: {problem}"


@contextlib.contextmanager
def meta_takes_triton():
    """Inside, the Triton backends accept ``meta`` tensors (they stand for a GPU's: a launch on them is recorded or
    compiled, never run; :mod:`kernels.launch`, :mod:`kernels.ahead`)."""
    global triton_refusal
    refusal = triton_refusal
    triton_refusal = lambda tensor: None if tensor.device.type == "meta" else refusal(tensor)  # noqa: E731
    try:
        yield
    finally:
        triton_refusal = refusal


#: why a family whose Triton kernels compute in fp32 and 16 bits refuses fp64 inputs (``auto`` passes over it, so
#: an fp64 computation, a reference's, is never rounded to fp32 behind the caller's back)
NO_FP64 = "computes in fp32 and 16-bit, not fp64"


def triton_fp64_unsupported(tensor: torch.Tensor) -> dict:
    """``{"triton": NO_FP64}`` for an fp64 ``tensor``, else ``{}``: the ``unsupported`` entry of a family whose
    Triton kernels take fp32 and 16-bit inputs only."""
    return {"triton": NO_FP64} if tensor.dtype == torch.float64 else {}


def triton_usable_for(tensor: torch.Tensor) -> bool:
    return triton_refusal(tensor) is None


def triton_pieces_for(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` takes the GPU plan's fused Triton pieces (the norms, gates, short convolution, rotary
    embedding and SwiGLU gate of the mixers): the GPU plan (:func:`kernels.device.plan_for`) and a Triton that
    can run on it. Otherwise the mixers run their PyTorch formulas."""
    return plan_for(tensor).one_pass and triton_usable_for(tensor)


def outside_usable_for(backend: str, tensor: torch.Tensor) -> bool:
    """True when the outside ``backend`` can run on ``tensor`` (a CUDA tensor and the package imports)."""
    return tensor.is_cuda and package_importable(OUTSIDE_BACKENDS[backend][0])


#: Triton versions that compile flash-linear-attention's gated ``chunk_bwd_dqkwg`` wrongly on Hopper GPUs
FLA_HOPPER_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def fla_gated_refusal(capability_major: int, triton_version: str, tilelang: bool) -> str | None:
    """Why flash-linear-attention refuses the backward of its gated chunk kernels on this GPU, or None.

    fla (0.6) raises in that backward on Hopper GPUs (compute capability 9.x) with Triton in
    :data:`FLA_HOPPER_BAD_TRITON` (half-open), where the kernel compiles to wrong results, unless
    tilelang is installed (fla then runs that kernel through tilelang).
    """
    version = _version(triton_version)
    low, high = FLA_HOPPER_BAD_TRITON
    if capability_major != 9 or tilelang or not low <= version < high:
        return None
    return (f"flash-linear-attention refuses the backward of its gated kernels on a Hopper GPU with Triton "
            f"{triton_version} (wrong results below 3.7.1); pip install 'triton>=3.7.1' or tilelang")


def fla_gated_problem(tensor: torch.Tensor) -> str | None:
    """:func:`fla_gated_refusal` for the device of ``tensor`` (None off CUDA or without Triton)."""
    if not tensor.is_cuda or not triton_importable():
        return None
    return _fla_gated_problem_on(tensor.get_device())


@functools.lru_cache(maxsize=None)
def _fla_gated_problem_on(device_index: int) -> str | None:
    """Once per device: every call of a family's function asks (its hot path)."""
    import triton

    major = torch.cuda.get_device_capability(device_index)[0]
    return fla_gated_refusal(major, triton.__version__, package_importable("tilelang"))


def fla_unsupported(tensor: torch.Tensor, runs_gated: bool) -> dict:
    """``{"fla": why}`` when fla would refuse these inputs' backward (``runs_gated``: the family's
    ``fla_runs_gated`` for them), else ``{}``: an ``unsupported=`` entry for :func:`resolve_backend`."""
    problem = fla_gated_problem(tensor) if runs_gated else None
    return {"fla": problem} if problem else {}


#: the order ``auto`` tries on a CUDA device: other projects' tuned kernels, ours, then PyTorch
AUTO_ORDER_CUDA = ("flash_attn", "fla", "mamba_ssm", "triton", "torch", "reference")
AUTO_ORDER_CPU = ("torch", "reference")


def auto_choice(available, cuda: bool, unsupported: dict | None = None,
                order: tuple | None = None) -> tuple[str, list[str]]:
    """What ``auto`` runs for a family implementing ``available``, on a CUDA device or not.

    ``unsupported``: backend -> why it cannot take the current inputs (e.g. flash-attn and fp32);
    ``order``: the family's own CUDA order where it differs from :data:`AUTO_ORDER_CUDA` (a measured one).
    Returns ``(backend, reasons)``: one line for each faster backend passed over, saying why.
    """
    unsupported = unsupported or {}
    skipped = []
    for name in (order or AUTO_ORDER_CUDA) if cuda else AUTO_ORDER_CPU:
        if name not in available:
            continue
        if name in unsupported:
            skipped.append(f"{name}: {unsupported[name]}")
        elif name in OUTSIDE_BACKENDS and not package_importable(OUTSIDE_BACKENDS[name][0]):
            skipped.append(f"{name}: not installed (pip install {OUTSIDE_BACKENDS[name][1]})")
        elif name == "triton" and not triton_importable():
            skipped.append("triton: the triton package does not import")
        else:
            return name, skipped
    return ("torch" if "torch" in available else "reference"), skipped


def resolve_backend(backend: str, tensor: torch.Tensor, op: str, available=BACKENDS,
                    unsupported: dict | None = None, order: tuple | None = None) -> str:
    """Turn ``backend`` into a concrete backend name for ``op`` running on ``tensor``.

    ``available``: every backend the family implements (``auto`` need not be listed);
    ``unsupported``: backend -> reason, backends ``auto`` must pass over for these inputs (and refused, with the
    reason, when asked for by name); ``order``: the
    family's CUDA order for ``auto`` (default :data:`AUTO_ORDER_CUDA`). Raises
    :class:`BackendUnavailable` with a message that says what to do instead.
    """
    if backend not in ALL_BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {', '.join(ALL_BACKENDS)}")
    if backend == "auto":
        gpu = plan_for(tensor).gpu
        if gpu and not tensor.is_cuda:  # the GPU path on CPU tensors (tests): what can run on them
            unsupported = dict(unsupported or {})
            for name in OUTSIDE_BACKENDS:
                unsupported.setdefault(name, f"runs CUDA kernels only and the inputs are on {tensor.device}")
            why = triton_refusal(tensor)
            if why:
                unsupported.setdefault("triton", why)
        return auto_choice(available, gpu, unsupported, order)[0]
    if backend not in available:
        raise BackendUnavailable(
            f"{op}: backend {backend!r} is not implemented; available: {', '.join(a for a in available if a != 'auto')}"
        )
    if backend == "triton" and (why := triton_refusal(tensor)):
        raise BackendUnavailable(f"{op}: backend 'triton' {why}")
    if backend in OUTSIDE_BACKENDS and not outside_usable_for(backend, tensor):
        module, pip_name = OUTSIDE_BACKENDS[backend]
        if not tensor.is_cuda:
            raise BackendUnavailable(
                f"{op}: backend {backend!r} runs CUDA kernels only and the inputs are on {tensor.device}; "
                f"use backend='torch' (or 'auto') on a CPU")
        raise BackendUnavailable(
            f"{op}: backend {backend!r} needs the {pip_name} package (pip install {pip_name}), which does not "
            f"import here; use backend='auto'")
    if backend in (unsupported or {}):     # what auto passes over, an explicit request cannot run either
        raise BackendUnavailable(f"{op}: backend {backend!r}: {unsupported[backend]}; use backend='auto'")
    return backend
