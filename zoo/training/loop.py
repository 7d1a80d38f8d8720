"""Training of one recipe: AdamW (:mod:`zoo.training.optim`), gradient clipping, periodic evaluation,
checkpoints, and the end-of-run evaluation (:mod:`zoo.training.evaluation`). Throughput is reported
in steady state, after a warm-up, with the warm-up's time beside it (:mod:`zoo.training.throughput`).

Precision (``train.precision``): ``auto`` keeps fp32 on a CPU and bf16 autocast on CUDA; ``fp32``,
``bf16`` and ``fp16`` (autocast plus a gradient scaler) choose explicitly. ``train.compile`` runs the
training forward through ``torch.compile`` (evaluation stays eager); ``train.cuda_graph`` captures a step's
forward and backward passes once as a CUDA graph and replays it (:mod:`zoo.training.captured`; the metric
``cuda_graph`` says whether it did). On CUDA the metrics include
``peak_memory_mib``: the most device memory held by tensors during training (evaluation not counted: the
peak counter is read before each periodic evaluation and reset after it, :class:`TrainingPeak`). The
same seed gives the same numbers on re-run on a CPU: the model init, the data and the batch order all
derive from ``recipe.seed``. On CUDA, before its first step a process compiles every Triton kernel of a
step at once, on every core (:mod:`kernels.ahead`), instead of one after another as the step launches them.

With a checkpoint folder (``train(..., checkpoint_dir=DIR)``, ``zoo train RECIPE --out DIR``) the run
saves a checkpoint (:mod:`zoo.training.checkpoint`: the recipe plus a :class:`TrainState`) every
``train.checkpoint_every`` steps and at the end (before the final evaluation, so that a run stopped during it
keeps its whole training, and again with the metrics), and a run that finds a checkpoint of the same recipe
there resumes from it, ending with exactly the numbers of an uninterrupted run on a CPU. A Ctrl-C or a SIGTERM
(:mod:`zoo.training.stopping`) stops the run with a line saying at which step, and what the checkpoint folder holds
to resume from.

Under ``torchrun`` (see :mod:`zoo.training.distributed`) the model is wrapped in
DistributedDataParallel and each rank trains on its shard of the global batch; rank 0 alone prints,
tracks and checkpoints.

A step is queued without waiting for the device, and its loss and accuracy are read once the next step is
queued (at once where an evaluation, a checkpoint, the warm-up clock's end or the run's end follows it), so a
GPU always has work while the host waits for the numbers, books the step and prepares the next batch.

A run whose weights are no longer finite after a step (a NaN or infinite training loss, then NaN weights) stops
there with a line saying so: no later step can bring the weights back. The final evaluation reads the diverged
model (its test loss is NaN) and the metrics record ``diverged_at_step``.

When stderr is not a terminal, progress is a plain line (step, loss, accuracy, elapsed) at least every
``PLAIN_PROGRESS_SECONDS`` and at every periodic evaluation, so piped runs never sit silent.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kernels.ahead import forward_backward_ahead

from ..config import Recipe
from ..errors import UserError
from ..host_memory import tune_allocator
from ..model import HybridLM
from ..paths import probe_writable
from ..tasks import Task, TaskData
from ..tasks.text import training_data
from ..threads import torch_threads
from . import checkpoint as ckpt
from . import distributed, stopping
from .captured import StepPasses
from .device import autocast, resolve_device, resolve_precision
from .evaluation import evaluate_data, forward_loss, test_metrics
from .state import TrainState
from .throughput import warmup_steps
from .tracking import Tracker, default_dir, make_tracker

PLAIN_PROGRESS_SECONDS = 30.0


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
            self.eager = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
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


class TrainingPeak:
    """The most memory tensors held on the device during the training steps, evaluations left out: the device's
    peak counter (``counter``: a function reading it and one resetting it to what is held now) is read before each
    periodic evaluation (:meth:`outside`) and reset after it, and the largest reading is the training peak."""

    def __init__(self, counter):
        self.read_counter, self.reset_counter = counter
        self.reset_counter()
        self.peak = 0

    @contextlib.contextmanager
    def outside(self):
        self.peak = max(self.peak, self.read_counter())
        try:
            yield
        finally:
            self.reset_counter()

    def mib(self) -> float:
        return max(self.peak, self.read_counter()) / 2**20


def peak_counter(device: torch.device):
    """The device's peak-memory counter for :class:`TrainingPeak`, or None where torch keeps none (a CPU)."""
    if device.type != "cuda":
        return None
    return (lambda: torch.cuda.max_memory_allocated(device)), (lambda: torch.cuda.reset_peak_memory_stats(device))


