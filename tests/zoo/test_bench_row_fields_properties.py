"""A ``zoo bench`` row's numbers against a hand computation: each time is the median of its repetitions in
milliseconds, tokens per second are ``batch * T`` over that time in seconds, CPU time per call is the summed
CPU seconds over the summed calls in milliseconds, and pooling a later round recomputes all of them."""
import statistics

import pytest
import torch

from mixers import build_mixer
from zoo.benchmark import measure as measure_module
from zoo.benchmark.measure import measure, merge_samples


def _samples(n: int) -> list[float]:
    """Repetition times in ms, far apart, so that a mean and a median differ."""
    return (torch.rand(n, dtype=torch.float64) ** 4 * 500 + 0.05).tolist()


def _cpu() -> tuple[float, float, int]:
    user, system = (torch.rand(2, dtype=torch.float64) * 2).tolist()
    return user, system, int(torch.randint(1, 9, ()))


def _expect_time(row: dict, name: str, samples: list[float], cpu: list[tuple]) -> None:
    stem = name.removesuffix("_ms")
    assert row[name + "_samples"] == samples
    assert row[name] == pytest.approx(statistics.median(samples), rel=1e-12)
    user, system, calls = (sum(c[i] for c in cpu) for i in range(3))
    assert row[stem + "_user_ms"] == pytest.approx(user / calls * 1000, rel=1e-12)
    assert row[stem + "_sys_ms"] == pytest.approx(system / calls * 1000, rel=1e-12)


def test_a_measured_row_reports_medians_in_ms_and_tokens_per_second(monkeypatch):
    batch, T = int(torch.randint(2, 5, ())), int(torch.randint(3, 17, ()))
    repeats = int(torch.randint(2, 7, ()))
    handed: list[tuple[list[float], tuple]] = []

    def fake_times(fn, device, warmup, repeats, cpu=None):
        fn()
        samples, used = _samples(repeats), _cpu()
        if cpu is not None:
            cpu.append(used)
        handed.append((samples, used))
        return samples

    monkeypatch.setattr(measure_module, "times_ms", fake_times)
    layer = build_mixer("attention", 16, {})
    row = measure(layer, T, batch, torch.device("cpu"), torch.float32, 0, repeats, decode=True, memory=False)
    assert row["error"] is None and len(handed) == 3
    tokens = batch * T
    for name, (samples, used) in zip(("fwd_ms", "fwd_bwd_ms", "decode_ms"), handed):
        _expect_time(row, name, samples, [used])
    assert row["tok_s_fwd"] == pytest.approx(tokens / (statistics.median(handed[0][0]) / 1000), rel=1e-12)
    assert row["tok_s_train"] == pytest.approx(tokens / (statistics.median(handed[1][0]) / 1000), rel=1e-12)


def test_pooling_a_later_round_recomputes_every_number():
    batch, T = int(torch.randint(2, 9, ())), int(torch.randint(16, 4097, ()))
    row, again, kept = {"batch": batch, "T": T}, {}, {}
    for name in ("fwd_ms", "fwd_bwd_ms", "decode_ms"):
        stem = name.removesuffix("_ms")
        first, later = _samples(int(torch.randint(1, 6, ()))), _samples(int(torch.randint(1, 6, ())))
        cpu_first, cpu_later = _cpu(), _cpu()
        row[name + "_samples"], row[name], row[stem + "_cpu"] = first, statistics.median(first), list(cpu_first)
        again[name + "_samples"], again[name], again[stem + "_cpu"] = later, statistics.median(later), list(cpu_later)
        kept[name] = (first + later, [cpu_first, cpu_later])
    merge_samples(row, again)
    for name, (samples, cpu) in kept.items():
        _expect_time(row, name, samples, cpu)
    for key, name in (("tok_s_fwd", "fwd_ms"), ("tok_s_train", "fwd_bwd_ms")):
        assert row[key] == pytest.approx(batch * T / (statistics.median(kept[name][0]) / 1000), rel=1e-12)
