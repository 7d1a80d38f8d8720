"""From a GPU speed run's stage files to its ``summary.json`` and ``summary.md`` and the verdicts.

:mod:`zoo.benchmark.gpu_speed` writes one JSON file per stage into ``bench-gpu-<card>/``; :func:`conclude`
turns them into the summary (the ratios :mod:`zoo.benchmark.gpu_targets` documents; a value that is
missing says why: its stage did not run, ran past its limit, or its row failed) and the report, and
:func:`check_folder` judges a folder again (building the summary first for a run stopped before it).
"""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from ..errors import UserError
from . import gpu_targets as targets
from . import lm_budget
from .gpu_targets import BASELINE, STAGES
from .runner import write_json


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None



def _rows(stage: dict | None) -> list[dict]:
    rows = (stage or {}).get("rows", [])
    return list(rows.values()) if isinstance(rows, dict) else rows


def _by_mixer(stage: dict | None) -> dict:
    """The first-call stage's rows by mixer (a stage not run for want of time has an empty list of them)."""
    rows = (stage or {}).get("rows")
    return rows if isinstance(rows, dict) else {}


def _find(stage: dict | None, **match) -> dict | None:
    return next((r for r in _rows(stage) if all(r.get(k) == v for k, v in match.items())), None)


def _absent(stage_name: str, stage: dict | None) -> str:
    """Why a value of ``stage`` is missing."""
    if stage is None:
        return targets.not_measured(f"the {stage_name} stage did not run")
    if stage.get("error"):
        return targets.not_measured(stage["error"])
    stopped = stage.get("stopped")
    if stopped and stage_name == "fla" and "ran past" in stopped:
        return targets.not_measured(f"autotune ran past the limit (the fla stage {stopped})")
    if stopped:
        return targets.not_measured(f"the {stage_name} stage {stopped}")
    return targets.not_measured("not reached")


def _value(stage_name: str, stage: dict | None, row: dict | None, key: str):
    if row is not None and targets.is_number(row.get(key)):
        return row[key]
    if row is not None and row.get("error"):
        return targets.not_measured(row["error"])
    return _absent(stage_name, stage)


def _ratio(over: tuple, under: tuple, keys: tuple, combine=max):
    """``combine`` of ``over[key] / under[key]`` over ``keys``; each side is ``(stage name, stage, row)``."""
    ratios = []
    for key in keys:
        a, b = _value(*over, key), _value(*under, key)
        for v in (a, b):
            if not targets.is_number(v):
                return v
        if b == 0:
            return targets.not_measured(f"{key} of the baseline is 0")
        ratios.append(a / b)
    return combine(ratios)


TIMES = ("fwd_ms", "fwd_bwd_ms")


def two_step_ratios(kernel: dict | None, lengths) -> dict:
    """DeltaProduct n_h 2 over n_h 1 by length: the larger of the forward and the forward+backward ratio."""
    return {str(T): _ratio(("kernel", kernel, _find(kernel, T=T, n_h=2)), ("kernel", kernel, _find(kernel, T=T, n_h=1)),
                           TIMES) for T in lengths}


#: a language-model row's tokens/s with each step's passes captured as a CUDA graph (absent where capture failed)
GRAPH_RATE = "graph_tokens_per_second"
#: largest relative gap between a captured step's loss or gradients and an eager step's for the captured rate
#: to count: both run the same kernels on the same inputs, so only reductions' order may differ
GRAPH_GAP_LIMIT = 1e-2


#: a layer row's forward+backward time replaying one CUDA graph of it (absent where capture failed)
GRAPH_TIME = "graph_fwd_bwd_ms"
#: the gaps to an eager call that a captured value of each kind comes with
GRAPH_GAPS = {GRAPH_RATE: ("graph_loss_gap", "graph_grad_gap"), GRAPH_TIME: ("graph_output_gap", "graph_grad_gap")}


