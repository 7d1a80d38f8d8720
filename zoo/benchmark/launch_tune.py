"""Tune the warps and pipeline stages of every Triton kernel a mixer layer launches, on one GPU.

``python -m zoo.benchmark.launch_tune [mixer ...] [--T 16384] [--json FILE]`` (CUDA, bf16, the layer of
``scripts/gpu_speed.sh``: d_model 1024, head dim 128, batch 1; default: every mixer with Triton kernels);
``--dry-run`` runs the same pipeline at toy sizes through the Triton interpreter (its times mean nothing).

``num_warps`` and ``num_stages`` change how a kernel is scheduled, not what it computes, and every launcher
fixes them per kernel (no autotuning: a first call compiles one configuration). Each variant ``(warps,
stages)`` of :data:`VARIANTS` is given to every kernel of the layer at once
(:func:`kernels.launch.launch_options`), and one forward+backward per variant is profiled kernel by kernel
(:mod:`zoo.benchmark.device_time`, the median of a few). Since a kernel's time depends on its own options
only, these passes give every kernel its fastest variant. A variant that does not compile or load for a
kernel (registers, shared memory) is found kernel by kernel, reported, and left out for it. Kernels that are
autotuned, or launched with different options at different places, are not tuned. The layer is then timed
with every kernel at its fastest variant against its launchers' own options, side by side, and its outputs
and gradients compared with theirs (:data:`AGREE`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kernels.ahead import compile_ahead
from kernels.launch import counting, launch_options
from mixers import MIXERS

from ..environment import environment
from ..recipes import resolve
from .device_time import breakdown, profiler_name
from .gpu_speed import DRY, DTYPES, FULL, Plan, commit, layer_entry, mixer_names, our_backend
from .measure import error_text, largest_difference
from .tuning import restart_interpreted, side_by_side

#: (num_warps, num_stages) tried for every kernel
VARIANTS = ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3), (2, 2), (16, 2))
DRY_VARIANTS = ((4, 2), (8, 1))
#: largest difference from the launchers' own outputs and gradients (over each tensor's largest entry): another
#: schedule may only reorder a kernel's fp32 sums
AGREE = 3e-2
#: profiled passes per variant (each kernel's time is their median)
PROFILES = 3


def tuned_mixers() -> list[str]:
    """The mixers whose layer runs Triton kernels on a GPU."""
    return [n for n in mixer_names()[0] if our_backend(n, "cuda") == "triton"]


class _Layer:
    """One mixer layer of ``plan``'s size on our Triton backend, its input and upstream gradient."""

    def __init__(self, name: str, plan: Plan, T: int, device: torch.device):
        entry = layer_entry(name, plan, plan.d_model)
        entry[name]["backend"] = "triton"
        spec = resolve({"model": {"d_model": plan.d_model, "layers": [entry]}}).layers[0]
        torch.manual_seed(0)
        dtype = DTYPES[plan.dtype] if device.type == "cuda" else torch.float32
        self.device = device
        self.mixer = MIXERS.get(name)(plan.d_model, spec.options).to(device=device, dtype=dtype)
        self.x = torch.randn(1, T, plan.d_model, device=device, dtype=dtype, requires_grad=True)
        self.grad = torch.randn_like(self.x)

    def forward_backward(self) -> list:
        self.x.grad = None
        self.mixer.zero_grad(set_to_none=True)
        y = self.mixer(self.x)
        y.backward(self.grad)
        return [y.detach(), self.x.grad] + [p.grad for p in self.mixer.parameters() if p.grad is not None]

    def under(self, options: dict):
        """:meth:`forward_backward` with the kernels launched with ``options`` (:func:`launch_options`)."""
        def call():
            with launch_options(options):
                return self.forward_backward()
        return call


def launched_options(layer: _Layer) -> tuple[dict, list]:
    """``{kernel name: (num_warps, num_stages)}`` of the kernels the layer's forward+backward launches with one
    option set each, and the names of the others (autotuned, or launched with several)."""
    with counting() as launched:
        layer.forward_backward()
    one = {name: next(iter(opts)) for name, opts in launched.options.items()
           if len(opts) == 1 and "autotuned" not in opts}
    return one, sorted(set(launched.options) - set(one))


def _options(kernels, variant) -> dict:
    warps, stages = variant
    return {k: {"num_warps": warps, "num_stages": stages} for k in kernels}


def _runs(layer: _Layer, options: dict) -> str | None:
    """None if the layer's forward+backward compiles (ahead, on every core; nothing to compile off CUDA) and
    runs with ``options``, else the error: Triton refuses some schedules when it compiles them and others
    (shared memory above the card's) when it first loads them."""
    try:
        compile_ahead(layer.under(options))
        layer.under(options)()
        return None
    except Exception as err:  # noqa: BLE001 - a schedule the compiler or the card refuses is a result
        return error_text(err)


def kernel_ms(layer: _Layer, options: dict) -> dict:
    """Each kernel's device ms (median of :data:`PROFILES` profiled forward+backward passes) by function name."""
    samples: dict = {}
    for _ in range(PROFILES):
        for k in breakdown(layer.under(options), layer.device).kernels:
            samples.setdefault(k["name"], []).append(k["ms"])
    return {name: statistics.median(ms) for name, ms in samples.items()}