@dataclass
class _Run:
    """What one training process holds besides the :class:`TrainState`."""
    recipe: Recipe
    ctx: distributed.DistContext
    device: torch.device
    precision: str
    task: Task
    checkpoint_path: Path | None
    tracker: Tracker | None = None
    peak: TrainingPeak | None = None  # the device's training peak memory, where it has a counter
    kernels_compiled: bool = False  # this process's Triton kernels were compiled ahead of its first step
    saved_step: int | None = None  # the step the checkpoint in the folder holds (read, or written by this process)

    def checkpoint(self, state: TrainState, **extra) -> None:
        if self.checkpoint_path is not None and self.ctx.is_main:
            try:
                ckpt.save(self.checkpoint_path, {"recipe": self.recipe.plain, "recipe_key": self.recipe.key,
                                                 "imports": ckpt.imports_for(self.recipe),
                                                 "world_size": self.ctx.world_size,
                                                 **ckpt.tokenizer_record(self.task), **state.state_dict(), **extra})
            except UserError as err:
                raise UserError(f"{err}; {self.saved()}") from None
            self.saved_step = state.step

    def saved(self) -> str:
        """What the checkpoint folder holds for a run of this recipe to resume from."""
        if self.checkpoint_path is None:
            return "nothing saved (no checkpoint folder: zoo train --out DIR checkpoints a run)"
        if self.saved_step is None:
            every = self.recipe.train.checkpoint_every
            first = f"the first checkpoint comes at step {every}" if every else "train.checkpoint_every=0: only at the end"
            return f"nothing saved yet ({first}): the same command starts over"
        return f"{self.checkpoint_path} holds step {self.saved_step}, where the same command resumes"


def _saved_state(path: Path | None, main: bool) -> dict | None:
    """The checkpoint at ``path`` to resume from; a damaged one is moved aside and the run starts over."""
    if path is None:
        return None
    if main:
        ckpt.remove_orphans(path.parent)
    if not path.exists():
        return None
    try:
        return ckpt.load(path)
    except UserError as err:
        if not main:   # the main process moves it aside and starts over: so does this one (never an error
            return None  # here, whether it read the file before or after the move)
        moved = ckpt.move_aside(path)
        _say(f"{err}; moved it to {moved} and training this run from the start")
        return None


def probe_folders(recipe: Recipe, checkpoint_dir, what: str = "checkpoint folder") -> None:
    """Refuse in one line, before anything is built, a checkpoint or tracking folder that cannot be written
    (``what`` names where the checkpoint folder came from)."""
    if checkpoint_dir is not None:
        probe_writable(checkpoint_dir, what)
    if recipe.train.tracking != "none":
        probe_writable(default_dir(recipe, checkpoint_dir), "train.tracking_dir")


def _check_eval_lengths(recipe: Recipe, task: Task) -> None:
    """Refuse before the first step an ``eval.seq_lens`` length the task cannot evaluate at: validation could not
    check it against a text task's data that training prepared only now, and the run would otherwise train to its
    end and fail at its evaluation, its last steps never checkpointed."""
    for length in recipe.eval.seq_lens:
        try:
            task.check_length(length)
        except (ValueError, UserError) as err:
            raise UserError(f"eval.seq_lens: {err}; drop that length (nothing was trained)") from None


