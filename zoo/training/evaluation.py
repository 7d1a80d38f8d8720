"""The metrics of a model: the loss of a batch, per-split accuracy, test-time knobs, ``eval.tasks`` and the
language-model metrics, computed the same way during training, at its end and by ``zoo eval``.

Training calls into this module (the loss of a batch, the end-of-run metrics); this module never
imports training's loop. Device and precision choices come from :mod:`zoo.training.device`; evaluating a
checkpoint again (``zoo eval``) is :mod:`zoo.reevaluate`.

Text tasks (:class:`zoo.tasks.text.TextTask`, the ``lm`` task) also get validation bits per
byte, perplexity, the loss by position bucket and bits per byte at every ``eval.seq_lens`` length
(:func:`lm_metrics`).

``eval.tasks`` entries are evaluated zero-shot on their test split at their own ``seq_len`` and at every
``eval.seq_lens`` length, under ``eval.test_time``: metrics ``test_accuracy@task=<label>`` and
``test_accuracy@task=<label>@<L>``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import Recipe
from ..model import HybridLM
from ..tasks import Task, TaskData
from ..tasks.text import TextTask
from .device import autocast

#: text tasks: the loss by position is reported in this many equal ranges of positions
POSITION_BUCKETS = 4


def forward_loss(model, batch: TaskData, device, precision: str = "auto",
                 reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, hits, supervised)``: cross-entropy over supervised positions (mean or sum), and
    per-position boolean tensors of correct predictions and of supervised positions."""
    with autocast(device, precision):
        logits = model(batch.inputs, mask=batch.mask)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100, reduction=reduction)
    supervised = batch.labels != -100
    return loss, (logits.argmax(-1) == batch.labels) & supervised, supervised


@torch.no_grad()
def evaluate_data(model: HybridLM, data: TaskData, batch_size: int, device, precision: str = "auto") -> dict:
    """``{loss, accuracy, sequence_accuracy}`` of ``model`` on ``data`` (sequence accuracy: the fraction of
    the examples with a supervised position that have every supervised position right)."""
    was_training = model.training
    model.eval()
    total_loss, correct, count, exact, judged = 0.0, 0, 0, 0, 0
    for start in range(0, len(data), batch_size):
        batch = data.batch(torch.arange(start, min(start + batch_size, len(data)))).to(device)
        loss, hits, supervised = forward_loss(model, batch, device, precision)
        n = supervised.sum().item()
        if n:  # a batch with nothing supervised has a NaN mean loss and adds nothing
            total_loss += loss.item() * n
        correct, count = correct + hits.sum().item(), count + n
        labelled = supervised.any(dim=1)  # an example with nothing to predict is neither right nor wrong
        exact += ((hits == supervised).all(dim=1) & labelled).sum().item()
        judged += labelled.sum().item()
    model.train(was_training)
    loss = total_loss / max(count, 1)
    if not math.isfinite(loss):
        # a diverged model: the argmax of NaN logits is no prediction, so its accuracy is not a number
        return {"loss": loss, "accuracy": float("nan"), "sequence_accuracy": float("nan")}
    return {"loss": loss, "accuracy": correct / max(count, 1), "sequence_accuracy": exact / max(judged, 1)}


@torch.no_grad()
def text_metrics(model: HybridLM, data: TaskData, token_bytes: torch.Tensor, batch_size: int, device,
                 precision: str = "auto", buckets: int = POSITION_BUCKETS) -> dict:
    """Bits per byte and perplexity of a language model on ``data`` (every label supervised):
    ``bpb = summed nats / ln 2 / bytes of the target tokens`` (``token_bytes[id]`` bytes each), so models
    with different tokenizers compare on the same text; and the mean loss in ``buckets`` equal ranges of
    positions (``loss@pos<first>-<last>``)."""
    was_training = model.training
    model.eval()
    seq_len = data.inputs.shape[1]
    nats, tokens, n_bytes = 0.0, 0, 0
    by_position = torch.zeros(seq_len, dtype=torch.float64)
    for start in range(0, len(data), batch_size):
        batch = data.batch(torch.arange(start, min(start + batch_size, len(data)))).to(device)
        with autocast(device, precision):
            logits = model(batch.inputs, mask=batch.mask)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least, fp64 stays
        losses = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
        losses = losses.view(batch.labels.shape).double().cpu()
        nats, tokens = nats + losses.sum().item(), tokens + losses.numel()
        n_bytes += token_bytes[batch.labels.cpu()].sum().item()
        by_position += losses.sum(0)
    model.train(was_training)
    out = {"bpb": nats / math.log(2) / max(n_bytes, 1), "ppl": math.exp(min(nats / max(tokens, 1), 700.0))}
    for chunk in torch.arange(seq_len).chunk(min(buckets, seq_len)):
        out[f"loss@pos{chunk[0].item()}-{chunk[-1].item()}"] = (by_position[chunk].sum() / (len(chunk) * len(data))).item()
    return out