def _sweep(layer: _Layer, tunable: list, variants, rows: dict) -> None:
    """Every variant's time for every tunable kernel into ``rows[kernel]["variants"]``."""
    for variant in variants:
        failed = {}
        if _runs(layer, _options(tunable, variant)) is not None:
            failed = {k: why for k in tunable if (why := _runs(layer, _options([k], variant))) is not None}
        times = kernel_ms(layer, _options([k for k in tunable if k not in failed], variant))
        for k in tunable:
            entry = {"num_warps": variant[0], "num_stages": variant[1]}
            entry.update({"error": failed[k]} if k in failed else {"ms": times.get(profiler_name(k))})
            rows[k]["variants"].append(entry)


def _fastest(rows: dict) -> dict:
    """Each kernel's fastest variant into ``rows[kernel]["best"]``; returns the options of those that beat
    their default."""
    best = {}
    for k, row in rows.items():
        timed = [v for v in row["variants"] + [row["default"]] if v.get("ms") is not None]
        row["best"] = min(timed, key=lambda v: v["ms"], default=row["default"])
        if row["best"] is not row["default"]:
            best[k] = {"num_warps": row["best"]["num_warps"], "num_stages": row["best"]["num_stages"]}
    return best


def _side_by_side(layer: _Layer, best: dict, reference: list, warmup: int, repeats: int) -> dict:
    """The layer at its launchers' options and with ``best``, timed alternately, and how far apart they compute."""
    why = _runs(layer, best)
    if why is not None:   # each kernel ran at its best alone; together they should too
        return {"error": f"the layer fails with every kernel at its fastest variant: {why}"}
    difference = largest_difference(layer.under(best)(), reference)
    timed = side_by_side({"default": layer.forward_backward, "tuned": layer.under(best)}, layer.device, warmup,
                         repeats)
    default_ms, tuned_ms = timed["default"], timed["tuned"]
    return {"default_ms": round(default_ms, 4), "tuned_ms": round(tuned_ms, 4),
            "speedup": round(default_ms / tuned_ms, 3) if tuned_ms > 0 else None,
            "difference": difference, "agrees": difference <= AGREE}


def tune_layer(name: str, plan: Plan, T: int, variants, warmup: int, repeats: int) -> dict:
    """One mixer's sweep (see the module docstring)."""
    layer = _Layer(name, plan, T, torch.device(plan.device))
    defaults, untuned = launched_options(layer)
    functions = [profiler_name(k) for k in defaults]
    tunable = [k for k in defaults if functions.count(profiler_name(k)) == 1]
    untuned += sorted(set(defaults) - set(tunable))
    why = _runs(layer, {})
    if why is not None:
        raise RuntimeError(f"the layer fails with its launchers' own options: {why}")
    reference = layer.forward_backward()
    base = kernel_ms(layer, {})
    missing = [k for k in tunable if profiler_name(k) not in base]
    if missing:
        raise RuntimeError(f"kernels {missing} are not in the profile, whose kernels are {sorted(base)[:12]}")
    rows = {k: {"default": {"num_warps": defaults[k][0], "num_stages": defaults[k][1],
                            "ms": base[profiler_name(k)]}, "variants": []} for k in tunable}
    _sweep(layer, tunable, variants, rows)
    best = _fastest(rows)
    return {"mixer": name, "T": T, "kernels": rows, "untuned": untuned, "tuned_options": best,
            "layer": _side_by_side(layer, best, reference, warmup, repeats)}


def tune(names: list[str], dry_run: bool = False, T: int | None = None) -> dict:
    plan = DRY if dry_run else FULL
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("launch_tune needs a CUDA device (or --dry-run)")
    T = T or plan.first_call_length
    variants = DRY_VARIANTS if dry_run else VARIANTS
    device = torch.device(plan.device)
    result = {"card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "commit": commit(environment(device)), "d_model": plan.d_model, "head_dim": plan.head_dim,
              "dtype": plan.dtype if device.type == "cuda" else "fp32", "variants": [list(v) for v in variants],
              "mixers": {}}
    for name in names:
        try:
            result["mixers"][name] = tune_layer(name, plan, T, variants, plan.warmup, plan.repeats)
        except Exception as err:  # noqa: BLE001 - one mixer failing does not lose the others' results
            result["mixers"][name] = {"mixer": name, "error": error_text(err)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.benchmark.launch_tune", description=__doc__.splitlines()[0])
    p.add_argument("mixers", nargs="*", help=f"default: {' '.join(tuned_mixers())}")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU through the Triton interpreter")
    p.add_argument("--T", type=int, help="sequence length (default 16384; 64 in a dry run)")
    p.add_argument("--json", metavar="FILE", help="also write the result to FILE")
    args = p.parse_args(argv)
    unknown = sorted(set(args.mixers) - set(tuned_mixers()))
    if unknown:
        p.error(f"no Triton kernels to tune in {unknown}; choose from {tuned_mixers()}")
    if args.dry_run and (status := restart_interpreted("zoo.benchmark.launch_tune", argv)) is not None:
        return status
    result = tune(args.mixers or tuned_mixers(), dry_run=args.dry_run, T=args.T)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if any("error" in m for m in result["mixers"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
