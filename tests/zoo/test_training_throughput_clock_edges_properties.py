"""The two throughput clocks (zoo.training.throughput.Throughput) at their edges: the seconds after the warm-up's
last step are steady seconds from that instant on, whatever stops the clock next, and a pause of a stopped clock
(a finished run, the end of training) leaves it stopped. Time is a hand-advanced clock here, never measured."""
import pytest
import torch

from zoo.training.throughput import Throughput

from . import test_throughput

clock = test_throughput.clock  # the hand-advanced clock, a fixture


def _seconds():
    return float(torch.empty(()).uniform_(0.5, 50.0))


@pytest.mark.parametrize("stop", ["pause", "stop", "save"])
def test_seconds_after_the_warmups_last_step_are_steady(clock, stop):
    warm = int(torch.randint(2, 5, ()))
    per_step = [_seconds() for _ in range(warm)]
    after = _seconds()
    t = Throughput()
    t.start(torch.device("cpu"), warm)
    for dt in per_step:
        clock.now += dt
        t.step()
    clock.now += after  # the next step runs, not yet finished
    if stop == "pause":
        with t.paused():
            clock.now += 1000.0  # an evaluation
    elif stop == "stop":
        t.stop()
    else:
        t.state_dict()
    assert t.warmup_seconds == pytest.approx(sum(per_step))
    assert t.steady_seconds == pytest.approx(after)


def test_pausing_a_stopped_clock_leaves_it_stopped(clock):
    t = Throughput()
    t.start(torch.device("cpu"), 2)
    for _ in range(int(torch.randint(3, 6, ()))):
        clock.now += _seconds()
        t.step()
    t.stop()
    totals = (t.warmup_seconds, t.steady_seconds, t.steady_steps)
    with t.paused():
        clock.now += _seconds()
    clock.now += _seconds()
    t.stop()
    assert (t.warmup_seconds, t.steady_seconds, t.steady_steps) == totals
