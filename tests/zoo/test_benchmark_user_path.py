"""A researcher benchmarking mixers for a paper, as README, BENCHMARKS.md and ``--help`` tell them to: the numbers
``zoo bench`` and ``python -m zoo.benchmark.scaling`` report, checked against independent counts (a stand-in for
the measurement that returns known times), and the plausible mistakes on their command lines refused in one
line (a device the benchmark cannot time, a length listed twice, a result file that is not one, a mixer that is
not registered). No timing is asserted."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from zoo.benchmark import layer_resources, scaling
from zoo.benchmark import runner as bench
from zoo.errors import UserError


def _args(tmp_path, *extra, mixers: str = "mamba2", seq_lens: str = "16,32"):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    return parser.parse_intermixed_args(["--mixers", mixers, "--seq-lens", seq_lens, "model.d_model=16",
                                         "--repeats", "1", "--threads", "1", "--no-progress", "--no-plot",
                                         "--no-decode", "--out", str(tmp_path), *extra])


def _rows(tmp_path) -> dict:
    return {(r["label"], r["T"]): r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}


@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_a_device_bench_cannot_time_is_refused_before_any_row(tmp_path, device):
    """``--help`` offers auto, cpu or cuda[:i]. On ``meta`` tensors nothing is computed, so every "time" would be
    the dispatch's and every memory number 0: rows that look measured and are not. ``mps``/``xpu`` built into no
    row at all. Each is refused in one line naming the choices, and no folder is written."""
    out = tmp_path / "out"
    with pytest.raises(UserError) as refused:
        bench.run(_args(out, "--device", device))
    assert str(refused.value).startswith(f"--device {device}:") and "cpu" in str(refused.value)
    assert not out.exists()


def test_a_cuda_device_this_machine_does_not_have_is_named(tmp_path, monkeypatch):
    """``--device cuda:3`` on a machine with one or two GPUs: one line naming the devices there are (not a traceback
    from reading the name of a device that does not exist)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    count = int(torch.randint(1, 3, ()))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(UserError, match=rf"--device cuda:3: this machine has {count} CUDA device"):
        bench.run(_args(tmp_path / "out", "--device", "cuda:3"))
    assert not (tmp_path / "out").exists()


def test_a_length_listed_twice_is_refused():
    """``--seq-lens 16,32,16`` would give a mixer two rows at one length: its growth column "(T x1)" and its
    ratio to the baseline divided by the other row of the same length."""
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    T = int(torch.randint(2, 100, ()))
    with pytest.raises(SystemExit):
        parser.parse_args(["--seq-lens", f"{T},{T + 1},{T}"])
    with pytest.raises(argparse.ArgumentTypeError, match=rf"{T} listed twice"):
        bench._int_list(f"{T},{T + 1},{T}")
    assert bench._int_list(f"{T + 1},{T}") == [T + 1, T]


def test_the_time_limit_still_applies_after_a_length_whose_backward_failed(tmp_path, monkeypatch):
    """fwd+bwd takes 1 s at T 16 and runs out of memory at T 32 (its forward still timed). At T 256 the time
    limit of 10 s must predict from the last length that timed a fwd+bwd, 16 x 1 s = 16 s (linear): skipped,
    not measured without a limit because the row just before it has no fwd+bwd time."""
    def fake_measure(mixer, T, *args, **kwargs):
        if T == 32:
            return {"fwd_ms": 400.0, "error": "forward+backward: OOM: out of memory"}
        return {"fwd_ms": 400.0, "fwd_bwd_ms": 1000.0, "error": None}

    monkeypatch.setattr(bench, "measure", fake_measure)
    assert bench.run(_args(tmp_path, "--time-limit", "10", seq_lens="16,32,256")) == 0
    rows = _rows(tmp_path)
    assert rows["mamba2", 32]["error"].startswith("forward+backward: OOM")
    assert rows["mamba2", 256]["error"] == "skipped: fwd+bwd predicted 16 s > --time-limit 10 s"
    assert rows["mamba2", 256].get("fwd_ms") is None


def _bench_row(label: str, mixer: str, T: int, ms: float) -> dict:
    return {"label": label, "mixer": mixer, "T": T, "fwd_bwd_ms": ms, "tok_s_train": T / (ms / 1e3),
            "fwd_bwd_user_ms": ms, "fwd_bwd_sys_ms": 0.0, "fwd_bwd_cpu": [ms / 1e3, 0.0, 1],
            "peak_mib": T / 64, "prefill_peak_mib": T / 128, "decode_ms": 0.5}


def test_bench_rows_say_whether_the_state_grows_and_scaling_reads_it(tmp_path, monkeypatch):
    """A mixer of one's own (``zoo bench --recipe`` with ``imports:``) is in ``bench.json``; ``scaling`` is run
    in another process, where it is not registered. Each row records whether the mixer's state grows with T, and
    the report judges the rows by that: targets for a linear-state mixer, none for a growing one."""
    monkeypatch.setattr(bench, "measure", lambda *a, **k: {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0, "error": None})
    assert bench.run(_args(tmp_path, mixers="attention,mamba2")) == 0
    rows = _rows(tmp_path)
    assert all(rows["attention", T]["state_grows_with_seq_len"] is True for T in (16, 32))
    assert all(rows["mamba2", T]["state_grows_with_seq_len"] is False for T in (16, 32))
    ms = float(torch.rand(()) * 100 + 1)
    own = [_bench_row("mine", "my_own_mixer", T, ms * T / 64) for T in (64, 256)]
    grows = [{**r, "label": "cache", "mixer": "my_own_cache", "fwd_bwd_ms": r["fwd_bwd_ms"] * r["T"] / 16} for r in own]
    for r in own:
        r["state_grows_with_seq_len"] = False
    for r in grows:
        r["state_grows_with_seq_len"] = True
    text, ok = scaling.report({"rows": own + grows})
    assert ok, text
    assert "| mine | 4.00x |" in text and "all met" in text and "n/a (state grows with T)" in text


def _scaling_cli(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoo.benchmark.scaling", str(path)], capture_output=True, text=True)


def test_scaling_refuses_what_is_not_a_bench_result_in_one_line(tmp_path):
    """A missing file, a file that is not JSON, JSON that is not a ``zoo bench`` result, and an older result whose
    mixer is not registered here (rows without ``state_grows_with_seq_len``): one line each naming the file and
    what to do, exit status 2, no traceback."""
    row = _bench_row("mine", "my_own_mixer", 64, 10.0)
    cases = {"missing.json": None, "text.json": "not json {", "other.json": json.dumps({"cells": []}),
             "older.json": json.dumps({"rows": [row]})}
    wanted = {"missing.json": "no such file", "text.json": "not JSON", "other.json": "not a zoo bench result",
              "older.json": "my_own_mixer"}
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        done = _scaling_cli(path)
        assert done.returncode == 2, (name, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, (name, done.stderr)
        assert str(path) in done.stderr and wanted[name] in done.stderr, (name, done.stderr)


def test_layer_resources_refuses_an_unknown_mixer_in_one_line(capsys):
    """``python -m zoo.benchmark.layer_resources atention``: the usage error names the mixers it can compile,
    before any kernel is compiled."""
    with pytest.raises(SystemExit) as stopped:
        layer_resources.main(["atention"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "unknown mixers ['atention']" in err and "attention" in err and "Traceback" not in err
