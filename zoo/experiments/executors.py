"""Where the cells of an ablation run: in this process one after another, or as tasks on a Ray cluster.

Both executors share one small interface — :meth:`Executor.submit` a cell, then iterate
:meth:`Executor.finished` for :class:`Outcome` objects (the cell with its row, or its error) in
completion order — and one function that turns a cell into a result row, :func:`run_cell`. The driver
(:func:`zoo.experiments.ablate.run_ablation`) stays the only writer of ``results.jsonl``: executors return rows,
they never write them.

Ray is an optional extra (``pip install -e ".[ray]"``), imported only when the Ray executor is chosen.
A cell is a Ray task that asks for ``cpus_per_cell`` CPUs (default: the recipe's ``train.threads``, at
least 1) and ``gpus_per_cell`` GPUs (default: 1 when the recipe's ``train.device`` is ``cuda``, or ``auto``
on a cluster with GPUs; else 0). Ray does not hide a node's GPUs from a task that asks for none, so a
cell that trains on a GPU must ask for one, or cells would share GPUs behind the scheduler's back.
A task whose worker process dies (killed, out of memory, node
lost) is resubmitted by Ray up to ``retries`` times (``max_retries``); a task that raises is
resubmitted by the executor up to ``retries`` times; a cell that still fails comes back as an error. Without an
``address`` a new local Ray is started, whatever cluster ``RAY_ADDRESS`` or a running ``ray start`` names.

No executor is made under torchrun with several processes: each would run the whole grid into the same folder.
"""
from __future__ import annotations

import abc
import importlib
import os
import platform
import signal
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..config import Cell
from ..errors import UserError, error_summary
from ..rows import make_row
from ..threads import torch_threads
from ..training import distributed, loop
from ..training.stopping import Terminated
from .untrained import untrained_metrics

RAY_MISSING = 'the Ray executor needs Ray, an optional extra: pip install -e ".[ray]"'


def run_cell(cell: Cell, progress: bool = False, checkpoint_root: str | None = None) -> dict:
    """Train one cell and return its ``results.jsonl`` row (the same code for every executor). With
    ``checkpoint_root``, the cell checkpoints in ``<root>/<recipe key>`` and resumes a checkpoint there."""
    recipe = cell.recipe
    # a process runs many cells (in turn, or as a reused Ray worker): one cell's train.threads must not become
    # the thread count of the next cell, whose train.threads=0 keeps the process's own
    with torch_threads(recipe.train.threads):
        checkpoint_dir = None if checkpoint_root is None else Path(checkpoint_root) / recipe.key
        # `loop.train` is looked up at call time, so a module in a recipe's `imports` may wrap it
        result = loop.train(recipe, progress=progress, description=cell.label, checkpoint_dir=checkpoint_dir)
        # the untrained model's numbers, so that the ledger can tell a rule that holds before any training
        step0 = untrained_metrics(recipe)
        # made inside train.threads, the thread count the row records; the device is the one the cell trained on
        # (train.device=cpu on a machine with a GPU is a CPU row)
        return make_row(recipe, cell.label, result.metrics, overrides=cell.overrides, history=result.history,
                        device=result.metrics.get("device"), host=platform.node(), step0_metrics=step0)


@dataclass
class Outcome:
    """A finished cell: its row, or the error of its last attempt; ``errors`` lists every failed attempt."""
    index: int
    cell: Cell
    row: dict | None = None
    error: str | None = None
    attempts: int = 1
    errors: list = field(default_factory=list)


