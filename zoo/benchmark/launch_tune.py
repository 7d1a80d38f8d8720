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
kernel (registers, shared memory) is found kernel by kernel, reported, and left out for it. A variant that
makes a kernel fault on the card (an illegal memory access: CUDA keeps that error for the rest of the process)
ends its mixer's tuning with an error naming the variant; on CUDA every mixer is therefore tuned in a process of
its own (``--isolate``, the default there), and a mixer whose process ended on a fault is tuned again in a new
one without the variants that faulted (``--skip-variant``; the result lists them under ``faulted_variants``),
so such a fault costs one variant of one mixer. Kernels that are
autotuned, or launched with different options at different places, are not tuned. The layer is then timed
with every kernel at its fastest variant against its launchers' own options, side by side, and its outputs
and gradients compared with theirs (:data:`AGREE`).

``--write-table`` writes the result where it counts: for every mixer whose tuned layer computes what the default
does and is faster side by side, each of its kernels' fastest variant becomes an entry of the launch table of the
card's architecture (:mod:`kernels.launch_table`, ``kernels/launch_tables/sm_<NN>.json``; ``--table-dir`` for
another folder), keyed by the kernel's exact configuration at this size, and from then on launches with those
options on that architecture. On a CPU (``--dry-run``) the layer runs the GPU's code path
(:func:`kernels.device.gpu_path_on_cpu`), so its configurations are those a GPU launches at the toy size.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernels import launch_table
from kernels.ahead import compile_ahead
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting, cuda_arch, launch_options
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
#: variants that may fault on the card before a mixer's tuning is given up (each costs a process and its compile)
MAX_FAULTS = 3


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


def launched_options(layer: _Layer) -> tuple[dict, list, dict]:
    """``{kernel name: (num_warps, num_stages)}`` of the kernels the layer's forward+backward launches with one
    option set each, the names of the others (autotuned, or launched with several), and ``{kernel name:
    [{"sixteen_bit": ..., "constexprs": {...}}, ...]}``, the configurations each is launched with (what launch
    table entries match; a kernel's variant is timed over all of its launches and written for each of them)."""
    with counting() as launched:
        layer.forward_backward()
    one = {name: next(iter(opts)) for name, opts in launched.options.items()
           if len(opts) == 1 and "autotuned" not in opts}
    configs = {name: [{"sixteen_bit": sixteen, "constexprs": dict(consts)}
                      for sixteen, consts in sorted(launched.configs[name], key=repr)] for name in one}
    return one, sorted(set(launched.options) - set(one)), configs


def _options(kernels, variant) -> dict:
    warps, stages = variant
    return {k: {"num_warps": warps, "num_stages": stages} for k in kernels}


class ContextLost(RuntimeError):
    """A variant made a kernel fault on the card (an illegal memory access, say): CUDA keeps that error for the
    rest of the process, so every later launch fails and nothing more can be measured in it. ``variant``: the
    ``(num_warps, num_stages)`` given to the kernels when it happened, where known."""

    def __init__(self, message: str, variant: tuple | None = None):
        super().__init__(message)
        self.variant = variant


#: the error texts of faults that CUDA keeps for the rest of the process (see :class:`ContextLost`)
FAULTS = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction",
          "device-side assert", "hardware stack error")


def _runs(layer: _Layer, options: dict) -> str | None:
    """None if the layer's forward+backward compiles (ahead, on every core; nothing to compile off CUDA) and
    runs with ``options``, else the error: Triton refuses some schedules when it compiles them and others
    (shared memory above the card's) when it first loads them. A fault on the card raises :class:`ContextLost`
    (the call is synchronised, so a fault shows here and not at a later variant's launch)."""
    try:
        compile_ahead(layer.under(options))
        layer.under(options)()
        if layer.device.type == "cuda":
            torch.cuda.synchronize(layer.device)
        return None
    except Exception as err:  # noqa: BLE001 - a schedule the compiler or the card refuses is a result
        text = error_text(err)
        if any(fault in text.lower() for fault in FAULTS):
            raise ContextLost(text) from err
        return text


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
        try:
            refused = _runs(layer, _options(tunable, variant))
        except ContextLost as err:
            raise ContextLost(f"variant num_warps={variant[0]}, num_stages={variant[1]}, given to {', '.join(tunable)} "
                              f"at once, faulted on the card: {err}", tuple(variant)) from err
        if refused is not None:
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
    device = torch.device(plan.device)
    with gpu_path_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        return _tune_layer(name, plan, T, variants, warmup, repeats, device)


def _tune_layer(name: str, plan: Plan, T: int, variants, warmup: int, repeats: int, device) -> dict:
    layer = _Layer(name, plan, T, device)
    defaults, untuned, configs = launched_options(layer)
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
                            "ms": base[profiler_name(k)]}, "variants": [], "configs": configs[k]} for k in tunable}
    _sweep(layer, tunable, variants, rows)
    best = _fastest(rows)
    return {"mixer": name, "T": T, "kernels": rows, "untuned": untuned, "tuned_options": best,
            "layer": _side_by_side(layer, best, reference, warmup, repeats)}