def graph_trusted(row: dict | None, key: str = GRAPH_RATE) -> bool:
    """Whether ``row``'s captured passes ran (``key``: the captured rate or time) and computed what the eager ones
    compute."""
    values = [(row or {}).get(k) for k in (key, *GRAPH_GAPS[key])]
    return all(targets.is_number(v) for v in values) and max(values[1:]) <= GRAPH_GAP_LIMIT


def lm_mode(mine: dict | None, base: dict | None) -> str:
    """The rate a language model is compared to attention's by: the captured steps' where both models captured
    theirs and they agree with the eager ones (the host out of both steps), else the eager steps' (the same kind
    of step on both sides)."""
    return GRAPH_RATE if graph_trusted(mine) and graph_trusted(base) else "tokens_per_second"


def layer_mode(mine: dict | None, base: dict | None) -> str:
    """The time a layer is compared to the SDPA layer's by: the captured forward+backward's where both layers
    captured theirs and they agree with an eager call (the host out of both calls), else the eager one's."""
    return GRAPH_TIME if graph_trusted(mine, GRAPH_TIME) and graph_trusted(base, GRAPH_TIME) else "fwd_bwd_ms"


def lm_ratio(lm: dict | None, name: str, T: int):
    mine, base = _find(lm, mixer=name, T=T), _find(lm, mixer=BASELINE, T=T)
    return _ratio(("lm", lm, mine), ("lm", lm, base), (lm_mode(mine, base),))


def summarize(folder: Path) -> tuple[dict, dict]:
    """``summary.json``'s content from the stage files in ``folder``, and DeltaProduct's n_h 2 / n_h 1."""
    stages = {name: read_json(folder / f"{name}.json") for name in ("env", *STAGES)}
    env = stages["env"]
    plan = env["plan"]
    kernel, fla, layers, lm, first = (stages[n] for n in ("kernel", "fla", "layers", "lm", "first_call"))
    kernel_vs_fla = {str(T): _ratio(("kernel", kernel, _find(kernel, T=T, n_h=1)), ("fla", fla, _find(fla, T=T)),
                                    TIMES) for T in plan["kernel_lengths"]}
    if kernel is not None and fla is not None and kernel.get("run") != fla.get("run"):  # --stages re-ran one
        kernel_vs_fla = {T: targets.not_measured("kernel.json and fla.json were written by different runs; run "
                                                 "the kernel and fla stages together")
                         for T in kernel_vs_fla}
    two_steps = two_step_ratios(kernel, plan["kernel_lengths"])
    layer_vs_sdpa, launches = {}, {}
    for name in env["mixers"]:
        by_T = {str(T): ("layers", layers, _find(layers, mixer=name, T=T)) for T in plan["layer_lengths"]}
        launches[name] = {T: _value(*side, "launches") for T, side in by_T.items()}
        if name in env["linear"]:
            layer_vs_sdpa[name] = {}
            for T, side in by_T.items():
                base = ("layers", layers, _find(layers, mixer=BASELINE, T=int(T)))
                layer_vs_sdpa[name][T] = _ratio(side, base, (layer_mode(side[2], base[2]),))
    lm_vs_attention = {name: {str(T): lm_ratio(lm, name, T) for T in plan["lm_lengths"]} for name in env["linear"]}
    first_rows = _by_mixer(first)
    first_call_s = {name: _value("first_call", first, first_rows.get(name), "seconds") for name in env["mixers"]}
    summary = {"card": env["card"], "commit": env["commit"], "kernel_vs_fla": {"delta_rule": kernel_vs_fla},
               "layer_vs_sdpa": layer_vs_sdpa, "lm_vs_attention": lm_vs_attention, "launches": launches,
               "first_call_s": first_call_s}
    return summary, two_steps


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


#: kernels a row of the report's time breakdown names
TOP_KERNELS = 4


def longest_kernels(row: dict, top: int = TOP_KERNELS) -> str:
    """``name calls x ms`` of a row's ``top`` longest kernels (:mod:`zoo.benchmark.device_time`)."""
    return "; ".join(f"{k['name']} {k['calls']}x {k['ms']:.3g}" for k in row["kernels"][:top])


