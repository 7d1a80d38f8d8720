"""How long a layer's first forward+backward compiles, kernel after kernel and compiled ahead, without a GPU.

``python -m zoo.benchmark.first_compile [--arch 90] [--threads N] [--toy] [--modes serial,ahead] [--json FILE]
[mixer ...]``

For each mixer (default: all of them), twice, each time in a fresh process with an empty Triton cache:

- ``serial``: every Triton kernel of the layer's first forward+backward compiled at its launch, one after
  another, as a first call compiles them (:func:`kernels.ahead.compile_ahead` with one thread), and the
  longest of them (what compiling ahead on enough cores approaches);
- ``ahead``: the same kernels compiled ahead on ``--threads`` threads (default: every core here); then, in
  the same process, a second compile-ahead of the same call must compile nothing (each launch found the
  kernel the first one filed), and the kernels compiled must be as many as the distinct launches
  :func:`kernels.launch.recording` lists for the call (the specialisation model the compile check uses).

The layer is ``zoo.benchmark.gpu_speed``'s (``d_model 1024``, head dim 128, bf16, ``T = 16384``, our Triton
backend; ``--toy``: its dry-run sizes) on ``meta`` tensors, whose addresses are their offsets (alignment as
on a GPU, whose allocations are aligned), under the GPU plan (:func:`kernels.device.gpu_path_on_cpu`). A
stand-in CUDA driver (device 0, ``sm_<arch>``) lets Triton's JIT specialise and compile each launch as on
that GPU; nothing runs. Compiling is CPU work, so these times are those of this CPU: a GPU host's cores
may be faster, and it may have more of them.

Exit status 1 when a check fails or a layer cannot be compiled. Run without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

import kernels.ahead
from kernels import launch_table
from kernels.ahead import available_cores, compile_ahead, dry_forward_backward
from kernels.backend import meta_takes_triton
from kernels.device import gpu_path_on_cpu
from kernels.launch import recording

from .gpu_speed import DRY, FULL, build_layer, mixer_names, our_backend

MODES = ("serial", "ahead")


class StandInDriver:
    """The part of Triton's CUDA driver its JIT reads before a launch: device 0 of ``sm_<arch>``."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _plan(toy: bool):
    return dataclasses.replace(DRY, device="cuda", dtype="bf16") if toy else FULL


def measure_one(name: str, mode: str, arch: int, threads: int, toy: bool) -> dict:
    """One mixer in this (fresh) process: ``mode`` ``serial`` or ``ahead`` (with its checks)."""
    driver.set_active(StandInDriver(arch))
    plan = _plan(toy)
    layer = build_layer(name, plan, "meta", torch.bfloat16)
    x = torch.empty(1, plan.first_call_length, plan.d_model, device="meta", dtype=torch.bfloat16)

    def first_call():   # the launches an sm_<arch> GPU makes (its launch table's options included), compiled
        with meta_takes_triton(), gpu_path_on_cpu(), launch_table.as_if_arch(arch):
            dry_forward_backward(layer, x)

    compile_times = []
    if mode == "serial":  # each launch's warm-up is its kernel's compile
        warm = kernels.ahead._Ahead.warm

        def timed_warm(self, kernel, grid, args, kwargs):
            start = time.perf_counter()
            warm(self, kernel, grid, args, kwargs)
            compile_times.append(time.perf_counter() - start)
        kernels.ahead._Ahead.warm = timed_warm
    report = compile_ahead(first_call, workers=1 if mode == "serial" else threads)
    row = {"mixer": name, "mode": mode, "launches": report.launches, "compiled": report.compiled,
           "threads": report.workers, "seconds": round(report.seconds, 2), "run_seconds": round(report.run_seconds, 2),
           "wait_seconds": round(report.wait_seconds, 2)}
    if compile_times:
        row["longest_kernel_s"] = round(max(compile_times), 2)
    if mode == "ahead":
        row["recompiled"] = compile_ahead(first_call, workers=threads).compiled
        with recording() as launches:
            first_call()
        row["distinct_launches"] = len({launch.key() for launch in launches})
    return row


def problems(row: dict) -> list[str]:
    """What is wrong with one measured row (empty when nothing is)."""
    if "error" in row:
        return [f"{row['mixer']} {row['mode']}: {row['error']}"]
    out = []
    if row.get("recompiled"):
        out.append(f"{row['mixer']}: a second compile-ahead compiled {row['recompiled']} kernels again "
                   "(its launches did not find the kernels the first one compiled)")
    if "distinct_launches" in row and row["distinct_launches"] != row["compiled"]:
        out.append(f"{row['mixer']}: {row['compiled']} kernels compiled ahead, but the call makes "
                   f"{row['distinct_launches']} distinct launches")
    return out


def _in_fresh_process(name: str, mode: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory(prefix="first-compile-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        cmd = [sys.executable, "-m", "zoo.benchmark.first_compile", "--one", name, "--mode", mode,
               "--arch", str(args.arch), "--threads", str(args.threads)] + (["--toy"] if args.toy else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"mixer": name, "mode": mode, "error": f"exit status {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    by = {(r["mixer"], r["mode"]): r for r in rows}
    names = list(dict.fromkeys(r["mixer"] for r in rows))
    threads = max((r.get("threads", 0) for r in rows if r["mode"] == "ahead"), default=0)
    lines = [f"| mixer | kernels | one after another s | longest kernel s | ahead on {threads} threads s | "
             "second compile-ahead compiles |", "|---|---|---|---|---|---|"]
    for name in names:
        serial, ahead = by.get((name, "serial"), {}), by.get((name, "ahead"), {})
        if "error" in serial or "error" in ahead:
            lines.append(f"| {name} | error: {(serial.get('error') or ahead.get('error'))[:80]} | | | | |")
            continue
        lines.append(f"| {name} | {ahead.get('compiled', '')} | {serial.get('seconds', '')} | "
                     f"{serial.get('longest_kernel_s', '')} | {ahead.get('seconds', '')} | {ahead.get('recompiled', '')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.first_compile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("mixers", nargs="*", help="mixers to measure (default: every mixer)")
    parser.add_argument("--arch", type=int, default=90, help="compile for sm_<arch> (default 90)")
    parser.add_argument("--threads", type=int, default=None, help="compile-ahead threads (default: every core)")
    parser.add_argument("--toy", action="store_true", help="gpu_speed's dry-run sizes instead of its layer sizes")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: serial, ahead (default both)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="ahead", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" and args.one:
        print("first_compile: run without TRITON_INTERPRET=1 (the kernels must be compiled)", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    args.threads = args.threads or available_cores()
    if args.one:
        print(json.dumps(measure_one(args.one, args.mode, args.arch, args.threads, args.toy)))
        return 0
    names = args.mixers or [n for n in mixer_names()[0] if our_backend(n, "cuda") == "triton"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}, not {args.modes!r}")
    rows = []
    for name in names:
        for mode in modes:
            rows.append(_in_fresh_process(name, mode, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    found = [p for r in rows for p in problems(r)]
    for p in found:
        print(f"first_compile: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