def lm_metrics(model: HybridLM, recipe: Recipe, task: Task, device, precision: str) -> dict:
    """``val_bpb``, ``val_ppl``, the loss by position bucket at the training length, ``val_bpb@<L>`` at every
    ``eval.seq_lens`` length (length extrapolation), and the data's record (corpus hash, sizes)."""
    token_bytes, bs = task.token_bytes(), recipe.eval.batch_size
    metrics = {}
    with model.test_time(recipe.eval.test_time):
        ev = text_metrics(model, task.make("test", recipe.seed), token_bytes, bs, device, precision)
        metrics.update({"val_bpb": ev.pop("bpb"), "val_ppl": ev.pop("ppl")})
        metrics.update({f"val_{k}": v for k, v in ev.items()})
        for seq_len in recipe.eval.seq_lens:
            ev = text_metrics(model, task.make("test", recipe.seed, seq_len=seq_len), token_bytes, bs, device, precision)
            metrics[f"val_bpb@{seq_len}"] = ev["bpb"]
    metrics.update(task.data_record())
    return metrics


def eval_task_metrics(model: HybridLM, recipe: Recipe, device, precision: str) -> dict:
    """``test_accuracy@task=<label>`` (and ``@<L>`` for every ``eval.seq_lens`` length) per entry."""
    metrics = {}
    bs = recipe.eval.batch_size
    with model.test_time(recipe.eval.test_time):
        for label, spec in recipe.eval_tasks:
            task = Task.from_spec(spec)
            ev = evaluate_data(model, task.make("test", recipe.seed), bs, device, precision)
            metrics[f"test_accuracy@task={label}"] = ev["accuracy"]
            for seq_len in recipe.eval.seq_lens:
                ev = evaluate_data(model, task.make("test", recipe.seed, seq_len=seq_len), bs, device, precision)
                metrics[f"test_accuracy@task={label}@{seq_len}"] = ev["accuracy"]
    return metrics


def test_metrics(model: HybridLM, recipe: Recipe, task: Task, device, precision: str = "auto") -> dict:
    """The end-of-run evaluation of a trained model (what ``zoo eval`` recomputes from a checkpoint):
    test loss/accuracy under ``eval.test_time``, each ``eval.seq_lens`` length, each value of
    ``eval.test_time_sweep``, each ``eval.tasks`` entry, and the model's size and state."""
    metrics = {}
    bs = recipe.eval.batch_size
    test_data = task.make("test", recipe.seed)
    with model.test_time(recipe.eval.test_time):
        ev = evaluate_data(model, test_data, bs, device, precision)
        metrics.update({"test_loss": ev["loss"], "test_accuracy": ev["accuracy"],
                        "test_sequence_accuracy": ev["sequence_accuracy"]})
        for seq_len in recipe.eval.seq_lens:
            ev = evaluate_data(model, task.make("test", recipe.seed, seq_len=seq_len), bs, device, precision)
            metrics[f"test_accuracy@{seq_len}"] = ev["accuracy"]
            metrics[f"test_sequence_accuracy@{seq_len}"] = ev["sequence_accuracy"]
    # one trained model, evaluated at each value of a test-time knob; cells of a grid whose mixers do
    # not declare the knob leave these columns empty
    for knob, values in recipe.eval.test_time_sweep.items():
        if knob not in model.test_time_knobs():
            continue
        for value in values:
            with model.test_time({**recipe.eval.test_time, knob: value}):
                metrics[f"test_accuracy@{knob}={value}"] = evaluate_data(model, test_data, bs, device,
                                                                          precision)["accuracy"]
    metrics.update(eval_task_metrics(model, recipe, device, precision))
    if isinstance(task, TextTask):
        metrics.update(lm_metrics(model, recipe, task, device, precision))
    metrics["params"] = model.num_params()
    metrics["state_size"] = model.state_size(task.seq_len)
    metrics["active_state_size"] = model.active_state_size(task.seq_len)
    return metrics
