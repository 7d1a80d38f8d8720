"""The ``zoo`` command line: list, check, train, ablate, table, bench.

Every recipe problem ends with exit code 2 and one line on stderr naming the place (file:line or the
override) and the nearest valid names; no traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .recipes import RecipeError, load_raw, load_recipe


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="path to a YAML recipe")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="override recipe values, e.g. train.lr=3e-3 model.layers.1=attention")


def cmd_list(args) -> int:
    from mixers import MIXERS, STATE_MIXERS
    from .tasks import TASKS
    data = {"mixers": MIXERS.describe(), "state_mixers": STATE_MIXERS.describe(), "tasks": TASKS.describe()}
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    from tabulate import tabulate
    print("Sequence mixers (model.layers):")
    print(tabulate([[m["name"], m["description"], m["state_size"]] for m in data["mixers"]],
                   headers=["name", "description", "decode state (elements per sequence)"], tablefmt="simple"))
    print("\nState mixers (model.state_mixer):")
    print(tabulate([[m["name"], m["description"]] for m in data["state_mixers"]], headers=["name", "description"], tablefmt="simple"))
    print("\nTasks (task.name):")
    print(tabulate([[m["name"], m["description"]] for m in data["tasks"]], headers=["name", "description"], tablefmt="simple"))
    if args.options:
        for kind in ("mixers", "state_mixers", "tasks"):
            for m in data[kind]:
                print(f"\n{m['name']} options:")
                print(tabulate([[o["name"], o["type"], o["default"], o["help"] + (f" {o['choices']}" if o["choices"] else "")]
                                for o in m["options"]], headers=["option", "type", "default", "help"], tablefmt="simple"))
    return 0


def cmd_check(args) -> int:
    from .ablate import plan
    recipe, plain = load_recipe(args.recipe, args.overrides)
    cells = 1
    if recipe.grid is not None:
        base, _ = load_raw(args.recipe)
        from .recipes import apply_override, _parse_override
        for text in args.overrides:
            apply_override(base, *_parse_override(text), label=f"override {text!r}")
        base.pop("grid", None)
        cells = len(plan(base, recipe.grid))
    from .model import HybridLM
    from .train import build_task
    task = build_task(recipe)
    model = HybridLM(recipe.model, task.vocab_size)
    print(f"ok: {args.recipe}: layers {'+'.join(plain['model']['layers'])}, {model.num_params():,} parameters, "
          f"state {model.state_size(task.seq_len):,} elements at T={task.seq_len}, task {plain['task']['name']}"
          + (f", {cells} grid cells" if recipe.grid is not None else ""))
    return 0


def cmd_train(args) -> int:
    from .train import train
    recipe, plain = load_recipe(args.recipe, args.overrides)
    print(f"training {'+'.join(plain['model']['layers'])} on {plain['task']['name']} (seed {recipe.seed})")
    result = train(recipe, progress=not args.no_progress)
    if args.json:
        print(json.dumps({"recipe": plain, "metrics": result.metrics}, indent=2))
    else:
        for key, value in result.metrics.items():
            print(f"{key:>24}: {value:.4f}" if isinstance(value, float) else f"{key:>24}: {value}")
    return 0


def _ablation_base(args) -> tuple[dict, str]:
    recipe, _ = load_recipe(args.recipe, args.overrides)  # validates the base and the overrides
    base, _ = load_raw(args.recipe)
    from .recipes import apply_override, _parse_override
    for text in args.overrides:
        apply_override(base, *_parse_override(text), label=f"override {text!r}")
    return base, recipe.name or Path(args.recipe).stem


def cmd_ablate(args) -> int:
    from .ablate import run_ablation
    base, title = _ablation_base(args)
    out = Path(args.out) if args.out else Path("results") / Path(args.recipe).stem
    run_ablation(base, out, title=title, progress=not args.no_progress, plot=not args.no_plot)
    print(f"\nresults: {out / 'results.jsonl'} (tables: results.md, results.csv; plot: results.png)")
    return 0


def cmd_table(args) -> int:
    from .results import read_rows, render
    out = Path(args.dir)
    rows = read_rows(out / "results.jsonl")
    if not rows:
        raise RecipeError(f"{out / 'results.jsonl'}: no finished cells to render")
    print(render(rows, out, title=args.title or out.name, plot=not args.no_plot))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description="mixer-zoo: compose, train and compare sequence mixers")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="show the registered mixers, state mixers and tasks")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--options", action="store_true", help="also list every option")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("check", help="validate a recipe (and its grid) without running it")
    _recipe_args(p)
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("train", help="train one recipe and report test accuracy")
    _recipe_args(p)
    p.add_argument("--json", action="store_true", help="print the resolved recipe and metrics as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("ablate", help="run a recipe's grid, resumable, and render its table")
    _recipe_args(p)
    p.add_argument("--out", help="output folder (default results/<recipe name>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.set_defaults(func=cmd_ablate)
    p = sub.add_parser("table", help="re-render results.md/csv/png from an ablation's results.jsonl")
    p.add_argument("dir", help="the ablation's output folder")
    p.add_argument("--title", default="")
    p.add_argument("--no-plot", action="store_true")
    p.set_defaults(func=cmd_table)
    try:
        from . import bench
    except ImportError:
        bench = None
    if bench is not None and hasattr(bench, "configure_parser"):
        p = sub.add_parser("bench", help="time mixers: forward, forward+backward, memory, decode")
        bench.configure_parser(p)
        p.set_defaults(func=bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except RecipeError as err:
        print(f"zoo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zoo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