def _note(data: dict, row: dict | None = None) -> str:
    """Why a row (or its stage) has no value: its error, the stage's stop or error."""
    return (row or {}).get("error") or data.get("stopped") or data.get("error") or ""


def _layer_table(layers: dict | None, plan: dict) -> tuple[str, list, list]:
    """The report's layer section: its text, columns and rows."""
    about = (f"d_model {plan['d_model']}, head dim {plan['head_dim']}, batch 1, median of `repeats` after "
             f"{plan['warmup']} warm-up calls (fewer repeats where a layer's share of the stage's time is short); "
             f"launches: device kernels of one forward+backward "
             f"({'torch.profiler' if plan['device'] == 'cuda' else 'operators dispatched'}); `graph`: the same "
             f"forward+backward captured once as a CUDA graph and replayed (`graph gap`: its first replay's output "
             f"and gradients against an eager call's, relative). The targets compare the graphs where both layers "
             f"captured theirs within a gap of {GRAPH_GAP_LIMIT:g}, else the eager calls (`compared`).")
    columns = ["mixer", "backend", "T", "repeats", "fwd ms", "fwd+bwd ms", "graph fwd+bwd ms", "compared",
               "graph gap out, grads", "launches", "note"]
    body = [[r["mixer"], r.get("backend", ""), r["T"], _fmt(r.get("repeats")), _fmt(r.get("fwd_ms")),
             _fmt(r.get("fwd_bwd_ms")), _fmt(r.get(GRAPH_TIME)),
             "graph" if layer_mode(r, _find(layers, mixer=BASELINE, T=r["T"])) == GRAPH_TIME else "eager",
             ", ".join(_fmt(r.get(k)) for k in GRAPH_GAPS[GRAPH_TIME] if r.get(k) is not None),
             _fmt(r.get("launches")),
             "; ".join(x for x in (_note(layers or {}, r), r.get("graph_error") and f"graph: {r['graph_error']}")
                       if x)]
            for r in _rows(layers)]
    return about, columns, body


def _cut(row: lm_budget.MixerBudget) -> str:
    if row.fits:
        return "fits"
    return "no mixer fits" if row.budget_ms <= 0 else f"{row.cut:.0%}"


def _budget_section(lm: dict | None, plan: dict, linear: list[str]) -> tuple[str, list, list] | None:
    """The report's budget section (:mod:`zoo.benchmark.lm_budget`): its text, columns and rows; None where no
    length has a profiled attention step to split."""
    lengths = sorted(plan["lm_lengths"])
    limits = {lengths[0]: targets.LIMITS.lm_short, lengths[-1]: targets.LIMITS.lm_long}
    found = {T: lm_budget.length_budget(_rows(lm), T, limits[T], BASELINE, linear) for T in lengths}
    split = [b for b in found.values() if not isinstance(b, str)]
    if not split:
        return None
    about = ("From each model's profiled step (device ms; `zoo.benchmark.lm_budget`): `shared` is attention's step "
             "less its attention kernels (SDPA's, the rotary embedding's), the work every model here shares; the "
             "`ceiling` is attention's step over it, the ratio a model whose mixers cost nothing beyond attention's "
             "projections would reach; a model's `mixer ms` is its step less `shared`, its `budget ms` what its "
             "mixers may cost to meet the target (attention's step over the target, less `shared`), and `cut` the "
             "share of its mixers' time above the budget. At each length: "
             + "; ".join(f"T {b.T}: attention's step {b.attention_ms:.3g} ms, its attention kernels "
                         f"{b.attention_own_ms:.3g} ms, shared {b.shared_ms:.3g} ms, ceiling {b.ceiling:.3g}x "
                         f"(target {b.target:g}x{'' if b.ceiling >= b.target else ', above the ceiling'})"
                         for b in split)
             + "".join(f"; T {T}: {why}" for T, why in found.items() if isinstance(why, str)) + ".")
    columns = ["mixer"] + [f"T {b.T}: {col}" for b in split for col in ("mixer ms", "budget ms", "cut")]
    body = []
    for name in linear:
        cells = []
        for b in split:
            row = next((m for m in b.mixers if m.mixer == name), None)
            cells += ["", "", ""] if row is None else [f"{row.mixer_ms:.3g}", f"{row.budget_ms:.3g}",
                                                      _cut(row)]
        body.append([name, *cells])
    return about, columns, body


