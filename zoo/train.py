"""Training and evaluation of one recipe: AdamW, linear warm-up then cosine decay, gradient clipping.

fp32 on CPU, bf16 autocast on CUDA. The same seed gives the same numbers on re-run on a CPU (the
model init, the data and the batch order all derive from ``recipe.seed``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import Recipe
from .model import HybridLM
from .tasks import TASKS, Task, TaskData


def build_task(recipe: Recipe) -> Task:
    return TASKS.get(recipe.task.name)(recipe.task.options)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available; use train.device=cpu")
    return torch.device(name)


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


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _forward_loss(model: HybridLM, batch: TaskData, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, hits, supervised)``: mean cross-entropy over supervised positions, and per-position
    boolean tensors of correct predictions and of supervised positions."""
    with _autocast(device):
        logits = model(batch.inputs, mask=batch.mask)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    supervised = batch.labels != -100
    return loss, (logits.argmax(-1) == batch.labels) & supervised, supervised


def loss_and_accuracy(model: HybridLM, batch: TaskData, device) -> tuple[torch.Tensor, int, int]:
    loss, hits, supervised = _forward_loss(model, batch, device)
    return loss, hits.sum().item(), supervised.sum().item()


@torch.no_grad()
def evaluate(model: HybridLM, data: TaskData, batch_size: int, device) -> dict:
    was_training = model.training
    model.eval()
    total_loss, correct, count, exact = 0.0, 0, 0, 0
    for start in range(0, len(data), batch_size):
        batch = data.batch(torch.arange(start, min(start + batch_size, len(data)))).to(device)
        loss, hits, supervised = _forward_loss(model, batch, device)
        n = supervised.sum().item()
        total_loss += loss.item() * n
        correct, count = correct + hits.sum().item(), count + n
        exact += (hits == supervised).all(dim=1).sum().item()  # every supervised position right
    model.train(was_training)
    return {"loss": total_loss / max(count, 1), "accuracy": correct / max(count, 1),
            "sequence_accuracy": exact / max(len(data), 1)}


@dataclass
class TrainResult:
    metrics: dict
    model: HybridLM = field(repr=False)
    history: list = field(default_factory=list, repr=False)


def train(recipe: Recipe, progress: bool = True, description: str = "") -> TrainResult:
    t = recipe.train
    device = resolve_device(t.device)
    if t.threads:
        torch.set_num_threads(t.threads)
    task = build_task(recipe)
    train_data = task.make("train", recipe.seed)
    test_data = task.make("test", recipe.seed)
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size).to(device)
    optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=tuple(t.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, recipe))
    order = torch.Generator().manual_seed(recipe.seed + 12345)
    perm, cursor = torch.randperm(len(train_data), generator=order), 0
    history = []
    start = time.perf_counter()
    bar = tqdm(range(t.steps), desc=description or "train", disable=None if progress else True, dynamic_ncols=True, leave=False)  # None: off when not a terminal
    loss_ema = acc_ema = None
    model.train()
    for step in bar:
        if cursor + t.batch_size > len(perm):
            perm, cursor = torch.randperm(len(train_data), generator=order), 0
        batch = train_data.batch(perm[cursor: cursor + t.batch_size]).to(device)
        cursor += t.batch_size
        loss, correct, count = loss_and_accuracy(model, batch, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        acc = correct / max(count, 1)
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        acc_ema = acc if acc_ema is None else 0.95 * acc_ema + 0.05 * acc
        bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{acc_ema:.3f}")
        if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
            ev = evaluate(model, test_data, recipe.eval.batch_size, device)
            history.append({"step": step + 1, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"]})
            if t.early_stop_acc and ev["accuracy"] >= t.early_stop_acc:
                break
    bar.close()
    train_seconds = time.perf_counter() - start
    metrics = {"steps": step + 1, "train_loss": loss_ema, "train_accuracy": acc_ema, "train_seconds": train_seconds}
    with model.test_time(recipe.eval.test_time):
        ev = evaluate(model, test_data, recipe.eval.batch_size, device)
        metrics.update({"test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                        "test_sequence_accuracy": ev["sequence_accuracy"]})
        for seq_len in recipe.eval.seq_lens:
            data = task.make("test", recipe.seed, seq_len=seq_len)
            ev = evaluate(model, data, recipe.eval.batch_size, device)
            metrics[f"test_accuracy@{seq_len}"] = ev["accuracy"]
            metrics[f"test_sequence_accuracy@{seq_len}"] = ev["sequence_accuracy"]
    # one trained model, evaluated at each value of a test-time knob; cells of a grid whose mixers do
    # not declare the knob leave these columns empty
    for knob, values in recipe.eval.test_time_sweep.items():
        if knob not in model.test_time_knobs():
            continue
        for value in values:
            with model.test_time({**recipe.eval.test_time, knob: value}):
                accuracy = evaluate(model, test_data, recipe.eval.batch_size, device)["accuracy"]
            metrics[f"test_accuracy@{knob}={value}"] = accuracy
    metrics["params"] = model.num_params()
    metrics["state_size"] = model.state_size(task.seq_len)
    metrics["active_state_size"] = model.active_state_size(task.seq_len)
    metrics["device"] = str(device)
    metrics["wall_seconds"] = time.perf_counter() - start
    return TrainResult(metrics, model, history)