class Executor(abc.ABC):
    """Runs cells; subclasses implement :meth:`submit` and :meth:`finished`. ``local``: the cells train on this
    machine (so what this machine can run is what they can run)."""
    name = "executor"
    local = True

    def __init__(self, retries: int = 0):
        if retries < 0:
            raise UserError(f"--retries {retries}: must be >= 0")
        processes = distributed.world_size_before_joining()
        if processes > 1:  # every process would run the whole grid into one folder, and its cells would wait on
            # each other's process group
            raise UserError(f"zoo ablate runs under torchrun here ({processes} processes), and each would run the "
                            f"whole grid into the same folder; run zoo ablate without torchrun (--executor ray trains "
                            f"cells side by side), or train one recipe on several processes with torchrun ... -m zoo "
                            f"train RECIPE --out DIR")
        self.retries = retries
        self.on_start = None  # called with a cell as it starts, where the executor knows (in-process)
        self.checkpoint_root = None  # set by the driver: cells checkpoint in <root>/<recipe key>

    def describe(self) -> str:
        return self.name

    def refuse_unplaceable(self, cells: list[Cell]) -> None:  # noqa: B027 - only a scheduler can refuse a cell
        """Refuse, before the run changes its folder, a cell this executor could never start."""

    @abc.abstractmethod
    def submit(self, index: int, cell: Cell) -> None:
        """Queue ``cell`` (``index`` is its place in the grid)."""

    @abc.abstractmethod
    def finished(self) -> Iterator[Outcome]:
        """Every submitted cell once, as it finishes."""

    def close(self) -> None:  # noqa: B027 - optional hook: most executors hold nothing to release
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SequentialExecutor(Executor):
    """Cells one after another in this process (the default); ``finished`` runs them."""
    name = "sequential"

    def __init__(self, retries: int = 0, progress: bool = True, echo=print):
        super().__init__(retries)
        self.progress, self.echo = progress, echo
        self.queue: list[tuple[int, Cell]] = []

    def submit(self, index: int, cell: Cell) -> None:
        self.queue.append((index, cell))

    def finished(self) -> Iterator[Outcome]:
        while self.queue:
            index, cell = self.queue.pop(0)
            outcome = Outcome(index, cell, attempts=0)
            while outcome.row is None and outcome.attempts <= self.retries:
                outcome.attempts += 1
                if self.on_start is not None:
                    self.on_start(cell)
                try:
                    outcome.row = run_cell(cell, progress=self.progress, checkpoint_root=self.checkpoint_root)
                except Exception as err:  # noqa: BLE001 - a failed cell is reported, the others still run
                    outcome.error = error_summary(err)
                    outcome.errors.append(outcome.error)
                    if isinstance(err, UserError):  # a problem of the recipe or the machine: the same every time
                        break
                    if outcome.attempts <= self.retries:
                        self.echo(f"  {cell.label}: attempt {outcome.attempts} failed ({outcome.error}); retrying")
            if outcome.row is not None:
                outcome.error = None
            yield outcome


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def _ray_task(cell: Cell, imports: tuple, progress: bool, checkpoint_root: str | None = None) -> dict:
    """The body of a cell's Ray task: import the recipe's modules first (registrations, hooks). Any error reaches
    the driver as a RuntimeError (picklable, whatever the original type) whose first line is the reason, followed
    by the worker's traceback."""
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a user module may fail in any way
            raise RuntimeError(f"cannot import {name!r} (the recipe's imports) on the Ray worker on {platform.node()}: "
                               f"{error_summary(err)}; it must be importable on every Ray node\n"
                               f"{traceback.format_exc()}") from None
    try:
        return run_cell(cell, progress=progress, checkpoint_root=checkpoint_root)
    except Exception as err:  # noqa: BLE001 - re-raised: any error of a cell reaches the driver
        raise RuntimeError(f"{error_summary(err)}\n{traceback.format_exc()}") from None


