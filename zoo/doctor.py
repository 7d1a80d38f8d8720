"""``zoo doctor``: what this machine will run — device, extras, and the backend every mixer's ``auto`` picks.

A mixer's kernel families are found from the ``kernels.<family>`` functions its module imports; each
family's ``BACKENDS`` tuple lists what it implements, and :func:`kernels.backend.auto_choice` (the rule
``backend="auto"`` follows) says which of them runs here and why the faster ones do not. The answer
is for the inputs a mixer gets in training on this device: bf16 on CUDA, fp32 on a CPU.
"""
from __future__ import annotations

import importlib
import sys

import torch

from kernels.backend import OUTSIDE_BACKENDS, auto_choice, package_importable, triton_importable
from mixers import MIXERS

#: backends of a family module that has no BACKENDS tuple (every family implements these three)
_DEFAULT_BACKENDS = ("reference", "torch", "triton")


def mixer_families(cls) -> list[str]:
    """The ``kernels.<family>`` packages whose functions the mixer's module imports."""
    module = sys.modules[cls.__module__]
    found = set()
    for value in vars(module).values():
        mod = getattr(value, "__module__", None) or ""
        if callable(value) and mod.startswith("kernels.") and mod.count(".") >= 1:
            family = mod.split(".")[1]
            if family not in ("backend", "common", "launch"):
                found.add(family)
    return sorted(found)


def family_backends(family: str) -> tuple:
    module = importlib.import_module(f"kernels.{family}")
    return tuple(getattr(module, "BACKENDS", _DEFAULT_BACKENDS))


def extras() -> list[tuple[str, bool, str]]:
    """(what, installed, how to install) for Triton and every outside backend's package."""
    rows = [("triton", triton_importable(), "pip install triton")]
    rows += [(pip, package_importable(module), f"pip install {pip}") for module, pip in OUTSIDE_BACKENDS.values()]
    return rows


def mixer_rows(cuda: bool) -> list[tuple[str, str, str, str, str]]:
    """(mixer, family, auto's backend here, auto's backend on a CUDA device with these extras, why) per mixer."""
    rows = []
    for name in MIXERS.names():
        families = mixer_families(MIXERS.get(name))
        if not families:
            rows.append((name, "-", "torch", "torch", "no kernel family: plain PyTorch layers"))
        for family in families:
            available = family_backends(family)
            here, skipped_here = auto_choice(available, cuda)
            on_cuda, skipped = auto_choice(available, True)
            why = "; ".join(skipped) or "the fastest backend the family has"
            if not cuda:
                why = f"CPU: the PyTorch path; on CUDA: {why}"
            rows.append((name, family, here, on_cuda, why))
    return rows


def report() -> str:
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA device)"
    lines = [f"device: {device}; torch {torch.__version__}; inputs assumed {'bf16' if cuda else 'fp32'}", "",
             "extras:"]
    lines += [f"  {what:24} {'installed' if ok else 'missing  (' + how + ')'}" for what, ok, how in extras()]
    if not cuda:
        lines.append("  (outside backends run CUDA kernels only; on a CPU auto never picks them)")
    lines += ["", f"{'mixer':17} {'family':10} {'auto here':10} {'on CUDA':10} why"]
    lines += [f"{m:17} {f:10} {b:10} {c:10} {why}" for m, f, b, c, why in mixer_rows(cuda)]
    return "\n".join(lines)


def run(args=None) -> int:
    print(report())
    return 0
