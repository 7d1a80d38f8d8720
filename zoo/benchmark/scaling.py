"""How the cost per token of each mixer in a ``zoo bench`` result changes with the length.

``python -m zoo.benchmark.scaling <bench.json> [--growth 4.6] [--tok-ratio 0.8] [--sys-share 0.15]
[--memory-slack 0.15]`` prints
one markdown row per mixer, read from the rows of one run:

- the forward+backward growth per step of ``T``, in wall time and in CPU time (user + system per call);
  the wall growth's target is ``--growth`` per 4x ``T`` (scaled as ``growth ** log4(T ratio)``);
- training tokens per second at the longest length over the shortest (wall time), target ``--tok-ratio``;
- the largest system share of a row's fwd+bwd CPU time (target under ``--sys-share``);
- the growth of fwd+bwd peak memory per step, and its memory per token at every length over that at the
  shortest (at most linear in ``T``: at most ``--memory-slack`` above 1, for the noise of resident-set
  measurements), the prefill peak memory at the longest length and the decode step time at every length;

then the run's system share of its whole CPU time and of its timed calls. Every length of a mixer must have
been measured (``lengths``: a row without its forward+backward time, failed or skipped at ``--time-limit``,
misses it, and so does a run of one length). Mixers whose state grows with ``T`` (attention; each row says so,
``state_grows_with_seq_len``, so a mixer of one's own needs no import here) are listed without targets. Exit
status 0 when every target holds, 1 otherwise, 2 for a file that is not a ``zoo bench`` result.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from mixers import MIXERS
from mixers.options import OptionError


def _cpu(row: dict, name: str = "fwd_bwd") -> float | None:
    if row.get(f"{name}_user_ms") is None:
        return None
    return row[f"{name}_user_ms"] + row[f"{name}_sys_ms"]


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(x, spec=".2f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def mixer_scaling(rows: list[dict], growth: float, tok_ratio: float, sys_share: float,
                  memory_slack: float = 0.15) -> dict:
    """The numbers and verdicts of one mixer's rows (sorted by T, errors and skipped rows left out)."""
    ok_rows = sorted((r for r in rows if r.get("fwd_bwd_ms")), key=lambda r: r["T"])
    steps = list(zip(ok_rows, ok_rows[1:]))
    out = {"lengths": [r["T"] for r in ok_rows], "skipped": [r["T"] for r in rows if not r.get("fwd_bwd_ms")]}
    out["wall"] = [b["fwd_bwd_ms"] / a["fwd_bwd_ms"] for a, b in steps]
    out["cpu"] = [_ratio(_cpu(b), _cpu(a)) for a, b in steps]
    out["limits"] = [growth ** math.log(b["T"] / a["T"], 4) for a, b in steps]
    out["memory"] = [_ratio(b.get("peak_mib"), a.get("peak_mib")) for a, b in steps]
    per_token = [r["peak_mib"] / r["T"] if r.get("peak_mib") else None for r in ok_rows]
    out["memory_per_token"] = [_ratio(p, per_token[0]) for p in per_token[1:]]
    out["tok"] = _ratio(ok_rows[-1]["tok_s_train"], ok_rows[0]["tok_s_train"]) if ok_rows else None
    shares = [r["fwd_bwd_sys_ms"] / _cpu(r) for r in ok_rows if _cpu(r)]
    out["sys"] = max(shares) if shares else None
    last = ok_rows[-1] if ok_rows else {}
    out["prefill_peak"], out["decode"] = last.get("prefill_peak_mib"), [r.get("decode_ms") for r in ok_rows]
    out["checks"] = {
        # a length not measured (an error, or skipped at the time limit) is a target not shown to hold there,
        # and one length alone shows no growth at all
        "lengths": not out["skipped"] and len(ok_rows) >= 2,
        "growth": all(g <= lim for g, lim in zip(out["wall"], out["limits"])),
        "tok/s": out["tok"] is not None and out["tok"] >= tok_ratio,
        "sys": out["sys"] is not None and out["sys"] < sys_share,
        "memory": all(m is not None and m <= 1 + memory_slack for m in out["memory_per_token"]),
    }
    return out


def state_grows(row: dict) -> bool:
    """Whether the state of ``row``'s mixer grows with T: as the row records it (``zoo bench`` does, so that a
    mixer registered by a module this process does not import is judged too), else as the registry says."""
    if "state_grows_with_seq_len" in row:
        return bool(row["state_grows_with_seq_len"])
    return MIXERS.get(row["mixer"]).state_grows_with_seq_len


