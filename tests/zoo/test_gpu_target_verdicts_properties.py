"""The GPU speed verdicts against a hand computation: summaries built value by value, each drawn just below,
exactly on or just above its target's threshold (or not measured), get the verdict each documented rule gives,
at the length it belongs to, and the exit status follows the worst verdict (1 missed, 3 not measured, 0 met)."""
import json
import math

import torch

from zoo.benchmark import gpu_report
from zoo.benchmark.gpu_targets import MET, MISSED, UNMEASURED, checks, exit_status
from zoo.benchmark.runner import write_json

# the documented targets, written out here rather than read from the module under test
KERNEL, TWO_STEPS, LAYER_LONG, LAUNCHES = 1.2, 2.4, 0.5, 100       # at most
LAYER_SHORT = {"deltaproduct": 1.5}                                 # at most, else 1.0
LM_SHORT, LM_LONG = 0.9, 1.5                                        # at least
FIRST_CALL = 5.0                                                    # strictly below
MIXERS = ("deltaproduct", "mixer_a", "mixer_b")
SIDES = ("below", "on", "above")


def _pick(options):
    return options[int(torch.randint(0, len(options), ()))]


def _lengths() -> tuple[str, str]:
    """A shorter and a longer length whose text sorts the other way round ("700" after "1300")."""
    return str(int(torch.randint(200, 1000, ()))), str(int(torch.randint(1000, 2000, ())))


def _near(threshold: float, side: str) -> float:
    gap = 10 ** (-6 + 5.7 * float(torch.rand(())))   # 1e-6 .. 0.5, relative
    return {"below": threshold * (1 - gap), "on": threshold, "above": threshold * (1 + gap)}[side]


def _value(threshold: float, kind: str):
    """``(value, expected verdict)``: a number on a random side of ``threshold`` or, now and then, a value that
    is not a measurement. ``kind``: ``most`` (at most), ``least`` (at least) or ``below`` (strictly)."""
    roll = float(torch.rand(()))
    if roll < 0.06:
        return "not measured: OOM: out of memory", UNMEASURED
    if roll < 0.09:
        return _pick([math.nan, math.inf, -math.inf]), UNMEASURED
    side = _pick(SIDES)
    met = {"most": side != "above", "least": side != "below", "below": side == "below"}[kind]
    return _near(threshold, side), MET if met else MISSED


def _case(two_steps_given: bool = True):
    """A summary, DeltaProduct's two-step ratios and every target's expected verdict."""
    kernel_lengths, (short, long), (lm_short, lm_long) = _lengths(), _lengths(), _lengths()
    summary = {"card": "c", "commit": "x", "kernel_vs_fla": {"delta_rule": {}}, "layer_vs_sdpa": {},
               "lm_vs_attention": {}, "launches": {}, "first_call_s": {}}
    two_steps, want = {}, {}
    for T in kernel_lengths:
        summary["kernel_vs_fla"]["delta_rule"][T], want[f"delta rule / fla, T {T}"] = _value(KERNEL, "most")
        two_steps[T], status = _value(TWO_STEPS, "most")
        want[f"DeltaProduct n_h 2 / n_h 1, T {T}"] = status if two_steps_given else UNMEASURED
    for name in MIXERS:
        layer, lm = summary["layer_vs_sdpa"].setdefault(name, {}), summary["lm_vs_attention"].setdefault(name, {})
        layer[short], want[f"layer {name} / SDPA, T {short}"] = _value(LAYER_SHORT.get(name, 1.0), "most")
        layer[long], want[f"layer {name} / SDPA, T {long}"] = _value(LAYER_LONG, "most")
        lm[lm_short], want[f"LM {name} / attention, T {lm_short}"] = _value(LM_SHORT, "least")
        lm[lm_long], want[f"LM {name} / attention, T {lm_long}"] = _value(LM_LONG, "least")
        counts = _pick([(LAUNCHES, LAUNCHES), (LAUNCHES + 1, LAUNCHES + 1), (LAUNCHES - 1, LAUNCHES),
                        (LAUNCHES, LAUNCHES - 1), (7, 7), (7, 8), (7, "not measured: OOM")])
        summary["launches"][name] = {short: counts[0], long: counts[1]}
        target = f"launches {name}, T {short} and {long}"
        if any(isinstance(n, str) for n in counts):
            want[target] = UNMEASURED
        else:
            want[target] = MET if counts[0] == counts[1] and counts[0] <= LAUNCHES else MISSED
        summary["first_call_s"][name], want[f"first call {name} (s)"] = _first_call()
    return summary, two_steps if two_steps_given else None, want


