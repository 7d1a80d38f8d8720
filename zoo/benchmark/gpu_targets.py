"""The GPU speed run's summary and its targets: the ratios ``summary.json`` holds, the shape it must have,
and the verdict on each target (:mod:`zoo.benchmark.gpu_speed` measures; this module only judges).

``summary.json``::

    {"card": str, "commit": str,
     "kernel_vs_fla":   {"delta_rule": {"<T>": r, "<T'>": r}},
     "layer_vs_sdpa":   {"<mixer>": {"<T>": r, "<T'>": r}},     # every linear-state mixer
     "lm_vs_attention": {"<mixer>": {"<T>": r, "<T'>": r}},     # every linear-state mixer
     "launches":        {"<mixer>": {"<T>": n, "<T'>": n}},     # every mixer
     "first_call_s":    {"<mixer>": s}}                         # every mixer

- ``kernel_vs_fla``: our gated delta rule (one Householder step) over flash-linear-attention's
  ``chunk_delta_rule``, the larger of the forward and the forward+backward ratio (one number that meets
  the target only if both do), both measured by one run (``kernel.json`` and ``fla.json`` name the same
  ``run``);
- ``layer_vs_sdpa``: a layer's forward+backward time over an SDPA attention layer's, same run and length,
  both replayed from a CUDA graph where both captured theirs, else both eager (the report shows both);
- ``lm_vs_attention``: a language model's steady-state training tokens/s over the attention model's, both
  with each step's forward and backward replayed from a CUDA graph where both captured theirs, else both eager
  (the report's language-model table shows both and which was compared);
- ``launches``: device kernels one layer's forward+backward launches;
- ``first_call_s``: a layer's first forward+backward in a fresh process, compilation included.

A value that could not be measured is a string starting ``"not measured: "`` with the reason. The
targets (:data:`LIMITS`) apply to every measured value; beside ``summary.json``, ``kernel.json`` gives
DeltaProduct's two-step time over its one-step time, which has a target too. A run's exit status:
0 every target measured and met, 1 one missed, 3 none missed but some not measured.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: the attention layer (PyTorch's SDPA) whose time and tokens/s the others' are divided by
BASELINE = "attention"
#: the measuring stages of a run, in order; each writes ``<stage>.json`` (beside ``env.json``)
STAGES = ("first_call", "kernel", "layers", "lm", "fla")
NOT_MEASURED = "not measured"
KEYS = ("card", "commit", "kernel_vs_fla", "layer_vs_sdpa", "lm_vs_attention", "launches", "first_call_s")
MET, MISSED, UNMEASURED = "met", "missed", NOT_MEASURED
EXIT = {MET: 0, MISSED: 1, UNMEASURED: 3}


@dataclass(frozen=True)
class Limits:
    kernel_vs_fla: float = 1.2         # at most, forward and forward+backward
    two_steps_over_one: float = 2.4    # DeltaProduct n_h 2 over n_h 1, at most
    layer_long: float = 0.5            # layer / SDPA at the longer length, at most
    layer_short: float = 1.0           # ... at the shorter length, at most
    layer_short_by_mixer: tuple = (("deltaproduct", 1.5),)
    launches: int = 100                # per layer forward+backward, at most, and equal at both lengths
    lm_short: float = 0.9              # LM tokens/s over attention's at the shorter length, at least
    lm_long: float = 1.5               # ... at the longer length, at least
    first_call_s: float = 5.0          # below


LIMITS = Limits()


def not_measured(why: str) -> str:
    return f"{NOT_MEASURED}: {why}"


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Check:
    target: str
    value: object
    rule: str
    status: str


def _check(target: str, value, rule: str, ok) -> Check:
    if not is_number(value):
        why = value if isinstance(value, str) else not_measured("missing")
        return Check(target, why, rule, UNMEASURED)
    return Check(target, value, rule, MET if ok(value) else MISSED)


def _by_length(values: dict) -> list[tuple[str, object]]:
    return sorted(values.items(), key=lambda kv: int(kv[0]))


def checks(summary: dict, two_steps: dict | None = None, limits: Limits = LIMITS) -> list[Check]:
    """Every target's verdict. ``two_steps``: DeltaProduct n_h 2 over n_h 1 by length (``kernel.json``)."""
    out = []
    for T, r in _by_length(summary["kernel_vs_fla"]["delta_rule"]):
        out.append(_check(f"delta rule / fla, T {T}", r, f"<= {limits.kernel_vs_fla}",
                          lambda v: v <= limits.kernel_vs_fla))
    lengths = [T for T, _ in _by_length(summary["kernel_vs_fla"]["delta_rule"])]
    for T in lengths:
        r = (two_steps or {}).get(T, not_measured("no kernel.json"))
        out.append(_check(f"DeltaProduct n_h 2 / n_h 1, T {T}", r, f"<= {limits.two_steps_over_one}",
                          lambda v: v <= limits.two_steps_over_one))
    short_limits = dict(limits.layer_short_by_mixer)
    for mixer, by_T in summary["layer_vs_sdpa"].items():
        (short, r_short), (long, r_long) = _by_length(by_T)
        cap = short_limits.get(mixer, limits.layer_short)
        out.append(_check(f"layer {mixer} / SDPA, T {short}", r_short, f"<= {cap}", lambda v, c=cap: v <= c))
        out.append(_check(f"layer {mixer} / SDPA, T {long}", r_long, f"<= {limits.layer_long}",
                          lambda v: v <= limits.layer_long))
    for mixer, by_T in summary["launches"].items():
        counts = [n for _, n in _by_length(by_T)]
        target, rule = f"launches {mixer}, T {' and '.join(sorted(by_T, key=int))}", f"equal, <= {limits.launches}"
        unmeasured = [n for n in counts if not is_number(n)]
        if unmeasured:
            why = unmeasured[0] if isinstance(unmeasured[0], str) else not_measured("missing")
            out.append(Check(target, why, rule, UNMEASURED))
        else:
            ok = len(set(counts)) == 1 and max(counts) <= limits.launches
            out.append(Check(target, ", ".join(str(n) for n in counts), rule, MET if ok else MISSED))
    for mixer, by_T in summary["lm_vs_attention"].items():
        (short, r_short), (long, r_long) = _by_length(by_T)
        out.append(_check(f"LM {mixer} / attention, T {short}", r_short, f">= {limits.lm_short}",
                          lambda v: v >= limits.lm_short))
        out.append(_check(f"LM {mixer} / attention, T {long}", r_long, f">= {limits.lm_long}",
                          lambda v: v >= limits.lm_long))
    for mixer, s in summary["first_call_s"].items():
        target, rule = f"first call {mixer} (s)", f"< {limits.first_call_s}"
        past = _RAN_PAST.search(s) if isinstance(s, str) else None
        if past and float(past.group(1)) >= limits.first_call_s:  # stopped at a limit above the target: missed
            out.append(Check(target, s, rule, MISSED))
        else:
            out.append(_check(target, s, rule, lambda v: v < limits.first_call_s))
    return out


