"""Side-by-side device times of one layer's kernels under variants of their tiling, in one process.

Each variant patches a module constant or a launcher's choice (nothing a kernel computes), rebuilds nothing
else, and runs the layer of ``scripts/gpu_speed.sh`` (d_model 1024, head dim 128, batch 1, bf16) on the same
inputs: per variant and length, the median over ``--repeats`` profiled forward+backward calls of each kernel's
device time (torch.profiler), the layer's summed device time, and the output's and gradients' largest relative
gap to the first variant's (a variant must compute the same function). The groups (``--mixers``, default
``gated_deltanet``):

- ``gated_deltanet``: the short convolution's backward walk (:mod:`kernels.shortconv.triton`): the programs its
  grid aims at (``_BWD_PROGRAMS``), the rows a step takes (``_UNROLL``) and the channels and warps of a program
  (``_BWD_CHANNELS``, ``_BWD_WARPS``), the first variant the default;
- ``kronecker_slots``: the read kernels' reading-token tile ``READ_ROWS`` (16 at 8ed3e8f; the whole chunk of
  64 since) and the state backward's value columns ``BDV_STATE_BWD`` (16 at 8ed3e8f, 32 since);
- ``bdlru``: the softmax gates' backward writing ``dz``, ``dv`` in place in the fused projection's gradient
  or into new contiguous tensors that the split then copies in.

The last two were timed on one H200 (BENCHMARKS.md, "The speed targets on one H200 at 8ed3e8f").

    python scripts/gpu_variants_ab.py --json out.json [--seconds 100] [--mixers ...]   # on a CUDA machine
    TRITON_INTERPRET=1 python scripts/gpu_variants_ab.py --dry-run --mixers all         # toy sizes on the CPU

The dry run takes the GPU code path on the CPU (:func:`kernels.device.gpu_path_on_cpu`; the Triton kernels
through the interpreter) at d_model 64, head dim 16 and 64 tokens, so every variant runs its kernels and the
gaps say whether the variants compute the same function; its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.blockscan.gates as gates  # noqa: E402
import kernels.shortconv.triton as conv  # noqa: E402
import kernels.slots.triton as slots  # noqa: E402
from kernels.device import gpu_path_on_cpu  # noqa: E402
from zoo.benchmark.gpu_speed import DRY, FULL, build_layer, layer_breakdown  # noqa: E402


@contextlib.contextmanager
def slots_tiles(read_rows: int, state_bwd_columns: int):
    init, rows = slots._ChunkPlan.__init__, slots.READ_ROWS

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.BDV_STATE_BWD = state_bwd_columns

    slots._ChunkPlan.__init__, slots.READ_ROWS = patched, read_rows
    try:
        yield
    finally:
        slots._ChunkPlan.__init__, slots.READ_ROWS = init, rows


@contextlib.contextmanager
def gates_destination(in_place: bool):
    keep = gates.empty_grad
    if not in_place:
        gates.empty_grad = lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device)
    try:
        yield
    finally:
        gates.empty_grad = keep


@contextlib.contextmanager
def conv_walk(programs: int, unroll: int, channels: int, warps: int):
    names = ("_BWD_PROGRAMS", "_UNROLL", "_BWD_CHANNELS", "_BWD_WARPS")
    keep = [getattr(conv, n) for n in names]
    for n, v in zip(names, (programs, unroll, channels, warps)):
        setattr(conv, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, keep):
            setattr(conv, n, v)


def _conv_label(programs, unroll, channels, warps) -> str:
    return f"programs {programs}, unroll {unroll}, {channels} ch / {warps} w"


_CONV_WALKS = [(conv._BWD_PROGRAMS, conv._UNROLL, conv._BWD_CHANNELS, conv._BWD_WARPS),
               (1024, 4, 128, 1), (4096, 4, 128, 1), (2048, 2, 128, 1), (2048, 8, 128, 1), (2048, 4, 256, 2),
               (1024, 4, 256, 2)]

VARIANTS = {
    "gated_deltanet": [(_conv_label(*w), lambda w=w: conv_walk(*w)) for w in _CONV_WALKS],
    "kronecker_slots": [(f"READ_ROWS {r}, BDV_STATE_BWD {c}", lambda r=r, c=c: slots_tiles(r, c))
                        for r, c in ((16, 16), (32, 16), (64, 16), (16, 32), (64, 32))],
    "bdlru": [("dz, dv in place", lambda: gates_destination(True)),
              ("dz, dv contiguous", lambda: gates_destination(False))],
}


def passes(mixer, x, grad):
    leaf = x.detach().requires_grad_()
    y = mixer(leaf)
    y.backward(grad)
    grads = [leaf.grad] + [p.grad for p in mixer.parameters() if p.grad is not None]
    out = [y.detach().float()] + [g.detach().float().clone() for g in grads]
    mixer.zero_grad(set_to_none=True)
    return out


def gap(a, b):
    return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--mixers", nargs="+", default=["gated_deltanet"], choices=[*VARIANTS, "all"],
                        help="the groups of variants to run (all: every group)")
    args = parser.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    device = torch.device(plan.device)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    lengths = plan.layer_lengths[:1] if args.dry_run else plan.layer_lengths
    with gpu_path_on_cpu() if args.dry_run else contextlib.nullcontext():
        rows = run(plan, device, dtype, lengths, args)
    return 0 if all("error" not in row for row in rows) else 1


def run(plan, device, dtype, lengths, args) -> list[dict]:
    deadline = time.time() + args.seconds
    rows = []
    chosen = list(VARIANTS) if "all" in args.mixers else args.mixers
    for name, variants in ((n, VARIANTS[n]) for n in chosen):
        mixer = build_layer(name, plan, device, dtype, backend="triton")  # the dry run interprets it
        for T in lengths:
            torch.manual_seed(T)
            x = torch.randn(1, T, mixer.d_model, device=device, dtype=dtype)
            grad = torch.randn_like(x)
            first = None
            for label, patch in variants:
                if time.time() > deadline:
                    print(f"{name} T {T} {label}: not run (time spent)")
                    continue
                try:
                    with patch():
                        out = passes(mixer, x, grad)          # compiles, and the values the first variant sets
                        first = first or out
                        found = [layer_breakdown(mixer, T, device, dtype) for _ in range(args.repeats)]
                except Exception as err:  # noqa: BLE001 - a variant that fails is reported, the others still run
                    rows.append({"mixer": name, "T": T, "variant": label, "error": repr(err)[:300]})
                    print(f"{name} T {T} {label}: {repr(err)[:300]}", flush=True)
                    continue
                kernels = {}
                for b in found:
                    for k in b.kernels:
                        kernels.setdefault(k["name"], []).append(k["ms"])
                row = {"mixer": name, "T": T, "variant": label,
                       "device_ms": statistics.median(b.device_ms for b in found),
                       "kernels": {k: statistics.median(v) for k, v in kernels.items()},
                       "gap_to_first": gap(out, first)}
                rows.append(row)
                top = sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:4]
                print(f"{name:16s} T {T:6d} {label:32s} device {row['device_ms']:8.3f} ms  gap {row['gap_to_first']:.1e}  "
                      + "; ".join(f"{k[:22]} {v:.3f}" for k, v in top), flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"card": torch.cuda.get_device_name() if device.type == "cuda"
                                                     else "cpu", "rows": rows}, indent=1))
        del mixer
    return rows


if __name__ == "__main__":
    sys.exit(main())
