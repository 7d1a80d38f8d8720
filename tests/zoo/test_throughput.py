"""Steady-state throughput (zoo.training.throughput): the warm-up and evaluation stay out of the steady
rate, the device is synchronised only where a window opens or closes, and the tables show the new columns
only for rows that have them. Time is a hand-advanced clock here, never measured."""
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zoo.experiments.results import STEADY_NOTE, render, table_columns
from zoo.recipes import resolve
from zoo.tasks import Task
from zoo.training import loop, throughput
from zoo.training.throughput import Throughput, describe, warmup_steps

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


class Clock:
    def __init__(self):
        self.now = float(torch.randint(0, 10**6, ()).item())

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(throughput, "clock", fake)
    return fake


def test_warmup_window():
    assert [warmup_steps(n) for n in (1, 10, 20, 21, 40, 1000)] == [2, 2, 2, 3, 4, 100]


def test_the_steady_rate_leaves_out_the_warmup_and_every_pause(clock):
    steps = int(torch.randint(8, 60, ()))
    warm = warmup_steps(steps)
    per_step = [float(x) for x in torch.rand(steps) + 0.1]
    per_step[0] += 50.0  # a compile
    pauses = {int(i) for i in torch.randint(1, steps, (3,))}
    t = Throughput()
    t.start(torch.device("cpu"), warm)
    for i, dt in enumerate(per_step, start=1):
        clock.now += dt
        t.step()
        if i in pauses:
            with t.paused():
                clock.now += 1000.0  # an evaluation
    t.stop()
    clock.now += 7.0  # after the run: counts nowhere
    t.stop()
    assert t.warmup_seconds == pytest.approx(sum(per_step[:warm]))
    assert t.steady_seconds == pytest.approx(sum(per_step[warm:]))
    assert t.steady_steps == steps - warm
    m = t.metrics(tokens_per_step=100)
    assert m["steady_tokens_per_second"] == pytest.approx(100 * (steps - warm) / sum(per_step[warm:]))
    assert m["warmup_seconds"] == pytest.approx(sum(per_step[:warm]))


def test_no_steady_rate_when_the_run_ends_within_its_warmup(clock):
    t = Throughput()
    t.start(torch.device("cpu"), 5)
    for _ in range(3):
        clock.now += 2.0
        t.step()
    t.stop()
    assert t.metrics(10) == {"warmup_seconds": pytest.approx(6.0), "steady_steps": 0}
    assert "no steady rate" in describe(t.metrics(10), 3)


def test_cuda_synchronises_at_window_boundaries_only(clock, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))

    def run(steps):
        calls.clear()
        t = Throughput()
        t.start(torch.device("cuda"), warmup_steps(steps))
        for i in range(steps):
            t.step()
            if i in (steps // 2, steps - 2):
                with t.paused():
                    pass
        t.stop()
        return len(calls)

    # start, the warm-up's end, two pauses (stop + resume each), the end: 7, however many steps
    assert run(30) == run(300) == 7


class _DeviceReads(TorchDispatchMode):
    """The order of a step's reads of computed values (``.item()``; not of ``host`` tensors, which stay on the
    CPU on a GPU too), the operations that use a parameter, and its updates."""

    def __init__(self, params, host=()):
        super().__init__()
        self.params = {p.data_ptr() for p in params}
        self.host = {t.data_ptr() for t in host}
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].data_ptr() not in self.host:
                self.log.append("read")
        else:
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            touches = any(torch.is_tensor(t) and t.data_ptr() in self.params for t in tensors)
            if touches:
                self.log.append("update" if func._schema.is_mutable else "use")
        return func(*args, **(kwargs or {}))


def test_a_training_step_queues_its_work_without_waiting_for_the_device(monkeypatch):
    """Between the first use of a parameter and the optimizer's last update nothing is read from the device (on
    a GPU each read waits for the queued work), nor after it within the step: the loss and hit counts of both
    micro-batches are read later, in one read of a copy of them, by ``_read``; the count of supervised tokens
    is read from the host's labels before."""
    recipe = resolve(TINY, ["train.steps=2", "train.threads=1", "train.grad_accum=2"])
    real_step, real_read, logs = loop._step, loop._read, []

    def step(run, state, *args):
        if not logs:  # the first step also compiles ahead (on a GPU)
            logs.append(None)
            return real_step(run, state, *args)
        # AdamW's step counters are CPU tensors (also on a GPU): reading them waits for nothing
        counters = [s["step"] for s in state.optimizer.state.values() if torch.is_tensor(s.get("step"))]
        with _DeviceReads(state.model.parameters(), counters) as reads:
            out = real_step(run, state, *args)
        logs.append(reads.log)
        return out

    def read(run, queued):
        logs.append(queued.sums.tolist())
        return real_read(run, queued)

    monkeypatch.setattr(loop, "_step", step)
    monkeypatch.setattr(loop, "_read", read)
    loop.train(recipe, progress=False)
    log = logs[1]  # the second step's queueing (the first step is read after it, then the second)
    first_use, last_update = log.index("use"), max(i for i, e in enumerate(log) if e == "update")
    assert first_use < last_update
    assert [i for i, e in enumerate(log) if e == "read"] == [0]  # the host's count of supervised tokens
    # then each step's two sums are read, each step's own (a copy: a captured step's outputs are rewritten)
    assert len(logs) == 4 and logs[2] != logs[3] and all(len(sums) == 2 for sums in logs[2:])


