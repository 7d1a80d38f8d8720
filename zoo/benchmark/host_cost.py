"""The host's share of a layer's and a language model's training step on the GPU path, measured without a GPU.

``python -m zoo.benchmark.host_cost [--steps N] [--json FILE] [mixer ...]`` (with ``TRITON_INTERPRET=1``)

On a GPU a call is launch-bound when the host (Python, autograd, torch's dispatch and the kernel launchers)
takes longer to issue its kernels than the device takes to run them: the device then waits, and the call
takes the host's time whatever its kernels cost. The language models of ``scripts/gpu_speed.sh`` (4 layers,
d_model 512, 16384 tokens a step) are that case on an H200, attention's included, so their tokens/s ratios
follow the ratios of host time (BENCHMARKS.md, "The host's share of a training step").

This tool runs gpu_speed's language models and layers on the GPU code path
(:func:`kernels.device.gpu_path_on_cpu`), with every Triton launch doing its host-side work and returning
where it would call the kernel (:func:`kernels.launch.host_only`), and times the host, on small fp32 CPU
tensors (d_model 64, head dim 16, 2 x 32 tokens: their torch operations cost little more than their dispatch;
``meta`` tensors would compute nothing, but their shape functions are Python, slower than a CPU kernel of 64
numbers, and attention's fused kernel runs there as a dozen operations). Per mixer:

- ``lm_ms``: the median host time of one step's forward, loss and backward of the language model, gradients
  cleared after (the optimizer is left out: on a GPU its fused update is the same few launches for every
  model);
- ``vs_attention``: attention's ``lm_ms`` over the mixer's, the tokens/s ratio a host-bound run shows;
- ``layer_ms``: the same for one layer's forward+backward (gpu_speed's layer, at the small sizes);
- ``ops`` and ``triton``: the torch operations dispatched and the Triton launches of one LM step (counted in
  a separate, untimed pass).

Left out: Triton's own launcher (on a GPU host about 10-20 microseconds a launch) and CUDA's (a few
microseconds a kernel), hence the ``triton`` column; autocast's casts (the model runs in fp32 here).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.backend import triton_interpreting
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting, host_only

from ..model import HybridLM
from .gpu_speed import BASELINE, FULL, Plan, build_layer, lm_model, mixer_names
from .train_rate import lm_passes

#: gpu_speed's models and layers at small sizes
SMALL = dataclasses.replace(FULL, d_model=64, head_dim=16, lm_d_model=64, lm_tokens=64, lm_lengths=(32,))
LAYER_TOKENS = 32
WARMUP = 2


class _OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched inside."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def lm_pass(model: HybridLM, plan: Plan, T: int):
    """One step's passes of ``model`` at length ``T`` (:func:`.train_rate.lm_passes`: forward, loss, backward),
    gradients cleared after."""
    batch = max(1, plan.lm_tokens // T)
    ids = torch.randint(plan.lm_vocab, (batch, T + 1))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    passes = lm_passes(model)

    def step():
        passes(inputs, labels)
        model.zero_grad(set_to_none=True)
    return step


def layer_pass(layer, T: int):
    """One forward+backward of ``layer`` at length ``T`` (batch 1), gradients cleared after."""
    x = torch.randn(1, T, layer.d_model, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        layer(x).backward(grad)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return step


def host_ms(step, steps: int) -> float:
    """Median wall time (ms) of ``step()`` on the GPU path, every Triton launch stopping short of its kernel."""
    times = []
    with gpu_path_on_cpu(), host_only():
        for i in range(WARMUP + steps):
            start = time.perf_counter()
            step()
            if i >= WARMUP:
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def counts(step) -> tuple[int, int]:
    """``(torch operations dispatched, Triton launches)`` of one ``step()`` on the GPU path."""
    spy = _OpCounter()
    with gpu_path_on_cpu(), counting(execute=False) as launched, spy:
        step()
    return sum(spy.ops.values()), sum(launched.values())


def measure(name: str, steps: int) -> dict:
    T = SMALL.lm_lengths[0]
    row = {"mixer": name, "lm_T": T, "lm_batch": max(1, SMALL.lm_tokens // T)}
    lm_step = lm_pass(lm_model(SMALL, name)[1], SMALL, T)
    row["lm_ms"] = round(host_ms(lm_step, steps), 3)
    row["ops"], row["triton"] = counts(lm_step)
    layer = build_layer(name, SMALL, torch.device("cpu"), torch.float32)
    row["layer_ms"] = round(host_ms(layer_pass(layer, LAYER_TOKENS), steps), 3)
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    base = next((r["lm_ms"] for r in rows if r["mixer"] == BASELINE), None)
    for r in rows:
        r["vs_attention"] = round(base / r["lm_ms"], 3) if base else None
    return rows


def table(rows: list[dict]) -> str:
    head = ["mixer", "LM step host ms", "attention / mixer", "layer host ms", "torch ops", "Triton launches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = "-" if r["vs_attention"] is None else f"{r['vs_attention']:.2f}"
        lines.append(f"| {r['mixer']} | {r['lm_ms']:.2f} | {ratio} | {r['layer_ms']:.2f} | {r['ops']} | "
                     f"{r['triton']} |")
    return "\n".join(lines)


def require_interpreter(parser: argparse.ArgumentParser) -> None:
    """A tool that runs the GPU path's launchers on CPU tensors needs the Triton interpreter (no kernel runs)."""
    if not triton_interpreting():
        parser.error("run with TRITON_INTERPRET=1 (the launchers take CPU tensors only through the interpreter; "
                     "no kernel runs)")


def chosen_mixers(parser: argparse.ArgumentParser, names: list[str]) -> list[str]:
    """``names``, or attention and every linear mixer when none is named; an unknown name is a parser error."""
    known = [BASELINE] + mixer_names()[1]
    unknown = [m for m in names if m not in known]
    if unknown:
        parser.error(f"unknown mixers {unknown}; choose from {', '.join(known)}")
    return list(names) or known


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("mixers", nargs="*", help="mixers to measure (default: attention and every linear mixer)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    require_interpreter(parser)
    torch.set_num_threads(args.threads)
    names = chosen_mixers(parser, args.mixers)
    if BASELINE not in names:
        names = [BASELINE] + names
    rows = []
    for name in names:
        rows.append(measure(name, args.steps))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(with_ratios(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
