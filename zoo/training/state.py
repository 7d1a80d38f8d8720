"""``TrainState``: everything that shapes a training trajectory, in one object with symmetric
``state_dict`` / ``load_state_dict``.

A checkpoint is a ``TrainState.state_dict()`` plus the recipe it belongs to, and resuming is
``load_state_dict`` of that dict: adding a field means adding it here once. Restored exactly: the weights,
the optimizer, the schedule position, the gradient scaler (fp16), the data order (current permutation,
cursor and the order generator's state, which also draws a streaming task's windows), every RNG state,
the step, the history of periodic evaluations, the running averages shown as ``train_loss`` /
``train_accuracy``, elapsed training time, the throughput clocks (:mod:`zoo.training.throughput`) and
whether the run finished or diverged. So on a CPU a resumed run ends
with exactly the numbers of an uninterrupted one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import Recipe
from ..tasks import TaskData
from . import checkpoint as ckpt
from .optim import make_optimizer
from .throughput import Throughput

#: the batch-order generator is seeded ``recipe.seed + ORDER_SEED_OFFSET``, apart from the model init
#: (``recipe.seed``) and the data (:meth:`zoo.tasks.Task.make`)
ORDER_SEED_OFFSET = 12345
#: decay of the running averages of the training loss and accuracy that are shown and reported
EMA_DECAY = 0.95


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    order: torch.Generator
    perm: torch.Tensor
    cursor: int = 0
    step: int = 0
    finished: bool = False
    diverged_at: int | None = None  # the step whose loss first read non-finite with non-finite weights
    history: list = field(default_factory=list)
    loss_ema: float | None = None
    acc_ema: float | None = None
    elapsed_before: float = 0.0  # training seconds of earlier processes of this run
    started: float | None = field(default_factory=time.perf_counter)  # None: the clock is stopped
    throughput: Throughput = field(default_factory=Throughput)  # warm-up and steady-state clocks

    @classmethod
    def fresh(cls, recipe: Recipe, model: torch.nn.Module, num_train: int | None, precision: str,
              device: torch.device) -> "TrainState":
        """``num_train``: examples of a generated training set, or None for a stream (no permutation)."""
        optimizer, scheduler = make_optimizer(model, recipe)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        order = torch.Generator().manual_seed(recipe.seed + ORDER_SEED_OFFSET)
        perm = torch.randperm(num_train, generator=order) if num_train is not None else torch.zeros(0, dtype=torch.long)
        return cls(model, optimizer, scheduler, scaler, order, perm)

    @property
    def elapsed(self) -> float:
        """Training seconds so far, over every process that trained this run."""
        if self.started is None:
            return self.elapsed_before
        return self.elapsed_before + time.perf_counter() - self.started

    def stop_clock(self) -> None:
        """Training is over: evaluation time does not count as training time."""
        self.elapsed_before, self.started = self.elapsed, None
        self.throughput.stop()

    def next_indices(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` example indices; a new permutation when the current one runs out."""
        if self.cursor + batch_size > len(self.perm):
            self.perm, self.cursor = torch.randperm(len(self.perm), generator=self.order), 0
        self.cursor += batch_size
        return self.perm[self.cursor - batch_size: self.cursor]

    def next_batch(self, data, batch_size: int) -> TaskData:
        """The next global batch: the next ``batch_size`` examples of a generated set, or ``batch_size``
        windows a stream draws with the order generator (restored on resume, so a resumed run draws the
        same windows as an uninterrupted one)."""
        if isinstance(data, TaskData):
            return data.batch(self.next_indices(batch_size))
        return data.draw(batch_size, self.order)

    def record(self, loss: float, accuracy: float) -> None:
        """One finished optimizer step with its batch loss and accuracy."""
        self.step += 1
        self.throughput.step()
        self.loss_ema = loss if self.loss_ema is None else EMA_DECAY * self.loss_ema + (1 - EMA_DECAY) * loss
        self.acc_ema = accuracy if self.acc_ema is None else EMA_DECAY * self.acc_ema + (1 - EMA_DECAY) * accuracy

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "order": {"perm": self.perm, "cursor": self.cursor, "generator": self.order.get_state()},
                "rng": ckpt.rng_state(), "step": self.step, "finished": self.finished, "diverged_at": self.diverged_at,
                "history": self.history,
                "loss_ema": self.loss_ema, "acc_ema": self.acc_ema, "elapsed": self.elapsed,
                "throughput": self.throughput.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.perm, self.cursor = state["order"]["perm"], state["order"]["cursor"]
        self.order.set_state(state["order"]["generator"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.finished, self.history = state["step"], state["finished"], state["history"]
        self.diverged_at = state.get("diverged_at")  # absent from checkpoints written before it was recorded
        self.loss_ema, self.acc_ema = state["loss_ema"], state["acc_ema"]
        # a finished run trains no more: its clock stays stopped, so reading it again adds no seconds
        self.elapsed_before = state["elapsed"]
        self.started = None if self.finished else time.perf_counter()
        self.throughput.load_state_dict(state.get("throughput"))

    def summary(self, tokens_per_step: int = 0) -> dict:
        """The training part of a run's metrics: with ``tokens_per_step``, ``steady_tokens_per_second``
        (after the warm-up, evaluation excluded) and ``train_tokens_per_second`` (the overall rate: every
        step over ``train_seconds``, warm-up and periodic evaluation included, as in every committed row);
        ``warmup_seconds`` and ``steady_steps`` beside them (:mod:`zoo.training.throughput`); ``diverged_at_step``
        where training stopped because the weights were no longer finite."""
        out = {"steps": self.step, "train_loss": self.loss_ema, "train_accuracy": self.acc_ema,
               "train_seconds": self.elapsed}
        if tokens_per_step:
            out["train_tokens_per_second"] = self.step * tokens_per_step / max(self.elapsed, 1e-9)
        out.update(self.throughput.metrics(tokens_per_step))
        if self.diverged_at is not None:
            out["diverged_at_step"] = self.diverged_at
        return out