def test_a_step_is_recorded_after_the_next_is_queued_except_where_something_follows_it(monkeypatch):
    """``q k``: step k queued, ``r k``: its numbers read and recorded. Steps are read one step late, so that the
    device has the next step's work while the host waits; a step followed by the warm-up clock's end (here the
    2nd), an evaluation (every 3rd), a checkpoint (every 4th) or the run's end is read before the next is
    queued, so those see the model and the clocks of that step."""
    recipe = resolve(TINY, ["train.steps=10", "train.threads=1", "train.eval_every=3", "train.checkpoint_every=4"])
    real_step, real_read, log = loop._step, loop._read, []
    queued = iter(range(1, 11))
    monkeypatch.setattr(loop, "_step", lambda *a: (log.append(f"q{next(queued)}"), real_step(*a))[1])
    monkeypatch.setattr(loop, "_read", lambda run, q: (log.append(f"r{len([e for e in log if e[0] == 'r']) + 1}"),
                                                       real_read(run, q))[1])
    loop.train(recipe, progress=False)
    assert " ".join(log) == "q1 q2 r1 r2 q3 r3 q4 r4 q5 q6 r5 r6 q7 q8 r7 r8 q9 r9 q10 r10"
def test_a_resumed_process_warms_up_again_and_the_totals_carry_over(clock):
    first = Throughput()
    first.start(torch.device("cpu"), 2)
    for dt in (30.0, 1.0, 1.0, 1.0):
        clock.now += dt
        first.step()
    saved = first.state_dict()   # a checkpoint mid-run holds the running lap too
    second = Throughput()
    second.load_state_dict(saved)
    second.start(torch.device("cpu"), 2)
    for dt in (20.0, 1.0, 2.0):
        clock.now += dt
        second.step()
    second.stop()
    assert second.warmup_seconds == pytest.approx(31.0 + 21.0)
    assert second.steady_steps == 2 + 1 and second.steady_seconds == pytest.approx(2.0 + 2.0)
    empty = Throughput()
    empty.load_state_dict(None)  # a checkpoint from before these clocks
    assert empty.state_dict() == {"warmup_seconds": 0.0, "steady_seconds": 0.0, "steady_steps": 0}


def test_train_reports_the_steady_rate_without_its_evaluations(clock, monkeypatch):
    steps, every = 10, 3
    recipe = resolve(TINY, [f"train.steps={steps}", f"train.eval_every={every}", "train.threads=1"])
    real_step, real_eval = loop._step, loop.evaluate_data
    compile_seconds = 40.0 + float(torch.rand(()))

    queued = []

    def step(run, state, *args):  # the first step queued compiles (steps are recorded one step late at times)
        clock.now += 1.0 if queued else compile_seconds
        queued.append(state.step)
        return real_step(run, state, *args)

    def evaluate(*args, **kwargs):
        clock.now += 500.0
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(loop, "_step", step)
    monkeypatch.setattr(loop, "evaluate_data", evaluate)
    m = loop.train(recipe, progress=False).metrics
    warm = warmup_steps(steps)
    tokens = recipe.train.batch_size * Task.from_spec(recipe.task).seq_len
    assert m["steady_steps"] == steps - warm
    assert m["warmup_seconds"] == pytest.approx(compile_seconds + warm - 1)
    assert m["steady_tokens_per_second"] == pytest.approx(tokens)  # one step per (fake) second
    assert m["train_tokens_per_second"] == pytest.approx(steps * tokens / m["train_seconds"])
    line = describe(m, steps)
    assert f"steady {tokens:,} tokens/s" in line and f"({warm} steps, compile included)" in line
    assert "overall" in line


def _row(metrics, seed=0):
    return {"label": "cell", "recipe": {"model": {"layers": ["gla"]}, "seed": seed}, "metrics": metrics}


def test_tables_show_the_steady_columns_only_for_rows_that_have_them(tmp_path):
    old = {"val_bpb": 2.0, "val_ppl": 4.0, "params": 10, "state_size": 5, "train_tokens_per_second": 1e4,
           "steps": 10, "train_seconds": 3.0}
    assert "steady_tokens_per_second" not in table_columns([_row(old)])
    render([_row(old)], tmp_path, plot=False)
    assert STEADY_NOTE not in (tmp_path / "results.md").read_text()
    new = {**old, "steady_tokens_per_second": 3e4, "warmup_seconds": 1.5, "steady_steps": 8}
    columns = table_columns([_row(old), _row(new, seed=1)])
    at = columns.index("steady_tokens_per_second")
    assert columns[at:at + 3] == ["steady_tokens_per_second", "warmup_seconds", "train_tokens_per_second"]
    render([_row(old), _row(new, seed=1)], tmp_path, plot=False)
    text = (tmp_path / "results.md").read_text()
    assert STEADY_NOTE in text and "30000" in text