def _first_call():
    """A first call's seconds, or a process stopped at a time limit: missed when that limit is not below the
    target (the call took at least that long), not measured when it is."""
    if float(torch.rand(())) < 0.3:
        limit = _pick([FIRST_CALL, FIRST_CALL + float(torch.randint(1, 30, ())), FIRST_CALL - 1.0])
        return f"not measured: ran past its {limit:g} s limit", MISSED if limit >= FIRST_CALL else UNMEASURED
    return _value(FIRST_CALL, "below")


def _worst(want: dict) -> int:
    statuses = set(want.values())
    return 1 if MISSED in statuses else 3 if UNMEASURED in statuses else 0


def test_random_summaries_get_the_verdicts_of_the_rules():
    for _ in range(300):
        summary, two_steps, want = _case(two_steps_given=float(torch.rand(())) < 0.9)
        results = checks(summary, two_steps)
        got = {c.target: c.status for c in results}
        assert got == want, json.dumps({"summary": summary, "two_steps": two_steps}, default=str)
        assert exit_status(results) == _worst(want)


def test_every_value_on_its_threshold_is_met_except_the_strict_first_call():
    summary, two_steps, _ = _case()
    for T in two_steps:
        summary["kernel_vs_fla"]["delta_rule"][T], two_steps[T] = KERNEL, TWO_STEPS
    (short, long), (lm_short, lm_long) = (sorted(summary[k]["mixer_a"], key=int)
                                          for k in ("layer_vs_sdpa", "lm_vs_attention"))
    for name in MIXERS:
        summary["layer_vs_sdpa"][name] = {short: LAYER_SHORT.get(name, 1.0), long: LAYER_LONG}
        summary["lm_vs_attention"][name] = {lm_short: LM_SHORT, lm_long: LM_LONG}
        summary["launches"][name] = {short: LAUNCHES, long: LAUNCHES}
        summary["first_call_s"][name] = FIRST_CALL * (1 - 1e-9)
    results = checks(summary, two_steps)
    assert {c.status for c in results} == {MET} and exit_status(results) == 0
    which = _pick(MIXERS)
    summary["first_call_s"][which] = FIRST_CALL
    results = checks(summary, two_steps)
    assert [c.target for c in results if c.status != MET] == [f"first call {which} (s)"]
    assert exit_status(results) == 1


def test_a_folder_without_kernel_json_has_its_two_step_targets_not_measured(tmp_path, capsys):
    """``--check`` of a folder whose kernel stage left no file: every other target met, the two-step ones not
    measured, so the run exits 3, not 0."""
    summary, _, _ = _case()
    for T in summary["kernel_vs_fla"]["delta_rule"]:
        summary["kernel_vs_fla"]["delta_rule"][T] = _near(KERNEL, "below")
    for name in MIXERS:
        (short, long), (lm_short, lm_long) = (sorted(summary[k][name], key=int)
                                              for k in ("layer_vs_sdpa", "lm_vs_attention"))
        summary["layer_vs_sdpa"][name] = {short: _near(LAYER_SHORT.get(name, 1.0), "below"),
                                          long: _near(LAYER_LONG, "below")}
        summary["lm_vs_attention"][name] = {lm_short: _near(LM_SHORT, "above"), lm_long: _near(LM_LONG, "above")}
        count = int(torch.randint(1, LAUNCHES + 1, ()))
        summary["launches"][name] = {short: count, long: count}
        summary["first_call_s"][name] = _near(FIRST_CALL, "below")
    write_json(tmp_path / "summary.json", summary)
    assert gpu_report.check_folder(tmp_path) == 3
    table = capsys.readouterr().out
    two_step_lines = [line for line in table.splitlines() if "DeltaProduct n_h 2" in line]
    assert len(two_step_lines) == 2 and all(line.endswith(f"| {UNMEASURED} |") for line in two_step_lines)
    assert f"| {MISSED} |" not in table
