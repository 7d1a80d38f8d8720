"""``zoo bench``: time sequence mixers against each other at growing context lengths.

The mixers are layer entries in recipe syntax (``--mixers "a,b"``, or a YAML list such as
``--mixers "[a, {a: {<option>: x}}, {a: {<option>: y}}]"`` to compare two settings of one mixer; default: every
registered mixer, those of the modules the recipe's ``imports`` or an ``imports=[...]`` override names included),
resolved through the same one-pass recipe resolution as every other command, so
options take the usual ``key.path=value`` overrides (``model.d_model=256``,
``model.mixer_options.<mixer>.<option>=value``). A recipe may be given with ``--recipe`` to benchmark
its mixer options. Times are also given as a ratio to the ``--baseline`` entry (default: the first).

For every entry and every ``T`` it records the numbers of :func:`zoo.benchmark.measure.measure`. A mixer that
raises or runs out of memory at some ``T`` gets its error recorded in that row and the sweep goes on;
``--time-limit`` (default 60 s) skips lengths whose forward+backward is predicted to take longer than a
limit (from the time at the last length that timed one, on a CPU the lesser of its wall and CPU time,
quadratic for mixers whose state grows with T, linear otherwise), saying so in the row: attention stops there
while the linear-state mixers go on to long contexts (262144 tokens and beyond, as far as memory allows).

Every timing also records its user and system CPU time per call, every row the peak memory of one
forward+backward and of one prefill, and ``bench.json`` the run's total wall, user and system time. On a
CPU the C library's allocator is tuned first (:func:`zoo.host_memory.tune_allocator`): large buffers are
then reused from call to call instead of being mapped and faulted in anew. ``bench.json`` is rewritten
after every row, so an interrupted run keeps everything it finished.

``--rounds R`` runs the whole sweep (every entry at every ``T``) ``R`` times, one round after the other,
and reports for each row the median of all ``R x repeats`` timings: on a shared machine the load drifts
over minutes, and measuring a mixer's two lengths seconds apart within one round would let that drift
into the growth factor and the ratios; spreading every row's repetitions over the whole run lets every
row see the same mix of quiet and busy spells (a row whose first round failed in part, a decode out of
memory say, pools the timings it has; one skipped or failed whole is not retried). Memory is measured in the
first round only.

Outputs in ``--out``: ``bench.json`` (environment, configuration and every row), ``bench.md`` /
``bench.csv`` (each mixer's times also as a ratio to the baseline entry at the same T, and the growth of
fwd+bwd time from the previous T) and ``bench.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from mixers import MIXERS

from ..environment import environment
from ..errors import UserError
from ..experiments.results import render_bench
from ..host_memory import cpu_seconds, tune_allocator
from ..paths import probe_writable
from ..recipes import resolve
from ..recipes.loading import load_raw
from ..recipes.overrides import parse_override
from ..recipes.plain import layer_label
from ..threads import refuse_thread_count, torch_threads
from .measure import TIMES, error_text, free, measure, merge_samples, state_size_note

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: the model section every benchmark starts from (any key can be overridden)
BASE = {"model": {"d_model": 128, "mixer_options": {}}}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:  # two rows at one length: a growth "(T x1)" and a ratio to the baseline's other row
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} listed twice in {text!r}; give each length once")
    return values


def mixer_entries(text: str) -> list:
    """``"a,b"`` or a YAML flow list ``"[a, {b: {k: v}}]"`` -> layer entries."""
    text = text.strip()
    if text.startswith("["):
        try:
            entries = yaml.safe_load(text)
        except yaml.YAMLError:
            raise argparse.ArgumentTypeError(f"--mixers: not a valid YAML list: {text!r}") from None
    else:
        entries = [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(entries, list) or not entries:
        raise argparse.ArgumentTypeError("--mixers: expected at least one mixer")
    return entries


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``zoo bench`` arguments to ``parser``."""
    parser.description = ("Time mixers at growing context lengths: forward, forward+backward, memory, decode. "
                          "Mixer options are key.path=value overrides: model.mixer_options.<mixer>.<option>=value.")
    parser.add_argument("--mixers", type=mixer_entries, default=None,
                        help="layer entries as in a recipe: 'a,b', or a YAML list such as "
                             "'[a, {a: {<option>: value}}, b]'; default: every registered mixer (see `zoo list`)")
    parser.add_argument("--baseline", default=None,
                        help="the entry (as labelled in the table) whose times the others are divided by; "
                             "default: the first entry")
    parser.add_argument("--recipe", default=None, help="take model options (d_model, mixer_options) from this recipe")
    parser.add_argument("--seq-lens", type=_int_list, default=[256, 1024, 4096],
                        help="comma-separated context lengths T; default 256,1024,4096")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="fp32 (default on CPU) or bf16 (default on CUDA) or fp16")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for the run (default: torch's own choice); on a CPU shared with "
                             "other work, 1 avoids thread-barrier stalls that dwarf small kernels")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement (median; default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole sweep this many times, interleaved, and pool every row's timings "
                             "over the rounds (median of rounds x repeats; default 1)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="skip a length whose fwd+bwd is predicted to exceed this many seconds (the row says so; "
                             "default 60; 0 = no limit)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-step timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixers' weights and inputs")
    parser.add_argument("--out", default="results/bench", help="output folder (default results/bench)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="recipe overrides, e.g. model.d_model=256 model.mixer_options.<mixer>.<option>=value")


def named_imports(data: dict, overrides) -> list:
    """The modules a benchmark's recipe ``data`` names in ``imports``, as the ``overrides`` leave them (an
    ``imports=[...]`` override replaces the recipe's list)."""
    modules = data.get("imports")
    for item in overrides:
        path, value = parse_override(item)
        if path == ["imports"]:
            modules = value
    return [m for m in modules if isinstance(m, str)] if isinstance(modules, list) else []


def registered_mixers(data: dict, overrides) -> list[str]:
    """Every registered mixer once the modules the recipe or the overrides name are imported: the default
    ``--mixers``, as ``zoo list --imports`` lists them. A module that fails to import is left to the recipe pass,
    which refuses it in one line naming where it is written."""
    for module in named_imports(data, overrides):
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    return MIXERS.names()


def bench_recipe(args):
    """Resolve the benchmark's layers through the one recipe pass: every entry is one layer."""
    if args.recipe:
        data, _ = load_raw(args.recipe)
        data.pop("grid", None)
    else:
        data = json.loads(json.dumps(BASE))
    layers = args.mixers if args.mixers is not None else registered_mixers(data, args.overrides)
    data.setdefault("model", {})["layers"] = layers
    data["model"].pop("pattern", None)
    data["model"].pop("n_layers", None)
    return resolve(data, args.overrides)


def _labels(entries: list) -> list[str]:
    labels = [layer_label(e) for e in entries]
    twice = {x for x in labels if labels.count(x) > 1}
    if twice:
        raise UserError(f"--mixers: {sorted(twice)} listed twice")
    return labels


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (from :func:`configure_parser`); returns an exit code."""
    for flag, value, least in (("--batch", args.batch, 1), ("--repeats", args.repeats, 1), ("--rounds", args.rounds, 1),
                               ("--threads", args.threads, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} {value}: must be " + ("a positive integer" if least else "0 or more"))
    refuse_thread_count("--threads", args.threads)
    recipe = bench_recipe(args)
    labels = _labels(recipe.model.layer_entries())
    if args.baseline is not None and args.baseline not in labels:
        raise UserError(f"--baseline {args.baseline!r} is not one of the entries: {', '.join(labels)}")
    device = _device(args.device)
    if args.time_limit is not None and not args.time_limit >= 0:
        raise UserError(f"--time-limit {args.time_limit:g}: must be >= 0 seconds (0: no limit)")
    tune_allocator()
    with torch_threads(args.threads):
        return _run(args, device, recipe, labels)


def _device(name: str) -> torch.device:
    """The device ``--device`` names: auto (CUDA when available), a CPU or a CUDA device this machine has (on
    ``meta`` tensors nothing is computed, so their times and memory would only look measured)."""
    try:
        device = torch.device("cuda" if name == "auto" and torch.cuda.is_available()
                              else ("cpu" if name == "auto" else name))
    except RuntimeError:
        raise UserError(f"--device {name}: not a device; use auto, cpu or cuda[:i]") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: zoo bench times on a CPU or a CUDA device; use auto, cpu or cuda[:i]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.index is not None and device.type == "cuda" and device.index >= count:
        there = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise UserError(f"--device {name}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                        f"({there}); use one of those")
    return device


def _predicted_seconds(row: dict, T: int, grows: bool) -> float | None:
    """fwd+bwd seconds at ``T`` from the row of the last length whose fwd+bwd was timed: on a CPU from the
    lesser of its wall time and its CPU time per call (user + system; on a machine shared with other work the
    wall time also counts the waits for a core, and with several torch threads the CPU time counts every
    thread's), else from its wall time."""
    if not row.get("fwd_bwd_ms"):
        return None
    ms = row["fwd_bwd_ms"]
    if row.get("device") == "cpu" and row.get("fwd_bwd_user_ms") is not None:
        ms = min(ms, row["fwd_bwd_user_ms"] + row["fwd_bwd_sys_ms"])
    exponent = 2 if grows else 1
    return ms / 1e3 * (T / row["T"]) ** exponent


def write_json(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` whole or not at all (a kill mid-write leaves the previous file)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    os.replace(tmp, path)


def _totals(result: dict, start: tuple[float, float, float]) -> dict:
    """Record the run's wall, user and system seconds so far (``start``: wall clock, user, system at its start)."""
    user, system = cpu_seconds()
    result["run"] = {"wall_s": time.perf_counter() - start[0], "user_s": user - start[1], "sys_s": system - start[2]}
    return result


def _config(args, recipe, labels: list[str], dtype_name: str) -> dict:
    """What ``bench.json`` records of the run's configuration."""
    return {"mixers": labels, "baseline": args.baseline or labels[0], "recipe": recipe.plain["model"],
            "overrides": args.overrides,
            "seq_lens": args.seq_lens, "batch": args.batch, "d_model": recipe.model.d_model, "dtype": dtype_name,
            "repeats": args.repeats, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
            "decode": not args.no_decode,
            "threads": torch.get_num_threads(), "time_limit": args.time_limit,
            "allocator_tuned": tune_allocator()}


class _Sweep:
    """The mixers of one benchmark, built once each, and the rows they give: the first round measures each
    entry at each length (or records why not), later rounds add timings to those rows."""

    def __init__(self, args, device, recipe, dtype_name: str):
        self.args, self.device, self.recipe = args, device, recipe
        self.dtype_name, self.dtype = dtype_name, DTYPES[dtype_name]
        self.built: dict[int, object] = {}
        self.last: dict[int, dict] = {}  # each entry's last row with a fwd+bwd time
        self.rows: dict[tuple[int, int], dict] = {}

    def _build(self, i: int, name: str):
        if i not in self.built:
            torch.manual_seed(self.args.seed)
            self.built[i] = MIXERS.get(name)(self.recipe.model.d_model, self.recipe.layers[i].options).to(
                device=self.device, dtype=self.dtype)
        return self.built[i]

    def _measure(self, row: dict, i: int, T: int) -> None:
        """Fill ``row`` with the measurements of entry ``i`` at ``T``, or the error that stopped them."""
        a, name = self.args, self.recipe.layers[i].name
        predicted = _predicted_seconds(self.last.get(i, {}), T, MIXERS.get(name).state_grows_with_seq_len)
        if a.time_limit and predicted is not None and predicted > a.time_limit:
            row["error"] = f"skipped: fwd+bwd predicted {predicted:.0f} s > --time-limit {a.time_limit:g} s"
            return
        try:
            mixer = self._build(i, name)
            row["params"] = sum(p.numel() for p in mixer.parameters())
            torch.manual_seed(a.seed + T)
            row.update(measure(mixer, T, a.batch, self.device, self.dtype, a.warmup, a.repeats, not a.no_decode))
            note = state_size_note(row)
            if note:   # the table's note column: a state_size the results tables would report wrong
                row["error"] = "; ".join(x for x in (row.get("error"), note) if x)
            row["rounds"] = 1
            if row.get("fwd_bwd_ms"):  # the next length is predicted from the last one that timed a fwd+bwd
                self.last[i] = row
        except Exception as err:  # noqa: BLE001 - building failed: record it, go on
            row["error"] = f"build: {error_text(err)}"
            free(self.device)

    def first(self, i: int, label: str, T: int) -> dict:
        """The row of entry ``i`` at ``T`` from its first round."""
        name = self.recipe.layers[i].name
        row = {"mixer": name, "label": label, "T": T, "batch": self.args.batch,
               "d_model": self.recipe.model.d_model, "dtype": self.dtype_name, "device": str(self.device),
               # for reports read where the mixer is not registered (an out-of-tree one): python -m ...scaling
               "state_grows_with_seq_len": MIXERS.get(name).state_grows_with_seq_len}
        t0 = time.perf_counter()
        self._measure(row, i, T)
        row["wall_s"] = time.perf_counter() - t0
        self.rows[i, T] = row
        return row

    def again(self, rnd: int, i: int, T: int) -> bool:
        """Round ``rnd`` (> 0) of entry ``i`` at ``T``: its timings pooled into the first round's row (also where
        a part of it failed, a decode out of memory say: its other timings are pooled like every row's); False
        when that row has no timing (skipped, or failed whole: not retried)."""
        a, row = self.args, self.rows[i, T]
        if not any(row.get(name + "_samples") for name in TIMES):
            return False
        t0 = time.perf_counter()
        torch.manual_seed(a.seed + T)
        again = measure(self.built[i], T, a.batch, self.device, self.dtype, a.warmup, a.repeats, not a.no_decode,
                        memory=False)
        merge_samples(row, again)
        row["wall_s"] += time.perf_counter() - t0
        row["rounds"] = rnd + 1
        if again.get("error") and again["error"] not in (row.get("error") or ""):
            row["error"] = "; ".join(x for x in (row.get("error"), f"round {rnd + 1}: {again['error']}") if x)
        return True


def _run(args, device, recipe, labels) -> int:
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    out = Path(args.out)
    probe_writable(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": environment(device), "config": _config(args, recipe, labels, dtype_name), "rows": []}
    start = time.perf_counter(), *cpu_seconds()
    json_path = out / "bench.json"
    jobs = [(r, i, T) for r in range(args.rounds) for i in range(len(labels)) for T in args.seq_lens]
    bar = tqdm(jobs, desc="bench", disable=True if args.no_progress else None, file=sys.stderr)
    sweep = _Sweep(args, device, recipe, dtype_name)
    for rnd, i, T in bar:
        bar.set_postfix_str(f"{labels[i]} T={T}" + (f" round {rnd + 1}" if args.rounds > 1 else ""))
        if rnd > 0:
            if sweep.again(rnd, i, T):
                write_json(json_path, _totals(result, start))
            continue
        row = sweep.first(i, labels[i], T)
        result["rows"].append(row)
        write_json(json_path, _totals(result, start))  # every finished row is on disk at once
        if row.get("error"):
            tqdm.write(f"zoo bench: {labels[i]} T={T}: {row['error']}", file=sys.stderr)
    text = render_bench(result, out, plot=not args.no_plot)
    print(text)
    print(f"wrote {json_path}, {out / 'bench.md'}, {out / 'bench.csv'}" + ("" if args.no_plot else f", {out / 'bench.png'}"))
    ok = [r for r in result["rows"] if r.get("fwd_ms") is not None or r.get("fwd_bwd_ms") is not None]
    return 0 if ok else 1