class RayExecutor(Executor):
    """Cells as Ray tasks, on a local Ray started on demand or on an existing cluster (``address``)."""
    name = "ray"

    def __init__(self, address: str | None = None, cpus_per_cell: float | None = None, gpus_per_cell: float | None = None,
                 retries: int = 2, num_cpus: int | None = None, progress: bool = False, echo=print):
        super().__init__(retries)
        if cpus_per_cell is not None and cpus_per_cell <= 0:
            raise UserError(f"--cpus-per-cell {cpus_per_cell}: must be > 0")
        if gpus_per_cell is not None and gpus_per_cell < 0:
            raise UserError(f"--gpus-per-cell {gpus_per_cell}: must be >= 0")
        self.ray = _import_ray()
        self.cpus_per_cell, self.gpus_per_cell = cpus_per_cell, gpus_per_cell
        self.progress, self.echo = progress, echo
        self.address, self.num_cpus = address, num_cpus
        self.local = address is None  # a Ray started here runs on this machine; a cluster's nodes may differ
        self.started_here = False
        self.remote = None
        self.pending: dict = {}  # ObjectRef -> Outcome
        self.terminated = False  # a SIGTERM came while Ray ran here
        self.placed: set = set()  # keys of the cells whose resources were checked against the nodes

    def _connect(self) -> None:
        """Start (or join) Ray on first use, so a run with nothing left to do never starts it."""
        if self.remote is not None:
            return
        if not self.ray.is_initialized():
            # without --address, a new local Ray: Ray alone would join a cluster that RAY_ADDRESS or a running
            # `ray start` names, and refuse the num_cpus given for the local one
            kwargs = ({"address": self.address} if self.address else
                      {"address": "local", "num_cpus": self.num_cpus or os.cpu_count() or 1})
            answer = signal.getsignal(signal.SIGTERM)
            try:
                self.ray.init(include_dashboard=False, logging_level="warning", log_to_driver=True, **kwargs)
                if callable(answer) and threading.current_thread() is threading.main_thread():
                    # Ray replaces the process's SIGTERM answer with one that aborts it: the driver's own
                    # (zoo.training.stopping: stop as a Ctrl-C does, saying what is kept) comes back
                    signal.signal(signal.SIGTERM, self._on_sigterm(answer))
            except (ConnectionError, RuntimeError, ValueError, ImportError) as err:
                if not self.address:
                    raise UserError(f"--executor ray: cannot start a local Ray: {error_summary(err)}") from None
                client_missing = isinstance(err, ImportError) or "ray[client]" in str(err)  # Ray raises ValueError
                hint = ('; ray:// addresses need the Ray client: pip install -e ".[ray]"' if client_missing
                        else " (start one with `ray start --head`)")
                raise UserError(f"--address {self.address}: cannot connect to a Ray cluster: "
                                  f"{error_summary(err)}{hint}") from None
            self.started_here = True
        self.remote = self.ray.remote(_ray_task)

    def _on_sigterm(self, answer):
        def on_sigterm(signum, frame):
            self.terminated = True
            answer(signum, frame)
        return on_sigterm

    def describe(self) -> str:
        self._connect()
        resources = self.ray.cluster_resources()
        nodes = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        return (f"ray ({nodes} node{'s' * (nodes != 1)}, {resources.get('CPU', 0):g} CPUs, "
                f"{resources.get('GPU', 0):g} GPUs)")

    def _resources(self, cell: Cell) -> tuple[float, float]:
        """The CPUs and GPUs the cell's task asks Ray for."""
        cpus = self.cpus_per_cell if self.cpus_per_cell is not None else max(1, cell.recipe.train.threads)
        gpus = self.gpus_per_cell
        if gpus is None:
            device = cell.recipe.train.device
            gpus = float(device == "cuda" or (device == "auto" and self.ray.cluster_resources().get("GPU", 0) > 0))
        return cpus, gpus

    def refuse_unplaceable(self, cells: list[Cell]) -> None:
        """Every cell no node can hold, refused (a local Ray) or warned of (a cluster) before any is launched."""
        self._connect()
        for cell in cells:
            self._check_feasible(cell, *self._resources(cell))
            self.placed.add(cell.recipe.key)

    def _launch(self, outcome: Outcome) -> None:
        self._connect()
        cell = outcome.cell
        cpus, gpus = self._resources(cell)
        if cell.recipe.key not in self.placed:   # checked already when the run began
            self._check_feasible(cell, cpus, gpus)
        ref = self.remote.options(num_cpus=cpus, num_gpus=gpus, max_retries=self.retries,
                                  retry_exceptions=False, name=f"zoo cell {cell.label}").remote(
            cell, tuple(cell.recipe.imports), self.progress, self.checkpoint_root)
        outcome.attempts += 1
        self.pending[ref] = outcome

    def _check_feasible(self, cell: Cell, cpus: float, gpus: float) -> None:
        """A task no node can hold waits forever: refuse it on a local Ray, warn on a cluster (it may grow)."""
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        if any(n.get("CPU", 0) >= cpus and n.get("GPU", 0) >= gpus for n in nodes):
            return
        text = (f"cell {cell.label!r} asks for {cpus:g} CPUs and {gpus:g} GPUs, more than any Ray node has "
                f"(lower train.threads, or pass --cpus-per-cell / --gpus-per-cell)")
        if self.started_here:
            raise UserError(text)
        self.echo(f"warning: {text}; it waits until the cluster has such a node")

    def submit(self, index: int, cell: Cell) -> None:
        self._launch(Outcome(index, cell, attempts=0))

    def finished(self) -> Iterator[Outcome]:
        ray = self.ray
        while self.pending:
            try:
                done, _ = ray.wait(list(self.pending), num_returns=1)
            except KeyboardInterrupt:
                if self.terminated:  # Ray answers any exception of a signal handler with a plain KeyboardInterrupt
                    raise Terminated() from None
                raise
            ref = done[0]
            outcome = self.pending.pop(ref)
            try:
                outcome.row, outcome.error = ray.get(ref), None
            except ray.exceptions.RayTaskError as err:  # the cell raised: our own retries
                cause = getattr(err, "cause", None)
                outcome.error = str(cause).splitlines()[0] if isinstance(cause, RuntimeError) else error_summary(err)
                outcome.errors.append(outcome.error)
                if outcome.attempts <= self.retries:
                    self.echo(f"  {outcome.cell.label}: attempt {outcome.attempts} failed ({outcome.error}); retrying")
                    self._launch(outcome)
                    continue
            except ray.exceptions.RayError as err:  # worker or node lost beyond Ray's own retries
                outcome.error = f"{error_summary(err)} (after {self.retries} Ray retries)"
                outcome.errors.append(outcome.error)
            yield outcome

    def close(self) -> None:
        for ref in list(self.pending):
            self.ray.cancel(ref, force=True)
        self.pending.clear()
        if self.started_here:
            self.ray.shutdown()


def make_executor(kind: str = "sequential", *, address: str | None = None, cpus_per_cell: float | None = None,
                  gpus_per_cell: float | None = None, retries: int | None = None, progress: bool = True,
                  echo=print) -> Executor:
    """The executor a command line asks for; options of the Ray executor are refused for the sequential one."""
    if kind == "sequential":
        extra = [flag for flag, value in (("--address", address), ("--cpus-per-cell", cpus_per_cell),
                                          ("--gpus-per-cell", gpus_per_cell)) if value is not None]
        if extra:
            raise UserError(f"{', '.join(extra)} only apply to --executor ray")
        return SequentialExecutor(retries=retries or 0, progress=progress, echo=echo)
    if kind == "ray":
        return RayExecutor(address=address, cpus_per_cell=cpus_per_cell, gpus_per_cell=gpus_per_cell,
                           retries=2 if retries is None else retries, echo=echo)
    raise UserError(f"--executor {kind!r}: choose sequential or ray")