def _check_ranks_agree(ctx: distributed.DistContext, step: int, device, checkpoint_dir) -> None:
    """Every rank starts from the same step: ranks that read the checkpoint folder from different places (a
    folder each, or one where the others found none) would train on from different weights, and rank 0 would
    write their mixture's row. The sum of the steps and of their squares tells equal steps from any others."""
    if not ctx.enabled:
        return
    total, squares = ctx.all_sum([float(step), float(step) ** 2], device)
    if squares * ctx.world_size != total ** 2:
        raise UserError(f"the {ctx.world_size} processes start from different steps (this one from {step}): they "
                        f"read the checkpoint folder {checkpoint_dir} from different places; give every process the "
                        f"same --out, on a file system they all see")


def _start(recipe: Recipe, checkpoint_dir) -> tuple[_Run, TrainState, object]:
    """Device, data, model and optimizer of a run; resumed from a checkpoint of the same recipe."""
    t = recipe.train
    ctx = distributed.context(resolve_device(t.device))
    if ctx.is_main:
        probe_folders(recipe, checkpoint_dir)
    device = distributed.device_for(ctx, resolve_device(t.device))
    if device.type == "cpu":
        tune_allocator()  # large buffers reused between steps instead of mapped anew (zoo.host_memory)
    try:
        distributed.shard_size(t.batch_size, ctx.world_size)
    except ValueError as err:
        raise UserError(str(err)) from None
    path = Path(checkpoint_dir) / ckpt.FILENAME if checkpoint_dir is not None else None
    run = _Run(recipe, ctx, device, resolve_precision(t.precision, device), Task.from_spec(recipe.task), path)
    train_data = training_data(run.task, recipe.seed)
    _check_eval_lengths(recipe, run.task)
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, run.task.vocab_size).to(device)
    state_sizes(model, run.task.seq_len)
    state = TrainState.fresh(recipe, model, len(train_data) if isinstance(train_data, TaskData) else None,
                             run.precision, device)
    saved = _saved_state(path, ctx.is_main)
    if saved is not None:
        ckpt.check_same_recipe(saved, recipe, path)
        ckpt.check_weights_fit(path, saved["model"], model, recipe, "resume with the task options (tokenizer) and "
                               "the mixer-zoo version it was trained with, or use another folder")
        ckpt.check_same_tokenizer(path, saved, run.task)
        state.load_state_dict(saved)
        run.saved_step = state.step
        if ctx.is_main:
            _say(f"resuming from {path} at step {state.step}/{t.steps}" + (" (finished)" if state.finished else ""))
    _check_ranks_agree(ctx, state.step, device, checkpoint_dir)
    run.tracker = make_tracker(recipe, checkpoint_dir, resume_step=state.step) if ctx.is_main else None
    return run, state, train_data


def state_sizes(model, seq_len: int) -> tuple[int, int]:
    """The model's state and active state elements at ``seq_len`` (what ``zoo check`` prints and every results row
    records), read before a run's first step: a mixer without ``state_size`` is refused in one line there, not in
    the evaluation after its last."""
    try:
        return model.state_size(seq_len), model.active_state_size(seq_len)
    except NotImplementedError as err:
        raise UserError(f"{err} (every results row records the state size it returns)") from None


