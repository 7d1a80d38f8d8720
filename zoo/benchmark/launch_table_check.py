"""Check the launch tables without a GPU: every entry still matches a launch of the layer it was measured on,
and that launch compiles with the entry's options for the table's architecture.

``python -m zoo.benchmark.launch_table_check [--table-dir DIR] [--json FILE]``

A launch table (:mod:`kernels.launch_table`) is keyed by a kernel's exact configuration. When a launcher
changes its blocks or flags, the entries measured for the old configuration match no launch any more: they do
no harm, but they no longer say what runs. Each entry's ``measured`` names its layer (mixer, T, d_model, head
dim, dtype); that layer's forward+backward is recorded on ``meta`` tensors under the GPU plan with our Triton
backend (the layer :mod:`.launch_tune` measured), the entry must match one of its launches, and that launch with
the entry's options must pass :func:`.compile_check.compile_launch` for the table's architecture (it compiles,
fits the block's shared memory, and keeps the tensor-core and precision rules). The test-suite runs it on the
committed tables. Exit status 1 when an entry fails. Run without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from kernels import launch_table
from kernels.ahead import dry_forward_backward
from kernels.backend import meta_takes_triton
from kernels.device import gpu_path_on_cpu
from kernels.launch import Launch, recording

from .compile_check import compile_launch, interpreting_refused, table_rows
from .gpu_speed import DTYPES, FULL, build_layer


def layer_launches(measured: dict) -> list[Launch]:
    """The launches of one forward+backward of the layer an entry's ``measured`` names (see the module docstring)."""
    plan = dataclasses.replace(FULL, d_model=int(measured["d_model"]), head_dim=int(measured["head_dim"]))
    dtype = DTYPES[measured["dtype"]]
    layer = build_layer(measured["mixer"], plan, "meta", dtype)
    x = torch.empty(1, int(measured["T"]), plan.d_model, device="meta", dtype=dtype)
    with meta_takes_triton(), gpu_path_on_cpu(), recording() as launches:
        dry_forward_backward(layer, x)
    return list(launches)


def _describe(entry: dict) -> str:
    consts = ", ".join(f"{k}={v}" for k, v in sorted(entry["constexprs"].items()))
    return f"{entry['kernel']} ({'16-bit' if entry['sixteen_bit'] else 'fp32'} tensors; {consts})"


def check_table(path: Path) -> tuple[list, list[str]]:
    """``(compile results, problems)`` of one table file."""
    table = launch_table.read(path)
    arch, directory = table["arch"], str(path.parent)
    results, problems, recorded = [], [], {}
    for entry in table["entries"]:
        measured = entry["measured"]
        layer = tuple(measured[k] for k in ("mixer", "T", "d_model", "head_dim", "dtype"))
        if layer not in recorded:
            try:
                recorded[layer] = layer_launches(measured)
            except Exception as err:  # noqa: BLE001 - a layer that cannot be built any more is this entry's problem
                recorded[layer] = err
        launches = recorded[layer]
        if isinstance(launches, Exception):
            problems.append(f"{path}: {_describe(entry)}: its layer {layer} cannot be recorded "
                            f"({type(launches).__name__}: {launches})")
            continue
        want = launch_table.entry_key(entry)
        match = [r for r in launches if (r.name,) + launch_table.config_key(*r.config()) == want]
        if not match:
            problems.append(f"{path}: {_describe(entry)} matches no launch of the {measured['mixer']} layer any more "
                            f"(its launcher changed since {measured['commit']}): measure it again with python -m "
                            f"zoo.benchmark.launch_tune {measured['mixer']} --write-table on a GPU of sm_{arch}, or "
                            "delete the entry")
            continue
        tuned = match[0].on_arch(arch, directory)
        if (tuned.num_warps, tuned.num_stages) != (entry["num_warps"], entry["num_stages"]):
            problems.append(f"{path}: {_describe(entry)}: the table's options are not applied to its launch")
            continue
        result = compile_launch(tuned, arch)
        results.append(result)
        if not result.ok:
            problems.append(f"{path}: {_describe(entry)} with num_warps={entry['num_warps']} "
                            f"num_stages={entry['num_stages']} fails for sm_{arch}: {table_rows([result])[0][-1]}")
    return results, problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.benchmark.launch_table_check", description=__doc__.splitlines()[0])
    p.add_argument("--table-dir", metavar="DIR", help="the tables' folder (default kernels/launch_tables)")
    p.add_argument("--json", metavar="FILE", help="write the entries checked and the problems to FILE")
    args = p.parse_args(argv)
    if interpreting_refused("launch_table_check"):
        return 2
    folder = Path(args.table_dir) if args.table_dir else launch_table.TABLE_DIR
    checked, problems = 0, []
    for path in sorted(folder.glob("sm_*.json")):
        try:
            results, found = check_table(path)
        except launch_table.LaunchTableError as err:
            results, found = [], [str(err)]
        checked += len(results)
        problems += found
        for r in results:
            print(f"{path.name}: {r.launch.name} w={r.launch.num_warps} s={r.launch.num_stages}: "
                  f"{'ok' if r.ok else 'FAIL'}", file=sys.stderr)
    for line in problems:
        print(line, file=sys.stderr)
    print(f"launch_table_check: {checked} entries compiled, {len(problems)} problems", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"compiled": checked, "problems": problems}, indent=1) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
