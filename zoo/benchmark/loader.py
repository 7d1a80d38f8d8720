"""Is data loading ever the bottleneck? The training stream's throughput next to training's, in one run.

``python -m zoo.benchmark.loader RECIPE [key.path=value ...] [--seconds S] [--steps N]`` draws the recipe's
training batches (``train.batch_size`` windows of ``task.seq_len`` tokens from the memory-mapped token
file, exactly as the trainer draws them) for about ``S`` seconds, then times ``N`` optimizer steps of the
recipe's model on such batches (after one untimed step; drawing the batch is part of a step), and prints
both rates in tokens per second and their ratio. A text task only (``lm``): the synthetic tasks generate
their whole data set up front.
"""
from __future__ import annotations

import argparse
import time

import torch

from ..errors import UserError
from ..model import HybridLM
from ..recipes import resolve
from ..tasks import Task
from ..tasks.text import TextTask, training_data
from ..training.optim import make_optimizer
from .train_rate import lm_step, steady_rate


def loader_tokens_per_second(task: TextTask, seed: int, batch_size: int, seconds: float) -> float:
    """Tokens per second the training stream serves, drawing batches for about ``seconds``."""
    stream = training_data(task, seed)
    generator = torch.Generator().manual_seed(seed)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += stream.draw(batch_size, generator).inputs.numel()
    return tokens / (time.perf_counter() - start)


def training_tokens_per_second(recipe, task: TextTask, steps: int) -> float:
    """Tokens per second of training steps on the stream's batches, drawing included (after one warm-up step)."""
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size)
    optimizer, _ = make_optimizer(model, recipe)
    stream, generator = training_data(task, recipe.seed), torch.Generator().manual_seed(recipe.seed)

    def step():
        batch = stream.draw(recipe.train.batch_size, generator)
        lm_step(model, optimizer, batch.inputs, batch.labels)

    tokens = recipe.train.batch_size * task.seq_len
    return steady_rate(step, tokens, torch.device("cpu"), warmup=1, steps=steps).tokens_per_second


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.benchmark.loader", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to draw batches (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (default 10)")
    args = parser.parse_args(argv)
    try:
        recipe = resolve(args.recipe, args.overrides)
        task = Task.from_spec(recipe.task)
        if not isinstance(task, TextTask):
            raise UserError(f"{args.recipe}: task {recipe.task.name!r} generates its data up front; the loader "
                            f"benchmark needs a text task (task.name: lm)")
        if recipe.train.threads:
            torch.set_num_threads(recipe.train.threads)
        serve = loader_tokens_per_second(task, recipe.seed, recipe.train.batch_size, args.seconds)
        train = training_tokens_per_second(recipe, task, args.steps)
    except UserError as err:
        parser.exit(2, f"zoo.benchmark.loader: error: {err}\n")
    shape = f"batch {recipe.train.batch_size} x {task.seq_len} tokens, {torch.get_num_threads()} thread(s)"
    print(f"{args.recipe} ({shape}): loader {serve:,.0f} tokens/s, training {train:,.0f} tokens/s, "
          f"loader / training {serve / train:,.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
