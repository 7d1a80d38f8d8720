"""What the benchmark reports say from synthetic measurements (nothing is timed): the long-context scaling
targets miss a linear-state mixer that was not measured at every length, the GPU speed summary of a run whose
first-call stage had no time left says "not measured" for it, a run into a folder of an earlier one leaves no
earlier summary behind to be judged as its own, the kernel ratio is never one of two runs, ``zoo bench``'s time
limit predicts a length from the wall time when the CPU time adds up several threads, and its rounds pool every
row that has timings, one whose decode failed included."""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import pytest

from zoo.benchmark import gpu_report, gpu_speed
from zoo.benchmark import runner as bench
from zoo.benchmark.gpu_speed import DRY, mixer_names
from zoo.benchmark.runner import _predicted_seconds, write_json
from zoo.benchmark.scaling import mixer_scaling, report


def _row(T: int, wall_ms: float, peak: float, label: str = "mamba2") -> dict:
    return {"label": label, "mixer": label, "T": T, "fwd_bwd_ms": wall_ms, "tok_s_train": T / (wall_ms / 1e3),
            "fwd_bwd_user_ms": wall_ms, "fwd_bwd_sys_ms": 0.0, "fwd_bwd_cpu": [wall_ms / 1e3, 0.0, 1],
            "peak_mib": peak, "prefill_peak_mib": peak / 2, "decode_ms": 0.5}


@pytest.mark.parametrize("missing", ["skipped: fwd+bwd predicted 70 s > --time-limit 60 s",
                                     "forward+backward: OOM: out of memory"])
def test_a_linear_mixer_not_measured_at_every_length_misses_the_scaling_targets(missing):
    """Measured at 4096 only (16384 and 65536 failed or skipped): nothing shows the targets hold there."""
    rows = [_row(4096, 100.0, 100.0),
            {"label": "mamba2", "mixer": "mamba2", "T": 16384, "error": missing},
            {"label": "mamba2", "mixer": "mamba2", "T": 65536, "error": missing}]
    text, ok = report({"rows": rows})
    assert not ok and "missed: lengths" in text
    s = mixer_scaling(rows, 4.6, 0.8, 0.15)
    assert s["skipped"] == [16384, 65536] and not s["checks"]["lengths"]
    # every length measured and linear: every target met
    full = [_row(4096, 100.0, 100.0), _row(16384, 400.0, 400.0), _row(65536, 1600.0, 1600.0)]
    assert report({"rows": full})[1]
    # the longest length lost: the growth of the two measured ones is fine, the verdict is not
    assert not report({"rows": full[:2] + [rows[2]]})[1]
    # a run of one length shows no growth at all
    assert not report({"rows": full[:1]})[1]


def _env(folder, plan=DRY):
    names, linear = mixer_names()
    write_json(folder / "env.json", {"card": "c (dry run)", "commit": "x", "folder": "bench-gpu-cpu",
                                     "plan": dataclasses.asdict(plan), "mixers": names, "linear": linear,
                                     "environment": {"versions": {"torch": "0"}}})
    return names


def test_a_first_call_stage_with_no_time_left_is_not_measured(tmp_path, capsys):
    """The driver writes ``{"stopped": "not run: ...", "rows": []}`` for a stage the budget left no time for
    (``--budget 30``: every stage but fla); the summary says so for every mixer's first call."""
    names = _env(tmp_path)
    spent = "not run: the run's time budget was spent"
    for stage in ("first_call", "kernel", "layers", "lm"):
        write_json(tmp_path / f"{stage}.json", {"stopped": spent, "rows": []})
    summary, _ = gpu_report.summarize(tmp_path)
    assert summary["first_call_s"] == {n: f"not measured: the first_call stage {spent}" for n in names}
    assert gpu_report.conclude(tmp_path) == 3   # nothing missed, nothing measured
    assert "## First call" in (tmp_path / "summary.md").read_text()


def test_a_run_stopped_before_its_summary_leaves_no_earlier_summary(tmp_path, monkeypatch):
    """An earlier run's summary in the folder, then a run of one stage stopped (killed) inside it: the folder
    holds no summary, so ``--check`` builds one from the stage files instead of the earlier run's verdicts."""
    folder = tmp_path / "bench-gpu-cpu"
    folder.mkdir()
    names, linear = mixer_names()
    stale = {"card": "c", "commit": "earlier", "kernel_vs_fla": {"delta_rule": {"64": 1.0, "256": 1.0}},
             "layer_vs_sdpa": {n: {"64": 0.1, "256": 0.1} for n in linear},
             "lm_vs_attention": {n: {"32": 2.0, "128": 2.0} for n in linear},
             "launches": {n: {"64": 5, "256": 5} for n in names}, "first_call_s": {n: 1.0 for n in names}}
    write_json(folder / "summary.json", stale)
    (folder / "summary.md").write_text("# GPU speed: the earlier run\n")

    def killed(fn, args, env, seconds):
        if fn is gpu_speed.stage_env:
            fn(*args)   # the CPU plan: no CUDA is touched
            return None
        raise KeyboardInterrupt  # the run is stopped while this stage runs

    monkeypatch.setattr(gpu_speed, "in_child", killed)
    with pytest.raises(KeyboardInterrupt):
        gpu_speed.run(DRY, tmp_path, stages=("kernel",))
    assert not (folder / "summary.json").exists() and not (folder / "summary.md").exists()
    assert gpu_speed.main(["--check", str(folder)]) == 3
    rebuilt = json.loads((folder / "summary.json").read_text())
    assert rebuilt["commit"] != "earlier"
    assert all(str(v).startswith("not measured") for v in rebuilt["kernel_vs_fla"]["delta_rule"].values())


