"""Tune the delta rule's Triton kernels on one GPU: which block sizes and warps each of its seven kernels runs fastest with.

``python -m zoo.benchmark.delta_tune [--T 16384] [--n-h 1] [--json FILE]`` (CUDA, bf16, B 1, H 8, K = V = 128:
the kernel target of ``scripts/gpu_speed.sh``); ``--dry-run`` runs the same pipeline at toy sizes through
the Triton interpreter (its times mean nothing).

The kernels (:mod:`kernels.delta.triton`) take their blocks and warps from ``kernel_plan`` (no autotuning: a
first call compiles one configuration). Two groups of its fields act on different kernels: the state passes
(``_fwd_state``, ``_bwd_state``) read ``bv_state``, their warps and ``stages_state``; the five parallel
kernels read ``bk``, ``bv`` and ``warps``. Each candidate plan pairs the i-th setting of the state group with
the i-th of the parallel group (cycling the shorter list), and one forward+backward of the gated delta rule
per candidate is profiled kernel by kernel (:mod:`zoo.benchmark.device_time`). Since a kernel's time
depends only on its own group's fields, the candidates rank each group's settings separately: the plan made
of the fastest state setting and the fastest parallel setting is then timed against the current plan,
side by side, and printed with the speed-up.

Before any timing every candidate's kernels are compiled ahead on every core (:mod:`kernels.ahead`); a
candidate that does not compile or load (registers, shared memory) is reported with its error. Every candidate's
output and gradients are compared with the current plan's (largest difference over the largest entry of
each tensor): a candidate that differs by more than :data:`AGREE` is reported and not ranked.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from kernels.ahead import compile_ahead
from kernels.delta import delta_product
from kernels.delta.triton import block_chunk, kernel_plan, using_plan

from ..environment import environment
from .device_time import breakdown
from .gpu_speed import FULL, commit, delta_inputs
from .measure import error_text, largest_difference, times_ms
from .tuning import restart_interpreted, side_by_side

#: largest difference from the current plan's outputs and gradients (over each tensor's largest entry) a
#: candidate may show and still be ranked: block sizes only reorder fp32 sums of 16-bit products
AGREE = 3e-2
STATE_KERNELS = ("_fwd_state", "_bwd_state")
PARALLEL_KERNELS = ("_fwd_prep", "_fwd_out", "_bwd_out", "_bwd_prep_state", "_bwd_prep_wy")
STATE_FIELDS = ("bv_state", "warps_fwd_state", "warps_bwd_state", "stages_state")
PARALLEL_FIELDS = ("bk", "bv", "warps")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The problem tuned (the kernel target's: B 1, H 8, K = V = 128, bf16) and the timing's repeats."""

    T: int = 16384
    n_h: int = 1
    heads: int = 8
    dim: int = 128
    dtype: str = "bf16"
    warmup: int = 2
    repeats: int = 5


DRY = Sizes(T=64, heads=2, dim=32, dtype="fp16", warmup=0, repeats=1)


def _blocks(dim: int, smallest: int) -> list[int]:
    """Block sizes worth trying over a head dim: powers of two from ``smallest`` (16 at least) to 64."""
    return [b for b in (16, 32, 64) if max(16, smallest) <= b <= dim]