def report(result: dict, growth: float = 4.6, tok_ratio: float = 0.8, sys_share: float = 0.15,
           memory_slack: float = 0.15) -> tuple[str, bool]:
    """Markdown table of every mixer's scaling and whether every linear-state mixer meets every target."""
    labels = list(dict.fromkeys(r["label"] for r in result["rows"]))
    head = ("| mixer | fwd+bwd growth, wall | CPU | train tok/s longest / shortest | max sys % | peak memory growth "
            "| peak MiB per token vs shortest | prefill peak MiB at longest | decode ms | targets |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    lines, all_ok = [], True
    for label in labels:
        rows = [r for r in result["rows"] if r["label"] == label]
        s = mixer_scaling(rows, growth, tok_ratio, sys_share, memory_slack)
        grows = state_grows(rows[0])
        failed = [k for k, v in s["checks"].items() if not v]
        verdict = "n/a (state grows with T)" if grows else ("all met" if not failed else "missed: " + ", ".join(failed))
        all_ok = all_ok and (grows or not failed)
        lines.append(f"| {label} | {', '.join(_fmt(g, suffix='x') for g in s['wall'])} "
                     f"| {', '.join(_fmt(g, suffix='x') for g in s['cpu'])} | {_fmt(s['tok'])} "
                     f"| {_fmt(None if s['sys'] is None else 100 * s['sys'], '.1f')} "
                     f"| {', '.join(_fmt(m, suffix='x') for m in s['memory'])} "
                     f"| {', '.join(_fmt(m) for m in s['memory_per_token'])} | {_fmt(s['prefill_peak'], '.0f')} "
                     f"| {' / '.join(_fmt(d, '.3g') for d in s['decode'])} | {verdict}"
                     + (f" (skipped at T = {', '.join(map(str, s['skipped']))})" if s["skipped"] else "") + " |")
    return head + "\n".join(lines) + "\n" + _run_shares(result), all_ok


def _run_shares(result: dict) -> str:
    timed = [r[f"{n}_cpu"] for r in result["rows"] for n in ("fwd", "fwd_bwd", "decode") if r.get(f"{n}_cpu")]
    user, system = sum(c[0] for c in timed), sum(c[1] for c in timed)
    text = f"\nSystem share of the timed calls' CPU time: {_fmt(_ratio(100 * system, user + system), '.1f', ' %')}"
    run = result.get("run")
    if run:
        share = _ratio(100 * run["sys_s"], run["user_s"] + run["sys_s"])
        text += (f"; of the whole run's ({run['user_s']:.0f} s user + {run['sys_s']:.1f} s system, "
                 f"{run['wall_s']:.0f} s wall): {_fmt(share, '.1f', ' %')}")
    return text + ".\n"


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """End with ``message`` on one line of standard error, exit status 2."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _read_result(parser: argparse.ArgumentParser, path: str) -> dict:
    """The ``zoo bench`` result in ``path``, or a usage error naming what is wrong with the file."""
    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        _refuse(parser, f"{path}: no such file; give the bench.json a zoo bench --out folder holds")
    except (OSError, UnicodeDecodeError) as err:
        _refuse(parser, f"{path}: cannot be read ({err.__class__.__name__}: {err})")
    except json.JSONDecodeError as err:
        _refuse(parser, f"{path}: not JSON ({err}); give the bench.json a zoo bench --out folder holds")
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"label", "mixer", "T"} <= r.keys() for r in rows):
        _refuse(parser, f"{path}: not a zoo bench result (no rows of mixers and lengths); give the bench.json a "
                        f"zoo bench --out folder holds")
    return result


def _target(positive: bool):
    """An argparse type for a target: a finite number, above 0 (``positive``) or at least 0. (A negative growth
    target raised to a fractional power of the length ratio is a complex number, and NaN misses every target.)"""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"expected a finite number {'above 0' if positive else '>= 0'}, "
                                             f"got {text!r}")
        return value
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--growth", type=_target(True), default=4.6, help="largest fwd+bwd wall growth per 4x T")
    parser.add_argument("--tok-ratio", type=_target(False), default=0.8,
                        help="smallest train tok/s, longest over shortest T")
    parser.add_argument("--sys-share", type=_target(True), default=0.15,
                        help="largest system share of a row's CPU time")
    parser.add_argument("--memory-slack", type=_target(False), default=0.15,
                        help="largest excess of peak memory per token over the shortest length's")
    args = parser.parse_args(argv)
    result = _read_result(parser, args.bench_json)
    try:
        text, ok = report(result, args.growth, args.tok_ratio, args.sys_share, args.memory_slack)
    except OptionError:  # an older result's mixer that no module imported here registers
        unknown = sorted({r["mixer"] for r in result["rows"]} - set(MIXERS.names()))
        _refuse(parser, f"{args.bench_json}: {', '.join(map(repr, unknown))} is not registered here and its rows "
                        f"do not say whether its state grows with T (an older zoo bench wrote them): run zoo bench "
                        f"again")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