def test_the_time_limit_predicts_from_the_lesser_of_wall_and_cpu_time():
    """At 4x the length a linear mixer takes 4x: 1 s of wall time per call predicts 4 s, whether its CPU time
    is 4 s (four busy threads) or 0.1 s (one thread on a machine whose other work kept it waiting)."""
    row = {"T": 16, "device": "cpu", "fwd_bwd_ms": 1000.0, "fwd_bwd_user_ms": 3900.0, "fwd_bwd_sys_ms": 100.0}
    assert _predicted_seconds(row, 64, False) == pytest.approx(4.0)
    assert _predicted_seconds(row, 64, True) == pytest.approx(16.0)
    waited = {**row, "fwd_bwd_user_ms": 90.0, "fwd_bwd_sys_ms": 10.0}
    assert _predicted_seconds(waited, 64, False) == pytest.approx(0.4)
    on_gpu = {**row, "device": "cuda:0"}
    assert _predicted_seconds(on_gpu, 64, False) == pytest.approx(4.0)
    assert _predicted_seconds({"T": 16, "device": "cpu", "error": "OOM"}, 64, False) is None


def test_the_kernel_ratio_needs_both_sides_from_one_run(tmp_path, monkeypatch):
    """``--stages kernel`` re-runs our kernels into a folder whose fla.json an earlier run wrote: our new times
    over flash-linear-attention's old ones would be a ratio of two runs, so it is not measured; the kernel and
    fla stages run together give the ratio."""
    folder = tmp_path / "bench-gpu-cpu"
    folder.mkdir()
    short, long = DRY.kernel_lengths
    write_json(folder / "fla.json", {"run": "earlier", "rows": [{"op": "theirs, n_h 1", "backend": "torch", "T": T,
                                                               "fwd_ms": 1.0, "fwd_bwd_ms": 2.0} for T in (short, long)]})

    def ours(plan, path, deadline):   # the kernel stage, measured in this run
        write_json(path, {"rows": [{"op": f"ours, n_h {n}, gated", "backend": "torch", "n_h": n, "T": T,
                                    "fwd_ms": 0.5 * n, "fwd_bwd_ms": 1.0 * n} for T in (short, long) for n in (1, 2)]})

    def in_process(fn, args, env, seconds):
        fn(*args)
        return None

    monkeypatch.setattr(gpu_speed, "in_child", in_process)
    monkeypatch.setitem(gpu_speed.STAGE_FUNCTIONS, "kernel", ours)
    monkeypatch.setitem(gpu_speed.STAGE_FUNCTIONS, "fla", ours)
    assert gpu_speed.run(DRY, tmp_path, stages=("kernel",)) == 3
    summary = json.loads((folder / "summary.json").read_text())
    assert all(str(r).startswith("not measured: kernel.json and fla.json were written by different runs")
               for r in summary["kernel_vs_fla"]["delta_rule"].values()), summary["kernel_vs_fla"]
    # both stages in one run: our times over theirs (here the stand-in's, the same numbers: 1)
    gpu_speed.run(DRY, tmp_path, stages=("kernel", "fla"))
    kernel, fla = (json.loads((folder / f"{s}.json").read_text()) for s in ("kernel", "fla"))
    assert kernel["run"] == fla["run"] != "earlier"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["kernel_vs_fla"]["delta_rule"] == {str(short): 1.0, str(long): 1.0}


def test_rounds_pool_a_row_whose_decode_failed(tmp_path, monkeypatch):
    """--rounds 3: a row whose decode runs out of memory in every round still pools its forward and
    forward+backward timings over the three rounds (as the table's "median of 3 rounds x 1" says), and says
    its error once; a row skipped at the time limit is not measured again."""
    calls = []

    def fake_measure(mixer, T, *args, memory=True, **kwargs):
        calls.append((type(mixer).__name__, T))
        ms = 10.0 * len(calls)   # every call another time: the median tells which were pooled
        return {"fwd_ms": ms, "fwd_ms_samples": [ms], "fwd_bwd_ms": 2 * ms, "fwd_bwd_ms_samples": [2 * ms],
                "error": "decode: OOM: out of memory" if T == 32 else None}

    monkeypatch.setattr(bench, "measure", fake_measure)
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    args = parser.parse_intermixed_args(["--mixers", "mamba2", "--seq-lens", "16,32", "--repeats", "1",
                                         "--rounds", "3", "--threads", "1", "--no-progress", "--no-plot",
                                         "--out", str(tmp_path), "model.d_model=32"])
    assert bench.run(args) == 0
    rows = {r["T"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    for T in (16, 32):
        r = rows[T]
        assert r["rounds"] == 3 and len(r["fwd_bwd_ms_samples"]) == 3, r
        assert r["fwd_bwd_ms"] == statistics.median(r["fwd_bwd_ms_samples"])
    assert rows[32]["error"] == "decode: OOM: out of memory"
    assert len(calls) == 6
    # the time limit skips T 64 (predicted past 0.001 s): not measured in any round
    calls.clear()
    args.seq_lens, args.time_limit = [16, 64], 0.001
    assert bench.run(args) == 0
    rows = {r["T"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert rows[64]["error"].startswith("skipped") and "fwd_bwd_ms" not in rows[64]
    assert [T for _, T in calls] == [16, 16, 16]