def candidates(current, K: int, V: int) -> list:
    """``current`` first, then plans pairing the state settings with the parallel ones (see the module docstring).

    State settings: every ``bv_state`` from 16 (a narrower block is more programs in the sequential passes,
    which a batch of one head group leaves short of the card's multiprocessors) with 4 warps in one pass and
    8 in the other (both ways) and 2 or 3 stages; parallel settings: every ``bk`` and ``bv`` from a quarter of
    the head dim with 4 or 8 warps."""
    state = [(bv, wf, wb, st) for bv in _blocks(V, 16) for wf, wb in ((4, 8), (8, 4)) for st in (2, 3)]
    parallel = [(bk, bv, w) for bk in _blocks(K, K // 4) for bv in _blocks(V, V // 4) for w in (4, 8)]
    plans = [current]
    for i in range(max(len(state), len(parallel))):
        fields = dict(zip(STATE_FIELDS, state[i % len(state)])) | dict(zip(PARALLEL_FIELDS, parallel[i % len(parallel)]))
        plan = current._replace(**fields)
        if plan not in plans:
            plans.append(plan)
    return plans


def combine(state_plan, parallel_plan):
    """The state group's fields of ``state_plan`` with the parallel group's of ``parallel_plan``."""
    return state_plan._replace(**{f: getattr(parallel_plan, f) for f in PARALLEL_FIELDS})


def kernel_times(kernels: list[dict]) -> dict:
    """Device ms of each of the seven kernels in a breakdown's list (a kernel's profiler name starts with its
    function's)."""
    out = {}
    for name in STATE_KERNELS + PARALLEL_KERNELS:
        out[name] = round(sum(k["ms"] for k in kernels if k["name"].startswith(name)), 4)
    return out


class _Problem:
    """The gated delta rule's inputs at ``sizes`` and one forward+backward of our Triton backend."""

    def __init__(self, sizes: Sizes, device: torch.device):
        self.device, self.n_h = device, sizes.n_h
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sizes.dtype]
        plan = dataclasses.replace(FULL, kernel_heads=sizes.heads, kernel_dim=sizes.dim)
        inputs = delta_inputs(plan, sizes.T, sizes.n_h, True, device, dtype)
        self.leaves = [t.detach().requires_grad_() for t in inputs]
        self.grad = torch.randn(1, sizes.T, sizes.heads, sizes.dim, device=device, dtype=dtype)

    def forward_backward(self) -> list:
        for t in self.leaves:
            t.grad = None
        o = delta_product(*self.leaves[:4], g=self.leaves[4], num_householder=self.n_h, backend="triton")[0]
        o.backward(self.grad)
        return [o.detach()] + [t.grad for t in self.leaves]

    def under(self, plan):
        """:meth:`forward_backward` with the kernels run under ``plan``."""
        def call():
            with using_plan(plan):
                return self.forward_backward()
        return call


def tune(sizes: Sizes = Sizes(), dry_run: bool = False) -> dict:
    """Run the sweep; returns the dict the command prints (see the module docstring)."""
    device = torch.device("cpu" if dry_run else "cuda")
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("delta_tune needs a CUDA device (or --dry-run)")
    torch.manual_seed(sizes.T)
    problem = _Problem(sizes, device)
    BT = block_chunk(64, sizes.dim, sizes.dim, low_precision=True)
    current = kernel_plan(BT, sizes.dim, sizes.dim, True)
    plans = candidates(current, sizes.dim, sizes.dim)
    rows, reference = [], None
    result = {"card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "commit": commit(environment(device)), "sizes": dataclasses.asdict(sizes), "chunk": BT,
              "current": current._asdict(), "candidates": rows}
    for plan in plans:
        row = {"plan": plan._asdict()}
        rows.append(row)
        try:
            row["compile_s"] = round(compile_ahead(problem.under(plan)).seconds, 2)
            outputs = problem.under(plan)()
            if reference is None:
                reference = outputs
            row["difference"] = largest_difference(outputs, reference)
            row["fwd_bwd_ms"] = statistics.median(times_ms(problem.under(plan), device, sizes.warmup,
                                                           sizes.repeats))
            found = breakdown(problem.under(plan), device)
            row["device_ms"] = round(found.device_ms, 4)
            row["kernels"] = kernel_times(found.kernels)
            if not all(row["kernels"].values()):
                raise RuntimeError(f"not every kernel of {sorted(row['kernels'])} is in the profile, whose kernels "
                                   f"are {[k['name'] for k in found.kernels][:12]}")
        except Exception as err:  # noqa: BLE001 - a plan that does not compile or run is reported, not fatal
            row["error"] = error_text(err)
            if plan == current:   # the plan every candidate is compared with
                result["error"] = f"the current plan failed: {row['error']}"
                return result
    ranked = [(p, r) for p, r in zip(plans, rows) if "error" not in r and r["difference"] <= AGREE]
    if not ranked:
        result["error"] = "no candidate ran and agreed with the current plan"
        return result
    best_state = min(ranked, key=lambda pr: sum(pr[1]["kernels"][k] for k in STATE_KERNELS))[0]
    best_parallel = min(ranked, key=lambda pr: sum(pr[1]["kernels"][k] for k in PARALLEL_KERNELS))[0]
    result["fastest_per_kernel"] = {
        k: min(ranked, key=lambda pr: pr[1]["kernels"][k])[0]._asdict() for k in STATE_KERNELS + PARALLEL_KERNELS}
    suggested = combine(best_state, best_parallel)
    compile_ahead(problem.under(suggested))
    timed = side_by_side({"current": problem.under(current), "suggested": problem.under(suggested)}, device,
                         sizes.warmup, sizes.repeats)
    now, then = timed["current"], timed["suggested"]
    result["suggested"] = {"plan": suggested._asdict(), "fwd_bwd_ms": round(then, 4), "current_fwd_bwd_ms": round(now, 4),
                           "speedup": round(now / then, 3) if then > 0 else None}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.benchmark.delta_tune", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU through the Triton interpreter")
    p.add_argument("--T", type=int, help="sequence length (default 16384; 64 in a dry run)")
    p.add_argument("--n-h", type=int, default=1, help="Householder steps per token (2: DeltaProduct)")
    p.add_argument("--json", metavar="FILE", help="also write the result to FILE")
    args = p.parse_args(argv)
    if args.dry_run and (status := restart_interpreted("zoo.benchmark.delta_tune", argv)) is not None:
        return status
    sizes = DRY if args.dry_run else Sizes()
    sizes = dataclasses.replace(sizes, n_h=args.n_h, **({"T": args.T} if args.T else {}))
    result = tune(sizes, dry_run=args.dry_run)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