def render(folder: Path, results: list, status: int, seconds: float | None) -> str:
    """``summary.md``: the verdicts, then every stage's numbers."""
    stage = {name: read_json(folder / f"{name}.json") or {} for name in ("env", *STAGES)}
    env, plan = stage["env"], stage["env"]["plan"]
    versions = ", ".join(f"{k} {v}" for k, v in env["environment"]["versions"].items())
    meaning = {0: "every target measured and met", 1: "a target missed", 3: "no target missed, some not measured"}
    parts = [f"# GPU speed: {env['card']}, commit {env['commit']}\n",
             "Written by `scripts/gpu_speed.sh` (python -m zoo.benchmark.gpu_speed)"
             + (f" in {seconds:.0f} s" if seconds is not None else "") + f"; {versions}; "
             f"{plan['dtype']}. Exit status {status}: {meaning[status]}.\n",
             "## Targets\n", targets.table(results) + "\n"]

    def section(title: str, about: str, columns: list, body: list) -> None:
        parts.extend([f"## {title}\n", about + "\n", tabulate(body, headers=columns, tablefmt="github") + "\n"])

    kernel_rows = _rows(stage["kernel"]) + _rows(stage["fla"])
    section("Kernels", f"B 1, H {plan['kernel_heads']}, K = V = {plan['kernel_dim']}, median of {plan['repeats']} "
            f"after {plan['warmup']} warm-up calls. Ours: {stage['kernel'].get('about', 'not run')}; theirs: "
            f"{stage['fla'].get('about', stage['fla'].get('error', 'not run'))}.",
            ["op", "backend", "T", "fwd ms", "fwd+bwd ms", "note"],
            [[r["op"], r["backend"], r["T"], _fmt(r.get("fwd_ms")), _fmt(r.get("fwd_bwd_ms")),
              _note(stage["fla"] if r["op"].startswith("theirs") else stage["kernel"], r)] for r in kernel_rows])
    section("Layers", *_layer_table(stage["layers"], plan))
    timed_rows = [(f"{r['op']} ({r['backend']})", r) for r in kernel_rows] + \
        [(f"{r['mixer']} layer ({r.get('backend', '')})", r) for r in _rows(stage["layers"])]
    section("Where the time goes", f"One more forward+backward of each row above, its device kernels grouped by name "
            f"({'torch.profiler' if plan['device'] == 'cuda' else 'operators dispatched, timed by the wall clock'}): "
            f"their summed time (`device ms`; far below the wall time, the call waits on the host) and the "
            f"{TOP_KERNELS} longest; for layers, `host ms`: the host's time to issue the call (near the wall time: "
            f"the device waits on Python and the launchers) and `syncs`: how often it waited for the device "
            f"(CUDA's sync debug mode; where, in the layer files' `sync_sites`).",
            ["call", "T", "fwd+bwd ms", "device ms", "host ms", "syncs", "launches", "longest kernels: calls x, ms"],
            [[call, r["T"], _fmt(r.get("fwd_bwd_ms")), _fmt(r.get("device_ms")), _fmt(r.get("host_ms")),
              _fmt(r.get("syncs")), _fmt(r.get("launches")), longest_kernels(r)]
             for call, r in timed_rows if r.get("kernels")])
    section("Language models", f"{plan['lm_layers']} layers, d_model {plan['lm_d_model']}, {plan['lm_tokens']} tokens "
            f"per step; steady state after {plan['lm_warmup']} warm-up steps, over up to {plan['lm_steps']} steps; "
            f"eager steps, then steps whose forward and backward replay a CUDA graph (`graph`; `graph gap`: its "
            f"first replay's loss and gradients against an eager step's, relative). The targets compare the graph "
            f"steps where both models captured theirs within a gap of {GRAPH_GAP_LIMIT:g}, else the eager ones "
            f"(`compared`).",
            ["mixer", "T", "batch", "tokens/s", "graph tokens/s", "compared", "graph gap loss, grads", "timed steps",
             "host ms", "device ms", "launches", "note"],
            [[r["mixer"], r["T"], r.get("batch", ""), _fmt(r.get("tokens_per_second")), _fmt(r.get(GRAPH_RATE)),
              "graph" if lm_mode(r, _find(stage["lm"], mixer=BASELINE, T=r["T"])) == GRAPH_RATE else "eager",
              ", ".join(_fmt(r.get(k)) for k in ("graph_loss_gap", "graph_grad_gap") if r.get(k) is not None),
              ", ".join(_fmt(r.get(k)) for k in ("timed_steps", "graph_timed_steps") if r.get(k) is not None),
              _fmt(r.get("step_host_ms")),
              _fmt(r.get("step_device_ms")), _fmt(r.get("step_launches")),
              "; ".join(x for x in (_note(stage["lm"], r), r.get("graph_error") and f"graph: {r['graph_error']}")
                        if x)]
             for r in _rows(stage["lm"])])
    step_rows = [r for r in _rows(stage["lm"]) if r.get("step_kernels")]
    if step_rows:
        section("Where a language model's step goes", "The profiled step of each row above (eager): its device "
                f"kernels grouped by name, the {TOP_KERNELS} longest (calls x, ms); with a captured step the "
                "device time is the step's time.",
                ["mixer", "T", "device ms", "longest kernels: calls x, ms"],
                [[r["mixer"], r["T"], _fmt(r.get("step_device_ms")), longest_kernels({"kernels": r["step_kernels"]})]
                 for r in step_rows])
    budget = _budget_section(stage["lm"], plan, env["linear"])
    if budget is not None:
        section("What the language-model targets leave a mixer", *budget)
    section("First call", f"T {plan['first_call_length']}: a fresh process per mixer with an empty Triton cache, the "
            f"first forward+backward, compilation included.", ["mixer", "backend", "seconds", "note"],
            [[name, r.get("backend", ""), _fmt(r.get("seconds")), r.get("error", "")]
             for name, r in _by_mixer(stage["first_call"]).items()])
    return "\n".join(parts)