def table_entries(result: dict) -> list[dict]:
    """The launch table entries of a :func:`tune` result (:mod:`kernels.launch_table`): each tuned kernel's
    fastest variant, for every mixer whose tuned layer agrees with its default and is faster side by side."""
    entries = []
    for name, mixer in result["mixers"].items():
        layer = mixer.get("layer", {})
        if "error" in mixer or not layer.get("agrees") or not layer.get("tuned_ms", 0) < layer.get("default_ms", 0):
            continue
        for kernel, options in mixer["tuned_options"].items():
            row = mixer["kernels"][kernel]
            measured = {"card": result["card"], "commit": result["commit"], "mixer": name, "T": mixer["T"],
                        "d_model": result["d_model"], "head_dim": result["head_dim"], "dtype": result["dtype"],
                        "launcher_ms": row["default"]["ms"], "ms": row["best"]["ms"]}
            entries += [{"kernel": kernel, **config, **options, "measured": measured} for config in row["configs"]]
    return entries


def tune(names: list[str], dry_run: bool = False, T: int | None = None, after_each=None,
         budget: float | None = None, d_model: int | None = None, head_dim: int | None = None,
         skip_variants=()) -> dict:
    """Every mixer of ``names`` tuned in turn (:func:`tune_layer`); ``after_each(result, name)`` is called after
    each one (the command writes its files there, so a run stopped by a time limit keeps what it measured); no
    mixer is started once ``budget`` seconds have passed (those are listed under ``"skipped"``). ``d_model`` and
    ``head_dim`` replace the layer's (a launch table entry matches the constexprs of its size: head counts and
    head dims among them); the variants in ``skip_variants`` are not tried. A mixer ended by a fault on the card
    has the variant that faulted as its ``faulted_variant``."""
    plan = DRY if dry_run else FULL
    plan = dataclasses.replace(plan, d_model=d_model or plan.d_model, head_dim=head_dim or plan.head_dim)
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("launch_tune needs a CUDA device (or --dry-run)")
    T = T or plan.first_call_length
    skip = {tuple(v) for v in skip_variants}
    variants = [v for v in (DRY_VARIANTS if dry_run else VARIANTS) if v not in skip]
    device = torch.device(plan.device)
    result = {"card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "commit": commit(environment(device)), "d_model": plan.d_model, "head_dim": plan.head_dim,
              "dtype": plan.dtype if device.type == "cuda" else "fp32", "variants": [list(v) for v in variants],
              "mixers": {}, "skipped": []}
    start = time.perf_counter()
    for i, name in enumerate(names):
        if budget is not None and time.perf_counter() - start > budget:
            result["skipped"].append(name)
            continue
        lost = False
        try:
            result["mixers"][name] = tune_layer(name, plan, T, variants, plan.warmup, plan.repeats)
        except ContextLost as err:
            result["mixers"][name] = {"mixer": name, "error": str(err),
                                      "faulted_variant": list(err.variant) if err.variant else None}
            lost = True
        except Exception as err:  # noqa: BLE001 - one mixer failing does not lose the others' results
            result["mixers"][name] = {"mixer": name, "error": error_text(err)}
        if device.type == "cuda" and not lost:
            torch.cuda.empty_cache()
        if after_each is not None:
            after_each(result, name)
        if lost:   # this process can launch nothing more: the rest wait for another (main() gives each its own)
            result["skipped"] += names[i + 1:]
            result["context_lost"] = name
            break
    return result


def _child_arguments(args) -> list[str]:
    """The command-line options of one mixer's process under ``--isolate`` (all but the mixers, the budget and
    the output file)."""
    out = ["--dry-run"] if args.dry_run else []
    for flag, value in (("--T", args.T), ("--d-model", args.d_model), ("--head-dim", args.head_dim),
                        ("--table-dir", args.table_dir), ("--arch", args.arch)):
        if value is not None:
            out += [flag, str(value)]
    return out + _skip_arguments(args.skip_variant) + (["--write-table"] if args.write_table else [])


def _skip_arguments(variants) -> list[str]:
    """``--skip-variant W,S`` for each ``(num_warps, num_stages)`` of ``variants``."""
    return [a for warps, stages in variants for a in ("--skip-variant", f"{warps},{stages}")]