def _micro_batch_sizes(rows: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` micro-batches of a batch of ``rows`` (as ``torch.chunk`` splits: ``ceil(rows /
    parts)`` each but the last, fewer parts where that size leaves some empty)."""
    size = -(-rows // parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _training_passes(run: _Run, state: TrainState, forward: _Forward):
    """The forward and backward passes of one step over its micro-batches (``train.grad_accum``), as one
    callable of the step's tensors that :class:`~zoo.training.captured.StepPasses` runs eagerly or captures:
    ``passes(inputs, labels, mask, scale) -> (summed loss, hits)``, ``scale`` the loss's factor (a number, or a
    device tensor in a captured step). Micro-batches are row ranges of the batch (slices, no gather)."""
    t = run.recipe.train

    def passes(inputs, labels, mask, scale):
        sizes = _micro_batch_sizes(len(inputs), t.grad_accum)
        total = correct = 0
        start = 0
        for i, size in enumerate(sizes):
            rows = slice(start, start + size)
            start += size
            part = TaskData(inputs[rows], labels[rows], None if mask is None else mask[rows])
            loss_sum, hits, _supervised = forward_loss(forward, part, run.device, run.precision, reduction="sum")
            # under DDP, gradients are averaged over ranks once, after the last micro-batch
            defer = run.ctx.enabled and i < len(sizes) - 1
            with forward.eager.no_sync() if defer else contextlib.nullcontext():
                state.scaler.scale(loss_sum * scale).backward()
            total, correct = total + loss_sum.detach().double(), correct + hits.sum()
        return total, correct
    return passes


@dataclass
class _Queued:
    """A step whose work is queued on the device: its summed loss and hits (one float64 tensor of two, a copy of
    its own), the global count of supervised tokens and the learning rate it stepped with."""
    sums: torch.Tensor
    count: int
    lr: float


def _step(run: _Run, state: TrainState, passes: StepPasses, train_data) -> _Queued:
    """Queue one optimizer step on the next global batch; nothing in it waits for the device (:func:`_read`
    does): the batch is copied without waiting (pinned memory on CUDA), the count of supervised tokens comes
    from the host's copy of the labels, and the loss and hits are summed on the device."""
    t = run.recipe.train
    host = state.next_batch(train_data, t.batch_size).batch(run.ctx.shard(t.batch_size))
    # the global count of supervised tokens (the loss's denominator) is known before any forward pass
    count = run.ctx.all_sum([(host.labels != -100).sum().item()], run.device)[0]
    batch = host.to(run.device, non_blocking=True)
    if not run.kernels_compiled:
        run.kernels_compiled = True
        _compile_kernels_ahead(run, state, batch.batch(slice(0, _micro_batch_sizes(len(batch), t.grad_accum)[0])))
    # DDP averages over ranks: x world size / global count = the full batch's mean
    total, correct = passes({"inputs": batch.inputs, "labels": batch.labels, "mask": batch.mask,
                             "scale": run.ctx.world_size / max(count, 1)})
    sums = torch.stack([total, correct.to(total.dtype)])  # a copy: a captured step's outputs are rewritten
    if t.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), t.grad_clip)
    lr = state.scheduler.get_last_lr()[0]
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    return _Queued(sums, count, lr)


def _read(run: _Run, queued: _Queued) -> tuple[float, float]:
    """The loss and accuracy of a queued step over all ranks (waits for its work)."""
    total, correct = run.ctx.all_sum(queued.sums.tolist(), run.device)
    return total / max(queued.count, 1), correct / max(queued.count, 1)


def _read_at_once(run: _Run, state: TrainState) -> bool:
    """Whether the step just queued must be read and recorded before the next one is queued: an evaluation, a
    checkpoint or the end of the warm-up's clock follows it, or it is the run's last. Any other step is
    recorded after the next one is queued, so that the device runs that one while the host waits for the
    numbers."""
    t = run.recipe.train
    k = state.step + 1
    return (k >= t.steps or bool(t.eval_every and k % t.eval_every == 0)
            or bool(t.checkpoint_every and k % t.checkpoint_every == 0)
            or state.throughput.done_here + 1 == state.throughput.warmup)


def _weights_nonfinite(model: torch.nn.Module) -> bool:
    return any(not torch.isfinite(p).all() for p in model.parameters())


def _diverged(run: _Run, state: TrainState, loss: float, description: str) -> None:
    """A non-finite loss with non-finite weights: no later step can bring the weights back, so training stops
    (the steps left would only cost time), the final evaluation reads the diverged model and the metrics say
    where (``diverged_at_step``). A non-finite loss with finite weights (an fp16 overflow the gradient scaler
    skips) trains on."""
    state.diverged_at = state.step
    if run.ctx.is_main:
        _say(f"{description or 'train'}: diverged at step {state.step}/{run.recipe.train.steps}: the training "
             f"loss is {loss} and the weights are no longer finite, so training stops here and the metrics "
             f"record diverged_at_step={state.step}; a lower train.lr, a train.warmup_steps or a train.grad_clip "
             f"(now {run.recipe.train.grad_clip:g}) may let it train")


def _compile_kernels_ahead(run: _Run, state: TrainState, micro_batch) -> None:
    """On CUDA, compile every Triton kernel of a training step at once, on every core, before the first step
    launches them one after another (:mod:`kernels.ahead`: a forward and backward that keeps no gradient and
    changes no random stream). Its time is part of the warm-up."""
    with autocast(run.device, run.precision):
        report = forward_backward_ahead(state.model, micro_batch.inputs, mask=micro_batch.mask)
    if run.ctx.is_main and report.launches:
        _say(report.describe())


def _periodic_eval(run: _Run, state: TrainState, test_data) -> bool:
    """Evaluate every ``train.eval_every`` steps (not at the last); stop early at ``train.early_stop_acc``."""
    t = run.recipe.train
    if not (t.eval_every and state.step % t.eval_every == 0 and state.step < t.steps):
        return False
    # under eval.test_time, as the end-of-run test_accuracy: the curve ends where the final number is read
    outside_peak = run.peak.outside() if run.peak is not None else contextlib.nullcontext()
    with state.throughput.paused(), outside_peak, state.model.test_time(run.recipe.eval.test_time):
        ev = evaluate_data(state.model, test_data, run.recipe.eval.batch_size, run.device, run.precision)
    state.history.append({"step": state.step, "test_loss": ev["loss"], "test_accuracy": ev["accuracy"]})
    if run.tracker is not None:
        run.tracker.log(state.step, {"test/loss": ev["loss"], "test/accuracy": ev["accuracy"]})
    if t.early_stop_acc and ev["accuracy"] >= t.early_stop_acc:
        state.finished = True
    return True


class _Progress:
    """A tqdm bar on a terminal, else a plain line every ``PLAIN_PROGRESS_SECONDS`` and at evaluations."""

    def __init__(self, run: _Run, state: TrainState, show: bool, description: str):
        self.description = description or "train"
        self.bar = tqdm(total=run.recipe.train.steps, initial=state.step, desc=self.description,
                        disable=None if show else True, dynamic_ncols=True, leave=False)  # None: off if no tty
        self.plain, self.last = show and self.bar.disable, time.perf_counter()

    def update(self, run: _Run, state: TrainState, loss: float, accuracy: float, lr: float, evaluated: bool) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{state.loss_ema:.3f}", acc=f"{state.acc_ema:.3f}")
        if run.tracker is not None:
            run.tracker.log(state.step, {"train/loss": loss, "train/accuracy": accuracy,
                                         "train/loss_ema": state.loss_ema,
                                         "train/lr": lr})
        now = time.perf_counter()
        if self.plain and (evaluated or now - self.last >= PLAIN_PROGRESS_SECONDS):
            test = f" test_acc {state.history[-1]['test_accuracy']:.3f}" if evaluated else ""
            _say(f"{self.description}: step {state.step}/{run.recipe.train.steps} loss {state.loss_ema:.4f} "
                 f"acc {state.acc_ema:.3f}{test} elapsed {state.elapsed:.0f}s")
            self.last = now


def train(recipe: Recipe, progress: bool = True, description: str = "",
          checkpoint_dir: str | Path | None = None) -> TrainResult:
    """Train ``recipe`` and evaluate it; with ``checkpoint_dir``, checkpoint there and resume from
    a checkpoint of the same recipe found there (a different recipe's checkpoint is refused). The run uses
    ``train.threads`` torch threads where set; the caller's count is restored after it."""
    with torch_threads(recipe.train.threads), stopping.terminate_as_interrupt():
        return _train(recipe, progress, description, checkpoint_dir)


def _train(recipe: Recipe, progress: bool, description: str, checkpoint_dir: str | Path | None) -> TrainResult:
    run, state, train_data = _start(recipe, checkpoint_dir)
    try:
        return _train_started(run, state, train_data, progress, description)
    except KeyboardInterrupt as stop:  # a Ctrl-C, or a SIGTERM (zoo.training.stopping): say where the run stopped
        if run.ctx.is_main:
            where = (f"during the final evaluation, after step {state.step}" if state.finished
                     else f"at step {state.step}")
            _say(f"{description or 'train'}: stopped by {stopping.describe(stop)} {where}/{recipe.train.steps}; "
                 f"{run.saved()}")
        raise


def _train_started(run: _Run, state: TrainState, train_data, progress: bool, description: str) -> TrainResult:
    recipe, t = run.recipe, run.recipe.train
    process_start = time.perf_counter()
    counter = peak_counter(run.device)
    run.peak = TrainingPeak(counter) if counter is not None else None
    forward = _Forward(state.model, run.ctx, run.device, t.compile)
    passes = StepPasses(_training_passes(run, state, forward), list(state.model.parameters()), run.device,
                        t.cuda_graph, why_not="a run under torchrun averages its gradients through DDP, outside "
                                              "any graph" if run.ctx.enabled else None)
    test_data = run.task.make("test", recipe.seed)
    shown = _Progress(run, state, progress and run.ctx.is_main, description)
    state.model.train()
    trains = not state.finished  # a finished checkpoint read again trains nothing: no clock runs
    if trains:
        state.throughput.start(run.device, warmup_steps(t.steps))

    def finish(queued: _Queued) -> None:  # a step's numbers, then what follows it
        loss, accuracy = _read(run, queued)
        state.record(loss, accuracy)
        if not math.isfinite(loss) and state.diverged_at is None and _weights_nonfinite(state.model):
            _diverged(run, state, loss, description)
        evaluated = _periodic_eval(run, state, test_data)
        shown.update(run, state, loss, accuracy, queued.lr, evaluated)
        if t.checkpoint_every and state.step % t.checkpoint_every == 0 and state.step < t.steps \
                and not state.finished:
            with state.throughput.paused():
                run.checkpoint(state)

    pending = None  # a queued step not recorded yet (see _read_at_once)
    try:
        while state.step + (pending is not None) < t.steps and not state.finished and state.diverged_at is None:
            queued = _step(run, state, passes, train_data)
            if pending is not None:
                finish(pending)
            pending = queued
            if _read_at_once(run, state):
                finish(pending)
                pending = None
        if pending is not None:  # queued before its predecessor's numbers showed the divergence
            finish(pending)
        state.finished = True
    finally:
        shown.bar.close()
        passes.close()  # a captured step's graph and gradients are not needed by the evaluation
    state.stop_clock()
    if trains:  # the whole training is kept, should the final evaluation be stopped
        run.checkpoint(state)
    metrics = state.summary(t.batch_size * run.task.seq_len)
    if run.peak is not None:  # the training peak of this process, before the final evaluation
        metrics["peak_memory_mib"] = run.peak.mib()
    metrics.update(test_metrics(state.model, recipe, run.task, run.device, run.precision))
    metrics["device"] = str(run.device)
    if t.cuda_graph:
        metrics["cuda_graph"] = passes.mode if passes.error is None else f"eager: {passes.error}"
    metrics["wall_seconds"] = time.perf_counter() - process_start
    if run.tracker is not None:
        run.tracker.log(state.step, {f"final/{k}": v for k, v in metrics.items() if k.startswith("test_")})
        run.tracker.close()
    run.checkpoint(state, metrics=metrics)
    return TrainResult(metrics, state.model, state.history, recipe)
