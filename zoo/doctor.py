"""``zoo doctor``: what this machine will run — device, extras (the optional features' packages, each with the
extra of pyproject.toml that installs it, and the GPU libraries), launch tables, and the backend every mixer's
``auto`` picks.

A mixer's kernel families are found from the ``kernels.<family>`` functions its module imports; each
family's ``BACKENDS`` tuple lists what it implements, and :func:`kernels.backend.auto_choice` (the rule
``backend="auto"`` follows) says which of them runs here and why the faster ones do not. The answer
is for the inputs a mixer gets in training on this device: bf16 on CUDA, fp32 on a CPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from kernels import launch_table
from kernels.backend import (
    OUTSIDE_BACKENDS,
    auto_choice,
    fla_gated_problem,
    package_importable,
    triton_importable,
    triton_interpreter_problem,
)
from kernels.launch import cuda_arch
from mixers import MIXERS
from zoo.benchmark.marked_block import write_block
from zoo.errors import UserError

#: backends of a family module that has no BACKENDS tuple (every family implements these three)
_DEFAULT_BACKENDS = ("reference", "torch", "triton")


def mixer_families(cls) -> list[str]:
    """The ``kernels.<family>`` packages whose functions the mixer's module imports (a family is a package;
    the shared modules beside them, ``kernels.backend``, ``kernels.device``..., are not families)."""
    module = sys.modules[cls.__module__]
    found = set()
    for value in vars(module).values():
        mod = getattr(value, "__module__", None) or ""
        if callable(value) and mod.startswith("kernels.") and mod.count(".") >= 1:
            family = mod.split(".")[1]
            if hasattr(_family(family), "__path__"):
                found.add(family)
    return sorted(found)


def _family(family: str):
    """The kernel family's package, ``kernels.<family>``."""
    return importlib.import_module(f"kernels.{family}")


def family_backends(family: str) -> tuple:
    return tuple(getattr(_family(family), "BACKENDS", _DEFAULT_BACKENDS))


def family_order(family: str) -> tuple | None:
    """The family's own CUDA order for ``auto``, or None for :data:`kernels.backend.AUTO_ORDER_CUDA`."""
    return getattr(_family(family), "AUTO_ORDER_CUDA", None)


def extras() -> list[tuple[str, bool, str]]:
    """(what, installed, how to install) for Triton and every outside backend's package."""
    rows = [("triton", triton_importable(), "pip install triton")]
    rows += [(pip, package_importable(module), f"pip install {pip}") for module, pip in OUTSIDE_BACKENDS.values()]
    return rows


#: the packages the optional features import, by the extra of pyproject.toml that installs them: (module, distribution)
FEATURE_PACKAGES = {
    "lm": (("tokenizers", "tokenizers"), ("datasets", "datasets"), ("lm_eval", "lm-eval")),
    "hf": (("transformers", "transformers"), ("safetensors", "safetensors")),
    "ray": (("ray", "ray"),),
    "tracking": (("tensorboard", "tensorboard"), ("wandb", "wandb")),
}


def module_found(module: str) -> bool:
    """True when ``module`` is installed, found without importing it (ray, transformers and lm_eval take seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


def feature_extras() -> list[tuple[str, bool, str]]:
    """(what, installed, how to install) for every package of the optional features (``zoo data``, ``zoo export``,
    ``--executor ray``, ``train.tracking``, the lm-evaluation-harness adapter)."""
    return [(dist, module_found(module), f'pip install -e ".[{extra}]"')
            for extra, packages in FEATURE_PACKAGES.items() for module, dist in packages]


def cuda_fla_problem() -> str | None:
    """Why flash-linear-attention refuses its gated backward on this machine's GPU, or None."""
    return fla_gated_problem(torch.empty(0, device="cuda")) if torch.cuda.is_available() else None


def _fla_unsupported(name: str, family: str, problem: str | None) -> dict | None:
    """The family's own rule (its ``fla_runs_gated``) for the mixer's default options in bf16."""
    runs_gated = getattr(_family(family), "fla_runs_gated", None)
    if problem is None or runs_gated is None:
        return None
    gated = getattr(MIXERS.get(name).Options(), "use_forget_gate", True)
    return {"fla": problem} if runs_gated(torch.bfloat16, gated) else None