def tune_in_process(name: str, arguments: list[str]) -> dict:
    """The result of ``python -m zoo.benchmark.launch_tune <name> *arguments`` run in a process of its own, or
    ``{"exit_status": n}`` where it ended before it wrote one."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "tune.json"
        done = subprocess.run([sys.executable, "-m", "zoo.benchmark.launch_tune", name, *arguments,
                               "--json", str(out)], stdout=subprocess.DEVNULL)
        child = json.loads(out.read_text()) if out.exists() else None
    return child if child is not None and name in child["mixers"] else {"exit_status": done.returncode}


def tune_isolated(names: list[str], arguments: list[str], budget: float | None = None) -> dict:
    """:func:`tune`'s result, each mixer tuned by :func:`tune_in_process` (its table entries written by that
    process, one after another): a variant that faults on the card ends its own process only, and the mixer is
    tuned again without it (and without those that faulted before; they are listed under its
    ``faulted_variants`` with their errors). No mixer is started, or started again, once ``budget`` seconds have
    passed."""
    result: dict = {"mixers": {}, "skipped": []}
    start = time.perf_counter()
    for name in names:
        faulted: list = []
        while True:
            if budget is not None and time.perf_counter() - start > budget:
                if not faulted:
                    result["skipped"].append(name)
                break
            skips = _skip_arguments((v["num_warps"], v["num_stages"]) for v in faulted)
            child = tune_in_process(name, arguments + skips)
            if "exit_status" in child:
                result["mixers"][name] = {"mixer": name, "error": f"its process ended with exit status "
                                          f"{child['exit_status']} before it wrote a result (its output is above)"}
                break
            result.update({k: v for k, v in child.items() if k not in ("mixers", "skipped", "context_lost")})
            mixer = child["mixers"][name]
            result["mixers"][name] = {**mixer, "faulted_variants": faulted} if faulted else mixer
            variant = mixer.get("faulted_variant")
            if not variant or len(faulted) >= MAX_FAULTS:
                break
            faulted.append({"num_warps": variant[0], "num_stages": variant[1], "error": mixer["error"]})
    return result


def _variant(text: str) -> tuple[int, int]:
    try:
        warps, stages = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected num_warps,num_stages such as 8,2, got {text!r}") from None
    return warps, stages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.benchmark.launch_tune", description=__doc__.splitlines()[0])
    p.add_argument("mixers", nargs="*", help=f"default: {' '.join(tuned_mixers())}")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU through the Triton interpreter")
    p.add_argument("--T", type=int, help="sequence length (default 16384; 64 in a dry run)")
    p.add_argument("--json", metavar="FILE", help="also write the result to FILE (again after every mixer)")
    p.add_argument("--write-table", action="store_true",
                   help="write the kernels' fastest variants into the launch table of the card's architecture "
                        "(kernels/launch_tables/sm_<NN>.json) after every mixer whose tuned layer agrees and is faster")
    p.add_argument("--table-dir", metavar="DIR", help="the launch tables' folder (default kernels/launch_tables)")
    p.add_argument("--arch", type=int, help="the architecture a dry run writes the table of (on CUDA: the card's)")
    p.add_argument("--budget", type=float, metavar="S", help="start no mixer after S seconds (the rest are skipped)")
    p.add_argument("--d-model", type=int, help="the layer's width (default 1024; 64 in a dry run)")
    p.add_argument("--head-dim", type=int, help="the layer's head dim (default 128; 16 in a dry run)")
    p.add_argument("--skip-variant", type=_variant, action="append", default=[], metavar="W,S",
                   help="do not try num_warps W with num_stages S (repeatable; --isolate adds those that faulted)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="tune each mixer in a process of its own, so that a variant faulting on the card loses only "
                        "its mixer (default: on CUDA)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.mixers) - set(tuned_mixers()))
    if unknown:
        p.error(f"no Triton kernels to tune in {unknown}; choose from {tuned_mixers()}")
    if args.write_table and args.dry_run and (args.arch is None or args.table_dir is None):
        p.error("a dry run writes a launch table only with --arch and --table-dir (its times are the interpreter's, "
                "not a card's: never into kernels/launch_tables)")
    if args.dry_run and (status := restart_interpreted("zoo.benchmark.launch_tune", argv)) is not None:
        return status
    arch = args.arch
    if args.write_table and not args.dry_run and torch.cuda.is_available():
        arch = cuda_arch()
        if args.arch is not None and args.arch != arch:
            p.error(f"--arch {args.arch} is not this card's (sm_{arch}): a table holds what its architecture measured")
    table_dir = Path(args.table_dir) if args.table_dir else None

    def after_each(result: dict, name: str) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if args.write_table:
            entries = table_entries({**result, "mixers": {name: result["mixers"][name]}})
            path = launch_table.merge(arch, entries, table_dir)
            print(f"launch_tune: {name}: {len(entries)} entries written into {path}", file=sys.stderr)

    names = args.mixers or tuned_mixers()
    isolate = args.isolate if args.isolate is not None else (torch.cuda.is_available() and not args.dry_run)
    if isolate:
        result = tune_isolated(names, _child_arguments(args), args.budget)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    else:
        result = tune(names, dry_run=args.dry_run, T=args.T, after_each=after_each, budget=args.budget,
                      d_model=args.d_model, head_dim=args.head_dim, skip_variants=args.skip_variant)
    print(json.dumps(result, indent=1))
    if result["skipped"]:
        print(f"launch_tune: not started within the budget: {result['skipped']}", file=sys.stderr)
    return 1 if any("error" in m for m in result["mixers"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
