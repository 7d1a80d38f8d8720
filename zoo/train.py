"""Training and evaluation of one recipe: AdamW, linear warm-up then cosine decay, gradient clipping.

Precision (``train.precision``): ``auto`` keeps fp32 on a CPU and bf16 autocast on CUDA; ``fp32``,
``bf16`` and ``fp16`` (autocast plus a gradient scaler) choose explicitly. ``train.compile`` runs the
training forward through ``torch.compile`` (evaluation stays eager). The same seed gives the same
numbers on re-run on a CPU: the model init, the data and the batch order all derive from
``recipe.seed``.

With a checkpoint folder (``train(..., checkpoint_dir=DIR)``, ``zoo train RECIPE --out DIR``) the run
saves :mod:`zoo.checkpoint` checkpoints every ``train.checkpoint_every`` steps and at the end, and a
run that finds a checkpoint of the same recipe there resumes from it. Everything that shapes the
trajectory is restored (weights, optimizer, schedule position, gradient scaler, data order, RNG
states, history, the running averages shown as ``train_loss`` / ``train_accuracy``), so on a CPU a
resumed run ends with exactly the numbers of an uninterrupted one.

Under ``torchrun`` (see :mod:`zoo.distributed`) the model is wrapped in DistributedDataParallel and
each rank trains on its shard of the global batch; rank 0 alone prints, tracks and checkpoints.

When stderr is not a terminal, progress is a plain line (step, loss, accuracy, elapsed) at least every
``PLAIN_PROGRESS_SECONDS`` and at every periodic evaluation, so piped runs never sit silent.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed
from .config import Recipe
from .eval_tasks import eval_task_metrics
from .model import HybridLM
from .recipes import RecipeError
from .tasks import TASKS, Task, TaskData

PLAIN_PROGRESS_SECONDS = 30.0


def build_task(recipe: Recipe) -> Task:
    return TASKS.get(recipe.task.name)(recipe.task.options)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available; use train.device=cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def _param_groups(model: torch.nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, recipe: Recipe) -> float:
    t = recipe.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _autocast(device: torch.device, precision: str = "auto"):
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _forward_loss(model: HybridLM, batch: TaskData, device, precision: str = "auto",
                  reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, hits, supervised)``: cross-entropy over supervised positions (mean or sum), and
    per-position boolean tensors of correct predictions and of supervised positions."""
    with _autocast(device, precision):
        logits = model(batch.inputs, mask=batch.mask)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100, reduction=reduction)
    supervised = batch.labels != -100
    return loss, (logits.argmax(-1) == batch.labels) & supervised, supervised


def loss_and_accuracy(model: HybridLM, batch: TaskData, device, precision: str = "auto") -> tuple[torch.Tensor, int, int]:
    loss, hits, supervised = _forward_loss(model, batch, device, precision)
    return loss, hits.sum().item(), supervised.sum().item()


@torch.no_grad()
def evaluate(model: HybridLM, data: TaskData, batch_size: int, device, precision: str = "auto") -> dict:
    was_training = model.training
    model.eval()
    total_loss, correct, count, exact = 0.0, 0, 0, 0
    for start in range(0, len(data), batch_size):
        batch = data.batch(torch.arange(start, min(start + batch_size, len(data)))).to(device)
        loss, hits, supervised = _forward_loss(model, batch, device, precision)
        n = supervised.sum().item()
        total_loss += loss.item() * n
        correct, count = correct + hits.sum().item(), count + n
        exact += (hits == supervised).all(dim=1).sum().item()  # every supervised position right
    model.train(was_training)
    loss = total_loss / max(count, 1)
    if not math.isfinite(loss):
        # a diverged model: the argmax of NaN logits is no prediction, so its accuracy is not a number
        return {"loss": loss, "accuracy": float("nan"), "sequence_accuracy": float("nan")}
    return {"loss": loss, "accuracy": correct / max(count, 1), "sequence_accuracy": exact / max(len(data), 1)}


