"""The copies, casts and concatenations of a language model's training step on the GPU path, counted without a GPU.

``python -m zoo.benchmark.step_copies [--json FILE] [mixer ...]`` (with ``TRITON_INTERPRET=1``)

A training step under bf16 autocast moves data that no kernel computes with: autocast's casts of activations
(fp32 residual stream to bf16 linear inputs, and their gradients back), ``.contiguous()`` and ``.to()`` copies,
and autograd's concatenation of the gradients of a tensor's split parts (a fused projection's, say). On a GPU
``torch.profiler`` lists them as ``direct_copy``, ``bfloat16_copy`` and ``CatArrayBatchedCopy`` kernels, each a
full pass over its tensor. This tool runs the language models of ``scripts/gpu_speed.sh`` (4 layers, d_model
512, head dim 128, the SwiGLU block after every mixer) through one step's forward, loss and backward under
bf16 autocast on the GPU code path (:func:`kernels.device.gpu_path_on_cpu`; the Triton launches stop short of
their kernels, :func:`kernels.launch.host_only`) and counts, per step of the benchmark's 16384 tokens, the
launches of such operators (``copy_``, ``_to_copy``, ``clone``, ``cat``) and the bytes they read and write.

The step runs at two small lengths (one sequence of 64 and of 128 tokens: bf16 matmuls on a CPU are slow) and
the bytes are extrapolated linearly to 16384 tokens: an activation's copy grows with the tokens, a weight's cast
does not (the intercept). Launches do not depend on the length.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.ahead import tensors_in
from kernels.device import gpu_path_on_cpu
from kernels.launch import host_only, launching

from .gpu_speed import FULL, lm_model
from .host_cost import chosen_mixers, require_interpreter
from .train_rate import lm_passes

#: the operators counted: they move data and compute nothing
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat")
#: the two lengths the step runs at (one sequence each)
LENGTHS = (64, 128)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CopyCounter(TorchDispatchMode):
    """Launches and bytes (inputs read, outputs written) of the :data:`COPY_OPS` dispatched inside, by operator;
    the operators a Triton launch runs inside the interpreter are not counted (on a GPU they are the kernel)."""

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name in COPY_OPS and not launching():
            read = tensors_in(args[1] if name == "aten::copy_" else args[0])
            self.launches[name] += 1
            self.bytes[name] += _bytes(read) + _bytes(tensors_in(out))
        return out


def step_copies(name: str, T: int) -> CopyCounter:
    """One step of ``name``'s language model (one sequence of ``T`` tokens) under bf16 autocast, counted."""
    plan = dataclasses.replace(FULL, lm_tokens=T, lm_lengths=(T,))
    _, model = lm_model(plan, name)
    ids = torch.randint(plan.lm_vocab, (1, T + 1))
    spy = CopyCounter()
    with gpu_path_on_cpu(), host_only(), spy:
        lm_passes(model, torch.bfloat16)(ids[:, :-1], ids[:, 1:])
    return spy


def measure(name: str) -> dict:
    """Copy launches and MB per step of ``FULL.lm_tokens`` tokens (extrapolated from :data:`LENGTHS`)."""
    short, long = (step_copies(name, T) for T in LENGTHS)
    if short.launches != long.launches:
        raise RuntimeError(f"{name}: the copies' launches depend on the length ({dict(short.launches)} at "
                           f"{LENGTHS[0]}, {dict(long.launches)} at {LENGTHS[1]})")
    tokens = FULL.lm_tokens
    row = {"mixer": name, "tokens": tokens, "launches": sum(long.launches.values()), "mb": {}}
    for op in COPY_OPS:
        per_token = (long.bytes[op] - short.bytes[op]) / (LENGTHS[1] - LENGTHS[0])
        row["mb"][op] = round((short.bytes[op] + per_token * (tokens - LENGTHS[0])) / 1e6, 1)
    row["total_mb"] = round(sum(row["mb"].values()), 1)
    return row


def table(rows: list[dict]) -> str:
    head = ["model", "copy launches", "casts MB", "copies MB", "concatenations MB", "total MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mb = r["mb"]
        lines.append(f"| {r['mixer']} | {r['launches']} | {mb['aten::_to_copy']:.0f} | "
                     f"{mb['aten::copy_'] + mb['aten::clone']:.0f} | {mb['aten::cat']:.0f} | {r['total_mb']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.step_copies",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("mixers", nargs="*", help="mixers to count (default: attention and every linear mixer)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    require_interpreter(parser)
    rows = [measure(name) for name in chosen_mixers(parser, args.mixers)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
