"""``zoo bench`` on tiny sizes: the files it writes, the decode-state scaling law of each mixer, the
ratio-to-attention column, CPU time and peak memory per row, the time limit that stops attention, and that a
mixer failing at some T is recorded without losing other rows. (No timing is asserted: timings are only
recorded.)"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from zoo.benchmark import runner as bench
from zoo.errors import UserError
from zoo.experiments.results import bench_with_ratios


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    return parser.parse_intermixed_args(["--mixers", "attention,mamba2", "--seq-lens", "16,32", "model.d_model=32",
                              "--repeats", "1", "--warmup", "1", "--threads", "1", "--no-progress",
                              "--out", str(tmp_path), *extra])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    code = bench.run(_args(out))
    assert torch.get_num_threads() == threads, "bench must restore the thread count"
    assert code == 0
    return out, json.loads((out / "bench.json").read_text())


def test_files_written(result):
    out, data = result
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| mixer" in md and "fwd+bwd / attention" in md and "mamba2" in md
    assert data["machine"]["versions"]["torch"] == torch.__version__ and data["machine"]["threads"] == 1
    rows = data["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [("attention", 16), ("attention", 32), ("mamba2", 16), ("mamba2", 32)]
    for r in rows:
        assert r["error"] is None, r["error"]
        for key in ("fwd_ms", "fwd_bwd_ms", "decode_ms", "tok_s_train", "saved_mib"):
            assert r[key] > 0, key
        assert r["tok_s_train"] == pytest.approx(r["T"] / (r["fwd_bwd_ms"] / 1e3))
        for name in ("fwd", "fwd_bwd", "decode"):  # CPU time of the timed calls: user and system apart
            user, system, calls = r[name + "_cpu"]
            assert calls == 1 and user >= 0 and system >= 0
            assert r[name + "_user_ms"] == pytest.approx(user * 1e3) and r[name + "_sys_ms"] == pytest.approx(system * 1e3)
        for key in ("peak_mib", "prefill_peak_mib"):  # resident-set peaks: measured on Linux, n/a elsewhere
            assert r[key] is None or r[key] >= 0
    run = data["run"]
    assert run["wall_s"] > 0 and run["user_s"] + run["sys_s"] > 0
    assert "Whole run:" in md and "sys %" in md and "prefill peak MiB" in md


def test_decode_state_scaling(result):
    _, data = result
    by = {(r["mixer"], r["T"]): r for r in data["rows"]}
    a16, a32 = by["attention", 16]["state_bytes"], by["attention", 32]["state_bytes"]
    assert a32 / a16 == 32 / 16  # the KV cache grows exactly linearly
    assert a16 == 4 * by["attention", 16]["state_size"]  # fp32: bytes = 4 * the mixer's own element count
    assert by["mamba2", 16]["state_bytes"] == by["mamba2", 32]["state_bytes"] > 0  # constant state
    assert by["mamba2", 16]["state_bytes"] == 4 * by["mamba2", 16]["state_size"]


def test_ratio_to_attention(result):
    _, data = result
    rows = bench_with_ratios(data["rows"])
    by = {(r["mixer"], r["T"]): r for r in rows}
    assert by["attention", 16]["fwd_bwd_ms_vs_baseline"] == 1.0
    m = by["mamba2", 32]
    assert m["fwd_bwd_ms_vs_baseline"] == pytest.approx(m["fwd_bwd_ms"] / by["attention", 32]["fwd_bwd_ms"])


def test_error_at_one_length_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    from mixers.attention import Attention

    original = Attention.forward

    def flaky(self, x, mask=None):
        if x.shape[1] > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return original(self, x, mask)

    monkeypatch.setattr(Attention, "forward", flaky)
    args = _args(tmp_path, "--no-plot", "--no-decode", "model.mixer_options.attention.backend=torch")
    assert bench.run(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    by = {(r["mixer"], r["T"]): r for r in rows}
    assert len(rows) == 4
    assert by["attention", 16]["error"] is None and by["attention", 16]["label"] == "attention"
    err = by["attention", 32]["error"]
    assert "OOM" in err and "forward" in err and by["attention", 32].get("fwd_ms") is None
    assert by["mamba2", 32]["error"] is None and by["mamba2", 32]["fwd_bwd_ms"] > 0
    assert "OOM" in (tmp_path / "bench.md").read_text()


def test_bad_arguments_are_one_line_recipe_errors(tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    args = parser.parse_intermixed_args(["--mixers", "atention", "--out", str(tmp_path), "--no-progress"])
    with pytest.raises(UserError, match="did you mean 'attention'"):  # names the nearest valid mixer
        bench.run(args)
    args = parser.parse_intermixed_args(["--mixers", "mamba2", "model.mixer_options.mamba2.d_stat=8",
                                         "--out", str(tmp_path)])
    with pytest.raises(UserError, match="did you mean 'd_state'"):  # the same overrides as every command
        bench.run(args)
    args = parser.parse_intermixed_args(["--mixers", "[attention, attention]", "--out", str(tmp_path)])
    with pytest.raises(UserError, match="twice"):
        bench.run(args)
    out = subprocess.run([sys.executable, "-m", "zoo", "bench", "--mixers", "mamba2", "--out", str(tmp_path),
                          "model.mixer_options.mamba2.headdim=0"], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_growth_column_is_the_time_ratio_between_successive_lengths(result):
    out, data = result
    rows = bench_with_ratios(data["rows"])
    by = {(r["mixer"], r["T"]): r for r in rows}
    m = by["mamba2", 32]
    assert m["fwd_bwd_growth"] == pytest.approx(m["fwd_bwd_ms"] / by["mamba2", 16]["fwd_bwd_ms"])
    assert m["T_growth"] == 2 and "fwd_bwd_growth" not in by["mamba2", 16]
    assert f"{m['fwd_bwd_growth']:.2f}x (T x2)" in (out / "bench.md").read_text()


def test_two_backends_of_one_mixer(tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    args = parser.parse_intermixed_args(["--mixers", "[{attention: {backend: torch}}, {attention: {backend: reference}}]",
                              "--seq-lens", "16", "model.d_model=32", "--repeats", "1", "--threads", "1",
                              "--no-progress", "--no-plot", "--no-decode", "--out", str(tmp_path)])
    assert bench.run(args) == 0
    rows = bench_with_ratios(json.loads((tmp_path / "bench.json").read_text())["rows"])
    assert [r["label"] for r in rows] == ["attention(backend=torch)", "attention(backend=reference)"]
    assert rows[0]["fwd_bwd_ms_vs_baseline"] == 1.0 and rows[1]["fwd_bwd_ms_vs_baseline"] > 0


def test_rounds_pool_every_repetition(tmp_path):
    """--rounds 3 --repeats 2: each row keeps 6 timings, reports their median, and is measured once for
    memory; the rows stay one per (mixer, T), in sweep order."""
    import statistics

    code = bench.run(_args(tmp_path, "--rounds", "3", "--repeats", "2", "--no-plot"))
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["config"]["rounds"] == 3
    rows = data["rows"]
    assert [(r["mixer"], r["T"]) for r in rows] == [("attention", 16), ("attention", 32), ("mamba2", 16), ("mamba2", 32)]
    for r in rows:
        assert r["error"] is None and r["rounds"] == 3
        for key in ("fwd_ms", "fwd_bwd_ms", "decode_ms"):
            assert len(r[key + "_samples"]) == 6
            assert r[key] == statistics.median(r[key + "_samples"])
        assert r["tok_s_train"] == pytest.approx(r["T"] / (r["fwd_bwd_ms"] / 1e3))
        assert r["fwd_bwd_cpu"][2] == 6  # the CPU time is pooled over the same repetitions
    assert "3 rounds x 2" in (tmp_path / "bench.md").read_text()


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="--rounds"):
        bench.run(_args(tmp_path, "--rounds", "0"))


@pytest.mark.parametrize("flag, value, wanted", [("--batch", "0", "must be a positive integer"),
                                                 ("--repeats", "-2", "must be a positive integer"),
                                                 ("--rounds", "0", "must be a positive integer"),
                                                 ("--threads", "0", "must be a positive integer"),
                                                 ("--warmup", "-1", "must be 0 or more"),
                                                 ("--time-limit", "nan", "must be >= 0 seconds"),
                                                 ("--device", "gpu0", "not a device")])
def test_a_flag_out_of_range_is_named_with_its_value(tmp_path, flag, value, wanted):
    with pytest.raises(UserError) as refused:
        bench.run(_args(tmp_path, flag, value))
    assert str(refused.value).startswith(f"{flag} {value}: {wanted}"), refused.value


def test_time_limit_stops_attention_and_says_so(tmp_path, monkeypatch):
    """Every measurement takes 1 s (a stand-in for measure): at 4x the length attention is predicted at
    16 s (quadratic), mamba2 at 4 s (linear); a 10 s limit skips attention's row with the reason and
    measures mamba2's."""
    def fake_measure(mixer, T, *args, **kwargs):
        return {"fwd_ms": 500.0, "fwd_bwd_ms": 1000.0, "error": None}

    monkeypatch.setattr(bench, "measure", fake_measure)
    args = _args(tmp_path, "--no-plot", "--no-decode", "--time-limit", "10")
    args.seq_lens = [16, 64]
    assert bench.run(args) == 0
    by = {(r["mixer"], r["T"]): r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert by["attention", 64]["error"] == "skipped: fwd+bwd predicted 16 s > --time-limit 10 s"
    assert by["attention", 64].get("fwd_bwd_ms") is None
    assert by["mamba2", 64]["error"] is None and by["mamba2", 64]["fwd_bwd_ms"] == 1000.0
    assert "skipped: fwd+bwd predicted 16 s" in (tmp_path / "bench.md").read_text()
    # on a CPU the prediction is made from the CPU time (a loaded machine's wall time counts the waits too):
    # 0.1 s of CPU per call predicts 1.6 s for attention at 4x the length, under the limit
    monkeypatch.setattr(bench, "measure", lambda *a, **k: {**fake_measure(*a), "fwd_bwd_user_ms": 90.0,
                                                           "fwd_bwd_sys_ms": 10.0})
    assert bench.run(args) == 0
    by = {(r["mixer"], r["T"]): r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert by["attention", 64]["error"] is None and by["attention", 64]["fwd_bwd_ms"] == 1000.0


def test_time_limit_zero_means_no_limit_and_negative_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *a, **k: {"fwd_bwd_ms": 1e9, "error": None})
    args = _args(tmp_path, "--no-plot", "--no-decode", "--time-limit", "0")
    assert bench.run(args) == 0
    assert all(r["error"] is None for r in json.loads((tmp_path / "bench.json").read_text())["rows"])
    with pytest.raises(UserError, match="--time-limit"):
        bench.run(_args(tmp_path, "--time-limit", "-1"))


def test_long_lengths_are_accepted():
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    args = parser.parse_intermixed_args(["--seq-lens", "4096,16384,65536,262144"])
    assert args.seq_lens == [4096, 16384, 65536, 262144] and args.time_limit == 60.0


def _row(label, mixer, T, wall_ms, cpu_ms, sys_ms, peak):
    return {"label": label, "mixer": mixer, "T": T, "fwd_bwd_ms": wall_ms, "tok_s_train": T / (wall_ms / 1e3),
            "fwd_bwd_user_ms": cpu_ms - sys_ms, "fwd_bwd_sys_ms": sys_ms, "fwd_bwd_cpu": [(cpu_ms - sys_ms) / 1e3,
            sys_ms / 1e3, 1], "peak_mib": peak, "prefill_peak_mib": peak / 2, "decode_ms": 0.5}


def test_scaling_report_checks_every_target():
    """mamba2 grows 4x per 4x T in wall, CPU and memory (every target met); gla grows 5x (growth missed; its
    tok/s ratio is exactly 0.8, met), with 20 % system time at the first length and memory growing 5x (1.25x
    the memory per token: more than 15 % above linear)."""
    from zoo.benchmark.scaling import mixer_scaling, report

    rows = [_row("mamba2", "mamba2", 4096, 100, 90, 1, 100), _row("mamba2", "mamba2", 16384, 400, 360, 4, 400),
            _row("gla", "gla", 4096, 100, 100, 20, 100), _row("gla", "gla", 16384, 500, 400, 4, 500),
            {"label": "attention", "mixer": "attention", "T": 16384, "error": "skipped: ..."}]
    m = mixer_scaling(rows[:2], 4.6, 0.8, 0.15)
    assert m["wall"] == [4.0] and m["cpu"] == [4.0] and m["memory"] == [4.0] and m["tok"] == 1.0
    assert m["memory_per_token"] == [1.0]
    assert all(m["checks"].values()) and m["prefill_peak"] == 200
    g = mixer_scaling(rows[2:4], 4.6, 0.8, 0.15)
    assert g["wall"] == [5.0] and g["sys"] == pytest.approx(0.2) and g["tok"] == pytest.approx(0.8)
    assert g["memory_per_token"] == [1.25] and mixer_scaling(rows[2:4], 4.6, 0.8, 0.15, memory_slack=0.3)["checks"]["memory"]
    assert {k for k, v in g["checks"].items() if not v} == {"growth", "sys", "memory"}
    text, ok = report({"rows": rows})
    assert not ok and "missed: growth, sys, memory" in text and "n/a (state grows with T)" in text
    _, ok = report({"rows": rows[:2]})
    assert ok