def mixer_rows(cuda: bool) -> list[tuple[str, str, str, str, str]]:
    """(mixer, family, auto's backend here, auto's backend on a CUDA device with these extras, why) per mixer."""
    rows = []
    problem = cuda_fla_problem() if cuda else None
    for name in MIXERS.names():
        families = mixer_families(MIXERS.get(name))
        if not families:
            rows.append((name, "-", "torch", "torch", "no kernel family: plain PyTorch layers"))
        for family in families:
            available = family_backends(family)
            unsupported = _fla_unsupported(name, family, problem)
            order = family_order(family)
            here, skipped_here = auto_choice(available, cuda, unsupported, order)
            on_cuda, skipped = auto_choice(available, True, unsupported, order)
            why = "; ".join(skipped) or "the fastest backend the family has"
            if not cuda:
                why = f"CPU: the PyTorch path; on CUDA: {why}"
            rows.append((name, family, here, on_cuda, why))
    return rows


def launch_table_lines(cuda: bool) -> list[str]:
    """What the launch tables hold (:mod:`kernels.launch_table`) and whether this card has one."""
    paths = launch_table.tables()
    if not paths:
        return ["launch tables: none (every Triton kernel launches with its launcher's warps and stages)"]
    lines = ["launch tables (warps and stages measured per GPU architecture, kernels/launch_tables):"]
    for path in paths:
        try:
            table = launch_table.read(path)
        except launch_table.LaunchTableError as err:
            lines.append(f"  {path.name}: unreadable: {err}")
            continue
        cards = sorted({e["measured"]["card"] for e in table["entries"]})
        lines.append(f"  sm_{table['arch']}: {len(table['entries'])} launch configurations measured on "
                     f"{', '.join(cards) or 'no card yet'}")
    if cuda:
        arch = cuda_arch()
        lines.append(f"  this card (sm_{arch}): " + ("its table applies" if launch_table.table_path(arch).exists()
                     else "no table: the launchers' own options (python -m zoo.benchmark.launch_tune --write-table)"))
    return lines


def report() -> str:
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA device)"
    lines = [f"device: {device}; torch {torch.__version__}; inputs assumed {'bf16' if cuda else 'fp32'}", "",
             "extras:"]
    lines += [f"  {what:24} {'installed' if ok else 'missing  (' + how + ')'}"
              for what, ok, how in feature_extras() + extras()]
    if not cuda:
        lines.append("  (outside backends run CUDA kernels only; on a CPU auto never picks them)")
        if triton_importable():
            problem = triton_interpreter_problem()
            lines.append("  triton interpreter       " + (f"cannot run: {problem}" if problem else
                                                          "works (TRITON_INTERPRET=1 runs the kernels on the CPU)"))
    lines += [""] + launch_table_lines(cuda)
    lines += ["", f"{'mixer':17} {'family':10} {'auto here':10} {'on CUDA':10} why"]
    lines += [f"{m:17} {f:10} {b:10} {c:10} {why}" for m, f, b, c, why in mixer_rows(cuda)]
    return "\n".join(lines)


BEGIN, END = "<!-- zoo-doctor:begin -->", "<!-- zoo-doctor:end -->"


def _markdown_problem(path: Path) -> str | None:
    """Why ``--markdown`` cannot write ``path``, with the fix; None when it can: an existing file it may rewrite, or
    a new file in an existing folder it may write in."""
    if path.is_dir():
        return "is a folder, not a markdown file; give a file (e.g. a BENCHMARKS.md inside it)"
    if path.exists():
        if not path.is_file():
            return "is not a regular file; give a markdown file"
        if not os.access(path, os.R_OK | os.W_OK):
            return "is not writable here; make it writable (chmod u+rw) or give another file"
        return None
    folder = path.parent
    if not folder.exists():
        return f"its folder {folder} does not exist; create it first (mkdir -p {folder}) or give a file in an " \
               f"existing folder"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder; give a file in an existing folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create a file in {folder} (not writable here); give a file in a folder you can write"
    return None


def _check_markdown(target: str) -> None:
    """``--markdown FILE`` names a markdown file this process can rewrite, or create (before the report runs)."""
    problem = _markdown_problem(Path(target))
    if problem:
        raise UserError(f"zoo doctor --markdown {target}: {problem}")


def run(args=None) -> int:
    target = getattr(args, "markdown", None)
    if target is not None:
        _check_markdown(target)
    text = report()
    print(text)
    if target:
        block = f"Generated by `zoo doctor --markdown {target}` on this project's machine:\n\n```\n{text}\n```"
        try:
            if Path(target).exists():
                write_block(target, block, BEGIN, END)
            else:  # a new file: the block alone
                with open(target, "x") as f:
                    f.write(f"{BEGIN}\n{block}\n{END}\n")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"zoo doctor --markdown {target}: cannot write it "
                            f"({getattr(err, 'strerror', None) or type(err).__name__})") from None
    return 0