def test_metrics(model: HybridLM, recipe: Recipe, task: Task, device, precision: str = "auto") -> dict:
    """The end-of-run evaluation of a trained model (what ``zoo eval`` recomputes from a checkpoint):
    test loss/accuracy under ``eval.test_time``, each ``eval.seq_lens`` length, each value of
    ``eval.test_time_sweep``, each ``eval.tasks`` entry (:mod:`zoo.eval_tasks`), and the model's size
    and state."""
    metrics = {}
    bs = recipe.eval.batch_size
    test_data = task.make("test", recipe.seed)
    with model.test_time(recipe.eval.test_time):
        ev = evaluate(model, test_data, bs, device, precision)
        metrics.update({"test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                        "test_sequence_accuracy": ev["sequence_accuracy"]})
        for seq_len in recipe.eval.seq_lens:
            ev = evaluate(model, task.make("test", recipe.seed, seq_len=seq_len), bs, device, precision)
            metrics[f"test_accuracy@{seq_len}"] = ev["accuracy"]
            metrics[f"test_sequence_accuracy@{seq_len}"] = ev["sequence_accuracy"]
    # one trained model, evaluated at each value of a test-time knob; cells of a grid whose mixers do
    # not declare the knob leave these columns empty
    for knob, values in recipe.eval.test_time_sweep.items():
        if knob not in model.test_time_knobs():
            continue
        for value in values:
            with model.test_time({**recipe.eval.test_time, knob: value}):
                metrics[f"test_accuracy@{knob}={value}"] = evaluate(model, test_data, bs, device, precision)["accuracy"]
    metrics.update(eval_task_metrics(model, recipe, device, precision))
    metrics["params"] = model.num_params()
    metrics["state_size"] = model.state_size(task.seq_len)
    metrics["active_state_size"] = model.active_state_size(task.seq_len)
    return metrics


@dataclass
class TrainResult:
    metrics: dict
    model: HybridLM = field(repr=False)
    history: list = field(default_factory=list, repr=False)
    recipe: Recipe | None = field(default=None, repr=False)


class _Forward:
    """The training forward: eager, DDP-wrapped and/or compiled; a compile that fails on the first
    call falls back to eager with a warning."""

    def __init__(self, model, ctx: distributed.DistContext, device, compile: bool):
        self.eager = model
        if ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel
            self.eager = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.net = self.eager
        self.compiled = compile
        if compile:
            try:
                self.net = torch.compile(self.eager)
            except Exception as err:  # noqa: BLE001 - any backend failure means: run eagerly
                self._fall_back(err)

    def _fall_back(self, err):
        warnings.warn(f"train.compile=true: torch.compile is unavailable here ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); training eagerly", stacklevel=3)
        self.net, self.compiled = self.eager, False

    def __call__(self, inputs, mask=None):
        if not self.compiled:
            return self.net(inputs, mask=mask)
        try:
            out = self.net(inputs, mask=mask)
        except Exception as err:  # noqa: BLE001
            self._fall_back(err)
            return self.net(inputs, mask=mask)
        self.compiled = False  # compiled and working: no more guarding
        return out


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(recipe: Recipe, progress: bool = True, description: str = "",
          checkpoint_dir: str | Path | None = None) -> TrainResult:
    """Train ``recipe`` and evaluate it; with ``checkpoint_dir``, checkpoint there and resume from
    a checkpoint of the same recipe found there (a different recipe's checkpoint is refused)."""
    t = recipe.train
    ctx = distributed.context()
    device = distributed.device_for(ctx, resolve_device(t.device))
    if t.threads:
        torch.set_num_threads(t.threads)
    try:
        distributed.shard_size(t.batch_size, ctx.world_size)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    precision = resolve_precision(t.precision, device)
    main = ctx.is_main
    checkpoint_path = Path(checkpoint_dir) / ckpt.FILENAME if checkpoint_dir is not None else None

    task = build_task(recipe)
    train_data = task.make("train", recipe.seed)
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size).to(device)
    optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, recipe))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    order = torch.Generator().manual_seed(recipe.seed + 12345)
    perm, cursor = torch.randperm(len(train_data), generator=order), 0
    history: list = []
    step, elapsed, finished = 0, 0.0, False
    loss_ema = acc_ema = None

    if checkpoint_path is not None and checkpoint_path.exists():
        state = ckpt.load(checkpoint_path)
        ckpt.check_same_recipe(state, recipe, checkpoint_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        perm, cursor = state["order"]["perm"], state["order"]["cursor"]
        order.set_state(state["order"]["generator"])
        ckpt.set_rng_state(state["rng"])
        history, loss_ema, acc_ema = state["history"], state["loss_ema"], state["acc_ema"]
        step, elapsed, finished = state["step"], state["elapsed"], state["finished"]
        if main:
            _say(f"resuming from {checkpoint_path} at step {step}/{t.steps}" + (" (finished)" if finished else ""))

    def state_dict() -> dict:
        return {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": ckpt.imports_for(recipe),
                "step": step, "finished": finished, "world_size": ctx.world_size,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "order": {"perm": perm, "cursor": cursor, "generator": order.get_state()},
                "rng": ckpt.rng_state(), "history": history, "loss_ema": loss_ema, "acc_ema": acc_ema,
                "elapsed": elapsed + time.perf_counter() - start}

    from .tracking import make_tracker  # tracking packages load only when asked for
    tracker = make_tracker(recipe, checkpoint_dir, resume_step=step) if main else None
    forward = _Forward(model, ctx, device, t.compile)
    test_data = task.make("test", recipe.seed)
    start = time.perf_counter()
    show = progress and main
    bar = tqdm(total=t.steps, initial=step, desc=description or "train", disable=None if show else True,
               dynamic_ncols=True, leave=False)  # None: off when not a terminal
    plain = show and bar.disable
    last_line = time.perf_counter()
    shard = ctx.shard(t.batch_size)
    model.train()
    try:
        while step < t.steps and not finished:
            if cursor + t.batch_size > len(perm):
                perm, cursor = torch.randperm(len(train_data), generator=order), 0
            batch = train_data.batch(perm[cursor: cursor + t.batch_size][shard]).to(device)
            cursor += t.batch_size
            loss_sum, hits, supervised = _forward_loss(forward, batch, device, precision, reduction="sum")
            # one reduction gives the global token count (the loss's denominator) and the shown metrics
            total, count, correct = ctx.all_sum([loss_sum.item(), supervised.sum().item(), hits.sum().item()], device)
            loss = loss_sum * (ctx.world_size / max(count, 1))  # DDP averages: x world size = full-batch mean
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if t.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            loss_value, acc = total / max(count, 1), correct / max(count, 1)
            loss_ema = loss_value if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_value
            acc_ema = acc if acc_ema is None else 0.95 * acc_ema + 0.05 * acc
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{acc_ema:.3f}")
            if tracker is not None:
                tracker.log(step, {"train/loss": loss_value, "train/accuracy": acc, "train/loss_ema": loss_ema,
                                   "train/lr": scheduler.get_last_lr()[0]})
            evaluated = bool(t.eval_every) and step % t.eval_every == 0 and step < t.steps
            if evaluated:
                ev = evaluate(model, test_data, recipe.eval.batch_size, device, precision)
                history.append({"step": step, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"]})
                if tracker is not None:
                    tracker.log(step, {"test/loss": ev["loss"], "test/accuracy": ev["accuracy"]})
                if t.early_stop_acc and ev["accuracy"] >= t.early_stop_acc:
                    finished = True
            now = time.perf_counter()
            if plain and (evaluated or now - last_line >= PLAIN_PROGRESS_SECONDS):
                test = f" test_acc {history[-1]['test_accuracy']:.3f}" if evaluated else ""
                _say(f"{description or 'train'}: step {step}/{t.steps} loss {loss_ema:.4f} acc {acc_ema:.3f}{test} "
                     f"elapsed {elapsed + now - start:.0f}s")
                last_line = now
            if (checkpoint_path is not None and main and t.checkpoint_every and step % t.checkpoint_every == 0
                    and step < t.steps and not finished):
                ckpt.save(checkpoint_path, state_dict())
        finished = True
    finally:
        bar.close()
    train_seconds = elapsed + time.perf_counter() - start
    metrics = {"steps": step, "train_loss": loss_ema, "train_accuracy": acc_ema, "train_seconds": train_seconds}
    metrics.update(test_metrics(model, recipe, task, device, precision))
    metrics["device"] = str(device)
    metrics["wall_seconds"] = time.perf_counter() - start
    if tracker is not None:
        tracker.log(step, {f"final/{k}": v for k, v in metrics.items() if k.startswith("test_")})
        tracker.close()
    if checkpoint_path is not None and main:
        ckpt.save(checkpoint_path, {**state_dict(), "elapsed": train_seconds, "metrics": metrics})
    return TrainResult(metrics, model, history, recipe)
