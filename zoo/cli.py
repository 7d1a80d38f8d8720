"""The ``zoo`` command line: list, check, train, eval, ablate, table, claims, bench, data, generate, export.

Every command reads its recipe through :func:`zoo.recipes.resolve` (extends -> overrides -> validation,
once). Every recipe problem ends with exit code 2 and one line on stderr naming the place (file:line or
the override) and the nearest valid names; no traceback. Overrides may stand anywhere on the command
line, before or after flags. An empty ``--out`` or ``--to`` (an unset shell variable) is refused the same way,
before any work. A reader that closes standard output early (``zoo list --json | head``) ends any command
quietly with exit status 141 (128 + SIGPIPE, what a shell reports for a program that signal ends); files the
command wrote stay. A Ctrl-C ends any command in one line with exit status 130, also while it is still importing.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import sys
import zipfile
from pathlib import Path

from .errors import INTERRUPTED, UserError, interrupted_while_starting, one_line

try:  # the imports take seconds (torch, triton, matplotlib): a Ctrl-C meanwhile ends in one line too
    from tabulate import tabulate

    from kernels.backend import BackendUnavailable
    from mixers import MIXERS, STATE_MIXERS
    from mixers.options import OptionError, describe_options

    from . import doctor, generate
    from .benchmark import runner as bench
    from .config import EvalConfig, ModelConfig, RecipeConfig, TrainConfig
    from .data import prepare as data_prepare
    from .experiments import untrained, vouch
    from .experiments.ablate import CellsFailed, ablation_lock, refuse_train_into, run_ablation
    from .experiments.claims import ledger
    from .experiments.claims.errors import ClaimsError
    from .experiments.claims.schema import claimed_cells
    from .experiments.executors import make_executor
    from .experiments.preregistration import shallow_clone
    from .experiments.results import read_layout, render_folder
    from .generate import refuse_text_file
    from .paths import EXTRA_SECTIONS, probe_writable
    from .preflight import check_recipe, refuse_dead_layers, refuse_unrunnable
    from .recipes import overrides_some_cells_replace, refuse_overrides_every_cell_replaces, resolve
    from .recipes.overrides import parse_override
    from .recipes.plain import layer_label
    from .reevaluate import evaluate_checkpoint, refuse_ablation_folder
    from .rows import append_row, make_row, read_rows
    from .tasks import TASKS
    from .training import distributed
    from .training.checkpoint import path_in
    from .training.device import resolve_device
    from .training.loop import probe_folders, state_sizes, train
    from .training.stopping import Terminated
    from .training.throughput import describe as describe_throughput
except KeyboardInterrupt:
    raise interrupted_while_starting() from None


def _recipe_args(parser: argparse.ArgumentParser, examples: str = "train.lr=3e-3 model.layers.1=<mixer> "
                                                                    "model.layers.1.<mixer>.<option>=value") -> None:
    parser.add_argument("recipe", help="path to a YAML recipe")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help=f"override recipe values, e.g. {examples}")


def _resolve(args):
    """The recipe ``args.recipe`` with ``args.overrides``; a checkpoint given for the recipe (``zoo train
    run/checkpoint.pt``) is refused naming the commands that read one (only a ``.pt`` file is opened to tell: any
    other is the recipe reader's, which opens nothing over its size limit)."""
    path = Path(args.recipe)
    if path.suffix == ".pt" and path.is_file() and zipfile.is_zipfile(path):
        raise UserError(f"zoo {args.command}: {path} is a checkpoint (a zip archive), not a YAML recipe; give the "
                        f"recipe it was trained with (zoo train RECIPE --out {path.parent} resumes that run), or "
                        f"evaluate it with zoo eval {path}")
    return resolve(args.recipe, args.overrides)


def _layers(recipe) -> str:
    return "+".join(layer_label(e) for e in recipe.model.layer_entries())


def _import_listed(modules: list[str]) -> None:
    """Import the modules ``zoo list --imports`` names (out-of-tree mixers, state mixers, tasks), each failure in
    one line."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a user module may fail in any way: report it in one line
            raise UserError(f"zoo list --imports: cannot import {name!r}: {type(err).__name__}: {err}") from None


def cmd_list(args) -> int:
    _import_listed(args.imports or [])
    sections = {"recipe": RecipeConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig}
    data = {"mixers": MIXERS.describe(), "state_mixers": STATE_MIXERS.describe(), "tasks": TASKS.describe(),
            "recipe": {name: describe_options(cls) for name, cls in sections.items()}}
    data["recipe"]["recipe"] += [{"name": name, "type": kind, "default": default, "range": "", "choices": None,
                                  "help": text} for name, (kind, default, text) in EXTRA_SECTIONS.items()]
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    print("Sequence mixers (model.layers):")
    print(tabulate([[m["name"], m["description"], m["state_size"], ", ".join(m["test_time_knobs"])]
                    for m in data["mixers"]],
                   headers=["name", "description", "decode state (elements per sequence)", "test-time knobs"],
                   tablefmt="simple"))
    print("\nState mixers (model.state_mixer):")
    print(tabulate([[m["name"], m["description"]] for m in data["state_mixers"]], headers=["name", "description"],
                   tablefmt="simple"))
    print("\nTasks (task.name):")
    print(tabulate([[m["name"], m["description"]] for m in data["tasks"]], headers=["name", "description"],
                   tablefmt="simple"))
    if args.options:
        def show(title, options):
            print(f"\n{title}:")
            print(tabulate([[o["name"], o["type"], o["default"], o["range"],
                             o["help"] + (f" {o['choices']}" if o["choices"] else "")] for o in options],
                           headers=["option", "type", "default", "range", "help"], tablefmt="simple"))
        for section, options in data["recipe"].items():
            show(f"recipe section {section}" if section != "recipe" else "recipe (top level)", options)
        for kind in ("mixers", "state_mixers", "tasks"):
            for m in data[kind]:
                show(f"{m['name']} options", m["options"])
    return 0


def cmd_check(args) -> int:
    recipe = _resolve(args)
    model, task = check_recipe(recipe)
    print(f"ok: {args.recipe}: layers {_layers(recipe)}, {model.num_params():,} parameters, "
          f"state {state_sizes(model, task.seq_len)[0]:,} elements at T={task.seq_len}, task {recipe.task.name}, "
          f"recipe {recipe.key}" + (f", {len(recipe.cells)} grid cells (each checked)" if recipe.cells else ""))
    try:   # zoo train trains the base recipe with it, so it is no error here; zoo ablate refuses it
        refuse_overrides_every_cell_replaces(recipe, args.overrides)
    except UserError as err:
        print(f"note: zoo train takes it (the base recipe), but zoo ablate refuses it: {err}", file=sys.stderr)
    for note in overrides_some_cells_replace(recipe, args.overrides):
        print(f"note: {note}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    recipe = _resolve(args)
    if args.out:
        refuse_train_into(Path(args.out))
    if distributed.rank_before_joining() == 0:  # the folders the run writes, before anything is printed or built
        probe_folders(recipe, args.out, "--out")
    device = resolve_device(recipe.train.device)
    distributed.pin_local_gpu(device)            # the trial pass below runs on this rank's GPU
    refuse_unrunnable([(recipe, args.recipe)])   # before joining the process group: every rank stops in one line
    # under torchrun, rank 0 alone prints and writes; the process group's backend follows train.device
    main = distributed.context(device).is_main
    refuse_dead_layers(recipe, trains="base")
    if recipe.cells and main:
        print(f"zoo train: {args.recipe} has a grid of {len(recipe.cells)} cells; training the base recipe only "
              f"(run every cell with: zoo ablate {args.recipe})", file=sys.stderr)
    if main:
        print(f"training {_layers(recipe)} on {recipe.task.name} (seed {recipe.seed})", file=sys.stderr)
    out = Path(args.out) if args.out else None
    result = train(recipe, progress=not args.no_progress, checkpoint_dir=out)
    if not main:
        return 0
    if out is not None:
        _write_train_row(out, recipe, result)
    print(describe_throughput(result.metrics, result.metrics["steps"]), file=sys.stderr)
    _print_metrics(args, {"recipe": recipe.plain, "recipe_key": recipe.key, "metrics": result.metrics})
    return 0


def _write_train_row(out: Path, recipe, result) -> None:
    refuse_train_into(out)  # an ablation may have started there while this one trained
    path = out / "results.jsonl"
    if any(r.get("recipe_key") == recipe.key and r.get("label") == "train" for r in read_rows(path)):
        return  # a finished run resumed again: its row is there already
    append_row(path, make_row(recipe, "train", result.metrics, device=result.metrics.get("device"),
                              history=result.history, checkpoint=str(out / "checkpoint.pt")))


def _print_metrics(args, record: dict) -> None:
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        for key, value in record["metrics"].items():
            print(f"{key:>24}: {value:.4f}" if isinstance(value, float) else f"{key:>24}: {value}")


def _checkpoint_of(location: str) -> Path:
    """The checkpoint ``zoo eval`` reads at ``location``; an ablation's folder, which holds one per cell, is
    refused naming its cells' checkpoint folders."""
    path = path_in(location)
    if path.is_dir():  # a folder named like the checkpoint: read again as a run folder, its name would be doubled
        raise UserError(f"zoo eval: {path} is a folder, not a checkpoint; give a checkpoint file or the run folder "
                        f"holding it (zoo train RECIPE --out DIR writes DIR/{path.name})")
    refuse_text_file(path, "zoo eval")
    if not path.exists():
        refuse_ablation_folder(Path(location))
    return path


def cmd_eval(args) -> int:
    path = _checkpoint_of(args.checkpoint)
    out = Path(args.out) if args.out else path.parent
    probe_writable(out, "--out" if args.out else "--out (default: the checkpoint's folder)")
    with ablation_lock(out, "zoo eval"):
        row = evaluate_checkpoint(path, args.overrides)
        cells = {c["key"]: c["label"] for c in (read_layout(out) or {"cells": []})["cells"]}
        if row["trained_recipe_key"] in cells:  # name the evaluated cell of this folder's grid
            row["label"] = f"{cells[row['trained_recipe_key']]} {row['label']}"
        out.mkdir(parents=True, exist_ok=True)
        append_row(out / "results.jsonl", row)
    if not args.json:
        print(f"{row['label']}: checkpoint {path} (recipe {row['trained_recipe_key']}, step {row['metrics']['steps']}); "
              f"row appended to {out / 'results.jsonl'}", file=sys.stderr)
    if row.get("finished") is False:
        total = row["recipe"].get("train", {}).get("steps", "?")
        print(f"zoo eval: {path} is the checkpoint of an unfinished run (step {row['metrics']['steps']} of {total}): "
              f"these are the metrics of a partly trained model; run the command that trained it again to finish it",
              file=sys.stderr)
    _print_metrics(args, {k: row[k] for k in ("label", "recipe_key", "trained_recipe_key", "checkpoint", "recipe",
                                              "metrics")})
    return 0


def cmd_ablate(args) -> int:
    recipe = _resolve(args)
    seed = [o for o in args.overrides if parse_override(o)[0] == ["seed"]]
    if seed and recipe.config.seeds is not None:  # every cell runs once per seed of the list, never with this one
        raise UserError(f"override {seed[-1]!r}: {args.recipe} runs every cell with seeds: {recipe.config.seeds}, so "
                        f"no cell would run with it; give the seeds instead (e.g. seeds=[{recipe.seed}])")
    refuse_dead_layers(recipe, trains="cells")
    refuse_overrides_every_cell_replaces(recipe, args.overrides)
    for note in overrides_some_cells_replace(recipe, args.overrides):
        print(f"zoo ablate: note: {note}", file=sys.stderr)
    out = Path(args.out) if args.out else Path("results") / Path(args.recipe).stem
    title = recipe.name or Path(args.recipe).stem
    executor = make_executor(args.executor, address=args.address, cpus_per_cell=args.cpus_per_cell,
                             gpus_per_cell=args.gpus_per_cell, retries=args.retries, progress=not args.no_progress)
    try:
        run_ablation(recipe, out, title=title, progress=not args.no_progress, plot=not args.no_plot, executor=executor)
    except CellsFailed as err:
        if err.rows:
            print(f"\nresults of the finished cells: {out / 'results.jsonl'}")
        for outcome in err.failures:
            print(f"zoo: cell {outcome.cell.label!r} failed after {outcome.attempts} attempt"
                  f"{'s' * (outcome.attempts != 1)}: {outcome.error}", file=sys.stderr)
        print(f"zoo: {len(err.failures)} of {len(recipe.cells) or 1} cells failed; run the same command again "
              f"to retry only those", file=sys.stderr)
        return 1
    print(f"\nresults: {out / 'results.jsonl'} (tables: results.md, results.csv"
          + ("" if args.no_plot else "; plot: results.png") + ")")
    return 0


def cmd_table(args) -> int:
    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        hint = f"give its folder, {folder.parent}" if folder.name == "results.jsonl" else \
            "give the folder holding results.jsonl (zoo ablate RECIPE --out DIR writes DIR)"
        raise UserError(f"zoo table: {folder} is a file, not a results folder; {hint}")
    if not folder.exists():
        raise UserError(f"zoo table: {folder}: no such folder; give the folder holding results.jsonl (zoo ablate "
                        f"RECIPE --out DIR writes DIR)")
    if not (folder / "results.jsonl").is_file():
        raise UserError(f"zoo table: {folder} holds no results.jsonl; give the folder zoo ablate RECIPE --out DIR "
                        f"wrote (DIR)")

    def report(damage):
        print(f"zoo table: {damage.describe()}; not rendered (zoo ablate on this folder moves it aside and "
              f"recomputes its cell)", file=sys.stderr)
    print(render_folder(Path(args.dir), title=args.title or None, plot=not args.no_plot, report=report))
    return 0


def refuse_shallow_history(root: Path) -> None:
    """The ledger dates rows and rules by git history: in a shallow clone the rows' commits are missing, every cell
    would read as stale and every rule as post hoc, so ``zoo claims`` refuses to start there."""
    if shallow_clone(root):
        raise UserError("zoo claims: this is a shallow clone (git clone --depth): the commits the rows were computed "
                        "at are not in its history, so every cell would read as stale; run git fetch --unshallow "
                        "first")


def cmd_claims(args) -> int:
    notes: list[str] = []
    try:
        refuse_shallow_history(Path(args.root))
        for table in (args.vouch or []) + (args.untrained or []):
            claimed_cells(args.root, table)  # a table claims.yaml does not list is refused, never skipped
        if args.vouch:
            vouched = vouch.vouch(Path(args.root), args.vouch)
            for table in args.vouch:
                for label, outcome in vouched.get(table, {}).items():
                    print(f"tables/{table} {label!r}: {outcome}")
                if not vouched.get(table):
                    print(f"tables/{table}: no cell to vouch for (every row's code is the checkout's, or vouched for "
                          f"already)")
        for table in args.untrained or []:
            labels = claimed_cells(args.root, table)
            print(f"step 0 of tables/{table} ({len(labels)} cells the ledger reads) ...")
            print(f"wrote {untrained.write(Path(args.root), table, labels)}")
        if args.check:
            problems = ledger.check(args.root, notes)
            for line in notes:
                print(f"zoo claims: flagged: {line}", file=sys.stderr)
            for problem in problems:
                print(f"zoo claims: {problem}", file=sys.stderr)
            if not problems:
                print("zoo claims: CLAIMS.md, tables/README.md and every table's results.md and results.csv match "
                      "the committed results")
            return 1 if problems else 0
        for rel in ledger.write(args.root, notes):
            print(f"wrote {Path(args.root) / rel}")
        for line in notes:
            print(f"flagged: {line}")
    except ClaimsError as err:
        print(f"zoo: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args) -> int:
    from zoo.hf import export  # the hf extra, imported only here: without it, one line naming it
    return export.run(args)


def cmd_bench(args) -> int:
    return bench.run(args)


def cmd_data(args) -> int:
    recipe = _resolve(args)
    if recipe.task.name != "lm":
        raise UserError(f"zoo data prepare: {args.recipe} trains task {recipe.task.name!r}, which generates its data; "
                        f"only task: lm has data to prepare")
    where, wrote = data_prepare.prepare(recipe.task.options, workers=args.workers, progress=not args.no_progress)
    meta = data_prepare.read_meta(where, recipe.task.options)
    print(f"{'prepared' if wrote else 'already prepared'}: {where} ({meta['tokens']['train']:,} train and "
          f"{meta['tokens']['val']:,} validation tokens, vocabulary {meta['vocab_size']}, source hash "
          f"{str(meta.get('source_hash', ''))[:16]})")
    return 0


def _add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="language-model data: zoo data prepare RECIPE tokenises its source once")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("prepare", help="tokenise the recipe's text source into token files (resumable)")
    _recipe_args(p, "task.path=notes/*.txt task.tokenizer=tok.json task.data_dir=/data/zoo")
    p.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="tokenising processes (the output does not depend on it; default: the CPUs, at most 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data)


def _claims_parser(sub) -> None:
    p = sub.add_parser("claims", help="regenerate CLAIMS.md (the claims ledger) and tables/README.md from claims.yaml "
                                      "and the committed tables/*/results.jsonl")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming the difference if the committed files are stale")
    p.add_argument("--root", default=".", help="the repository root (default: the current folder)")
    p.add_argument("--untrained", nargs="+", metavar="TABLE",
                   help="first evaluate the untrained models of the cells the ledger reads in these tables (rows "
                        "made before rows recorded it) into tables/<TABLE>/untrained.json")
    p.add_argument("--vouch", nargs="+", metavar="TABLE",
                   help="first check whether the code changes since the rows of these tables' stale cells keep their "
                        "numbers (the untrained models at the rows' commit and now) and record it in "
                        "tables/<TABLE>/code_changes.json")
    p.set_defaults(func=cmd_claims)


def _add_list_parser(sub) -> None:
    p = sub.add_parser("list", help="show the registered mixers, state mixers and tasks")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--options", action="store_true", help="also list every option, with types, defaults and ranges")
    p.add_argument("--imports", nargs="*", metavar="MODULE",
                   help="modules to import first, so that their out-of-tree mixers, state mixers and tasks are listed")
    p.set_defaults(func=cmd_list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zoo", description="mixer-zoo: compose, train and compare sequence mixers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every command takes key.path=value overrides after the recipe, before or after flags.\n"
               "Several processes: torchrun --nproc_per_node N -m zoo train RECIPE --out DIR (DDP; rank 0 writes).\n"
               "Many cells: zoo ablate RECIPE --executor ray [--address auto] (pip install -e \".[ray]\").\n"
               "Every option of recipes, mixers, state mixers and tasks, with ranges: zoo list --options.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_list_parser(sub)
    p = sub.add_parser("check", help="validate a recipe (and every cell of its grid) without running it")
    _recipe_args(p)
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("train", help="train one recipe (the base recipe of a grid) and report test accuracy")
    _recipe_args(p)
    p.add_argument("--json", action="store_true", help="print only the resolved recipe and metrics, as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", help="folder for checkpoints (train.checkpoint_every) and a results.jsonl row; "
                                 "a run finding a checkpoint of the same recipe there resumes from it")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("eval", help="evaluate a checkpoint again (other lengths, test-time knobs, test data) "
                                    "without retraining")
    p.add_argument("checkpoint", help="a checkpoint file or the folder holding checkpoint.pt")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="evaluation overrides, e.g. eval.seq_lens=[64,128] eval.test_time={<knob>: 5} "
                        "task.num_test=2000 seed=7 model.mixer_options.gla.backend=torch (other model.* and training "
                        "options are refused)")
    p.add_argument("--out", help="folder whose results.jsonl gets the row (default: the checkpoint's folder)")
    p.add_argument("--json", action="store_true", help="print only the row's recipe and metrics, as JSON")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("ablate", help="run a recipe's grid, resumable, and render its table")
    _recipe_args(p)
    p.add_argument("--out", help="output folder (default: results/<the recipe file's name without .yaml>, e.g. "
                                 "results/quickstart)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot (a results.png there is left as it is)")
    p.add_argument("--executor", choices=("sequential", "ray"), default="sequential",
                   help="sequential: cells one after another in this process (default); ray: cells as Ray tasks "
                        "(needs pip install -e \".[ray]\"), results still written by this process only")
    p.add_argument("--address", default=None,
                   help="Ray cluster to use (auto, or ray://host:10001); default: start a local Ray with this "
                        "machine's CPUs")
    p.add_argument("--cpus-per-cell", type=float, default=None,
                   help="CPUs a Ray task asks for (default: the recipe's train.threads, at least 1)")
    p.add_argument("--gpus-per-cell", type=float, default=None,
                   help="GPUs a Ray task asks for (default: 1 if the recipe's train.device is cuda, or auto on a "
                        "cluster with GPUs; else 0)")
    p.add_argument("--retries", type=int, default=None,
                   help="attempts after the first for a cell that fails (worker lost or error raised); "
                        "default 2 with ray, 0 sequential")
    p.set_defaults(func=cmd_ablate)
    p = sub.add_parser("table", help="re-render results.md/csv/png from an ablation's results.jsonl")
    p.add_argument("dir", help="the ablation's output folder")
    p.add_argument("--title", default="", help="the tables' title (default: the grid's recorded title, else the "
                                                "recipe's name, else the folder's name)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot (results.png is left as it is)")
    p.set_defaults(func=cmd_table)
    _claims_parser(sub)
    _add_data_parser(sub)
    p = sub.add_parser("generate", help="continue a prompt with a trained language model (prefill, then step)")
    generate.configure_parser(p)
    p.set_defaults(func=generate.run)
    p = sub.add_parser("export", help="write a trained language model as a Hugging Face transformers folder "
                                      "(pip install 'mixer-zoo[hf]')")
    p.add_argument("checkpoint", help="a language-model checkpoint: file or the folder holding checkpoint.pt")
    p.add_argument("--to", required=True, help="the folder to write (new, or empty)")
    p.add_argument("--imports", nargs="*", help="modules defining out-of-tree components the checkpoint uses")
    p.add_argument("--test-time", action="append", metavar="KNOB=VALUE",
                   help="a test-time knob's value over the recipe's eval.test_time, which the exported config "
                        "stores by default (repeat for several knobs; e.g. --test-time num_iter=10)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("bench", help="time mixers: forward, forward+backward, memory, decode")
    bench.configure_parser(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("doctor", help="this machine: device, missing extras, and the backend every mixer's auto picks")
    p.add_argument("--markdown", metavar="FILE", help="also write the report into FILE's zoo-doctor block")
    p.set_defaults(func=doctor.run)
    return parser


#: the exit status of a command whose standard output is closed before it has written everything (``zoo list |
#: head``): 128 + SIGPIPE, what a shell reports for a program that signal ends, so ``set -o pipefail`` still sees it
CLOSED_STDOUT = 141


def main(argv: list[str] | None = None) -> int:
    """The ``zoo`` command; returns its exit status. A reader that closes standard output early ends any command
    quietly with :data:`CLOSED_STDOUT` (no traceback; what the command wrote to files stays)."""
    try:
        try:
            return _main(argv)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's last flush
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        _stdout_to_devnull()
        return CLOSED_STDOUT


def _stdout_closed() -> bool:
    """Whether the reader of standard output has gone (a pipe or socket whose other end is closed)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is not a file: cannot tell, so closed
        return True


def _stdout_to_devnull() -> None:
    """Point standard output at the null device, so that what is still buffered for it goes nowhere, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout is not a file (replaced in-process): nothing to flush
        pass


def _refuse_empty_folders(args) -> None:
    """An empty ``--out`` or ``--to`` (an unset shell variable) is refused: read as no folder, it would lose the
    results."""
    for flag in ("out", "to"):
        if getattr(args, flag, None) == "":
            raise UserError(f"zoo {args.command}: --{flag} is empty (an unset shell variable?); name the folder to "
                            f"write")


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow flags (`zoo train R --no-progress train.steps=10`): argparse leaves those over
    stray = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        _refuse_empty_folders(args)
        return args.func(args) or 0
    except (UserError, OptionError, BackendUnavailable) as err:
        # one write: print's two (the text, then the newline) interleave with another process's on a shared
        # stderr (every torchrun rank refusing at once)
        sys.stderr.write(f"zoo: error: {one_line(str(err))}\n")
        return 2
    except KeyboardInterrupt as stop:  # a Ctrl-C, or a scheduler's SIGTERM during a run (zoo.training.stopping)
        again = ("; run the same command again to resume (finished cells and checkpoints are kept)"
                 if getattr(args, "command", None) in ("ablate", "train") else "")
        terminated = isinstance(stop, Terminated)
        print(f"zoo: {'stopped by SIGTERM' if terminated else 'interrupted'}{again}", file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