def check_folder(folder: Path) -> int:
    """The verdicts of a finished folder (its ``summary.json``, and ``kernel.json`` where present); for a
    run stopped before its summary, the summary is built from its stage files first."""
    if not (folder / "summary.json").exists() and (folder / "env.json").exists():
        return conclude(folder)
    summary = read_json(folder / "summary.json")
    if summary is None:
        raise UserError(f"{folder / 'summary.json'}: missing or not JSON; run scripts/gpu_speed.sh first")
    kernel = read_json(folder / "kernel.json")
    two_steps = two_step_ratios(kernel, sorted({r["T"] for r in _rows(kernel)})) if kernel is not None else None
    results = targets.checks(summary, two_steps)
    print(targets.table(results))
    return targets.exit_status(results)


def conclude(folder: Path, seconds: float | None = None) -> int:
    """Build ``summary.json`` and ``summary.md`` from the stage files in ``folder``, print the verdicts and
    return the exit status (``seconds``: how long the run took, where known)."""
    env = read_json(folder / "env.json")
    plan = env["plan"]
    summary, two_steps = summarize(folder)
    problems = targets.validate(summary, env["mixers"], env["linear"], plan["kernel_lengths"],
                                plan["layer_lengths"], plan["lm_lengths"])
    if problems:
        raise RuntimeError("gpu_speed: the summary does not have its documented form: " + "; ".join(problems))
    write_json(folder / "summary.json", summary)
    results = targets.checks(summary, two_steps)
    status = targets.exit_status(results)
    (folder / "summary.md").write_text(render(folder, results, status, seconds))
    print(targets.table(results))
    print(f"gpu_speed: wrote {folder}/summary.json and summary.md; exit status {status}", flush=True)
    return status
