"""Run test folders once per ``ZOO_TEST_SEED`` value and list which test failed under which seed.

The suite draws fresh random inputs every run (tests/conftest.py seeds torch from ``ZOO_TEST_SEED``, or
from the OS when it is unset), so one green run says little about a test whose property holds only for
most draws, or whose tolerance sits at the edge of its error's spread. This script runs the given paths
(default ``tests/kernels tests/mixers``) in sequence under each seed — given with ``--seeds``, or drawn and
printed — keeps each run's output in ``--log-dir``, and ends with a summary: every failing test, the seeds
it failed under, and the command that replays it. It exits 1 when any run failed.

    OMP_NUM_THREADS=1 python scripts/seed_sweep.py [PATH ...] [--count 10] [--seeds S1 S2 ...]
                                                   [--log-dir results/seed-sweep] [-k EXPR]

Not part of CI: one seed of tests/kernels + tests/mixers takes minutes on a CPU.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("tests/kernels", "tests/mixers")
# pytest's short summary (-rfE): "FAILED tests/x.py::test_y[id] - AssertionError: ..."
OUTCOME = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
TOTALS = re.compile(r"^=*\s*(.*\d+ (?:passed|failed|error|errors|skipped)\b.*?)\s*=*$")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS), help="test paths (default: %(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, help="the seeds to run (default: --count drawn seeds)")
    parser.add_argument("--count", type=int, default=10, help="how many seeds to draw when --seeds is not given")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "results" / "seed-sweep",
                        help="one log per seed goes here (default: %(default)s)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to sweep a few tests only")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    return args


def run_seed(seed: int, paths, keyword, log: Path):
    """One pytest run under ``ZOO_TEST_SEED=seed``; returns (exit code, [(outcome, nodeid, message)], totals)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *paths]
    if keyword:
        command += ["-k", keyword]
    env = {**os.environ, "ZOO_TEST_SEED": str(seed), "COLUMNS": "240"}  # room for the failure message
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    failures, totals = [], ""
    for line in log.read_text(errors="replace").splitlines():
        if match := OUTCOME.match(line):
            failures.append((match.group(1), match.group(2), (match.group(3) or "")[:160]))
        elif match := TOTALS.match(line):
            totals = match.group(1)
    return done.returncode, failures, totals


def main(argv=None) -> int:
    args = parse_args(argv)
    seeds = args.seeds or [int.from_bytes(os.urandom(4), "little") for _ in range(args.count)]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"seeds: {' '.join(map(str, seeds))}", flush=True)
    print(f"paths: {' '.join(args.paths)}; logs in {args.log_dir}", flush=True)
    by_test: dict[str, list[tuple[int, str]]] = {}
    broken_runs = []
    for index, seed in enumerate(seeds, 1):
        start = time.monotonic()
        code, failures, totals = run_seed(seed, args.paths, args.keyword, args.log_dir / f"seed-{seed}.log")
        print(f"[{index}/{len(seeds)}] ZOO_TEST_SEED={seed}: {totals or f'exit code {code}'} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
        for outcome, nodeid, message in failures:
            print(f"    {outcome} {nodeid} - {message}", flush=True)
            by_test.setdefault(nodeid, []).append((seed, message))
        if code not in (0, 1) or (code == 1 and not failures):
            broken_runs.append((seed, code))  # collection error, interrupt, crash: read the log
    print("\nsummary")
    print(f"  {len(seeds)} seeds: {' '.join(map(str, seeds))}")
    if not by_test and not broken_runs:
        print("  no test failed under any seed")
        return 0
    for nodeid, hits in sorted(by_test.items()):
        print(f"  {nodeid}: failed under {len(hits)}/{len(seeds)} seeds")
        for seed, message in hits:
            print(f"    ZOO_TEST_SEED={seed} python -m pytest -q '{nodeid}'   # {message}")
    for seed, code in broken_runs:
        print(f"  ZOO_TEST_SEED={seed}: pytest exited {code} without a failing test; see "
              f"{args.log_dir / f'seed-{seed}.log'}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