#: how a value stopped at a time limit reads ("not measured: ran past its 20 s limit")
_RAN_PAST = re.compile(r"ran past its (\d+(?:\.\d+)?) s limit")


def exit_status(results: list[Check]) -> int:
    statuses = {c.status for c in results}
    return EXIT[MISSED] if MISSED in statuses else EXIT[UNMEASURED] if UNMEASURED in statuses else EXIT[MET]


def validate(summary, mixers: list[str], linear: list[str], kernel_lengths, layer_lengths, lm_lengths) -> list[str]:
    """What is wrong with the shape of ``summary`` (empty when it has exactly the documented form)."""
    if not isinstance(summary, dict):
        return ["the summary is not a JSON object"]
    problems = []
    if sorted(summary) != sorted(KEYS):
        problems.append(f"keys {sorted(summary)}, expected {sorted(KEYS)}")
    for key in ("card", "commit"):
        if not isinstance(summary.get(key), str) or not summary.get(key):
            problems.append(f"{key}: expected a non-empty string")

    def per_length(where: str, values, lengths, integer=False):
        if not isinstance(values, dict) or set(values) != {str(T) for T in lengths}:
            problems.append(f"{where}: expected the lengths {[str(T) for T in lengths]}, got {values!r}")
            return
        for T, v in values.items():
            problems.extend(_value_problem(f"{where}[{T}]", v, integer))

    def per_mixer(key: str, names, lengths, integer=False):
        values = summary.get(key)
        if not isinstance(values, dict) or sorted(values) != sorted(names):
            problems.append(f"{key}: expected the mixers {sorted(names)}, got {sorted(values or {})}")
            return
        for name, v in values.items():
            per_length(f"{key}[{name}]", v, lengths, integer)

    kernel = summary.get("kernel_vs_fla")
    if not isinstance(kernel, dict) or list(kernel) != ["delta_rule"]:
        problems.append(f"kernel_vs_fla: expected {{'delta_rule': ...}}, got {kernel!r}")
    else:
        per_length("kernel_vs_fla[delta_rule]", kernel["delta_rule"], kernel_lengths)
    per_mixer("layer_vs_sdpa", linear, layer_lengths)
    per_mixer("lm_vs_attention", linear, lm_lengths)
    per_mixer("launches", mixers, layer_lengths, integer=True)
    first = summary.get("first_call_s")
    if not isinstance(first, dict) or sorted(first) != sorted(mixers):
        problems.append(f"first_call_s: expected the mixers {sorted(mixers)}, got {sorted(first or {})}")
    else:
        for name, v in first.items():
            problems.extend(_value_problem(f"first_call_s[{name}]", v))
    return problems


def _value_problem(where: str, value, integer: bool = False) -> list[str]:
    if isinstance(value, str) and value.startswith(NOT_MEASURED + ": "):
        return []
    if integer and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return [f"{where}: expected a count or '{NOT_MEASURED}: <why>', got {value!r}"]
    if not is_number(value) or value < 0:
        return [f"{where}: expected a non-negative number or '{NOT_MEASURED}: <why>', got {value!r}"]
    return []


def table(results: list[Check]) -> str:
    """The verdicts as a markdown table."""
    lines = ["| target | value | rule | verdict |", "|---|---|---|---|"]
    for c in results:
        value = f"{c.value:.3g}" if is_number(c.value) else str(c.value)
        lines.append(f"| {c.target} | {value} | {c.rule} | {c.status} |")
    return "\n".join(lines)
