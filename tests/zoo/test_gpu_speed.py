"""scripts/gpu_speed.sh: the dry run writes a summary of the documented form with every launch counted,
the verdicts follow the targets (exit 1 on a miss, 3 when something was not measured), the summary's
ratios are those of the stage files, and a stage killed at its limit keeps what it wrote."""
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo.benchmark import gpu_report, gpu_speed, gpu_targets
from zoo.benchmark.gpu_speed import DRY, FULL, mixer_names
from zoo.benchmark.runner import write_json

ROOT = Path(__file__).resolve().parents[2]


def _validate(summary, plan):
    names, linear = mixer_names()
    return gpu_targets.validate(summary, names, linear, plan.kernel_lengths, plan.layer_lengths, plan.lm_lengths)


def test_the_dry_run_writes_the_summary_and_its_verdicts(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_speed.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode in (0, 1, 3), done.stdout + done.stderr  # toy sizes on a CPU: any verdict
    folder = tmp_path / "bench-gpu-cpu"
    names = {p.name for p in folder.iterdir()}
    assert names == {"env.json", "first_call.json", "kernel.json", "layers.json", "lm.json", "fla.json",
                     "summary.json", "summary.md"}
    summary = json.loads((folder / "summary.json").read_text())
    assert _validate(summary, DRY) == []
    every, linear = mixer_names()
    for name in every:  # every layer ran, and its operators were counted at both lengths
        assert all(isinstance(n, int) and n > 0 for n in summary["launches"][name].values()), name
        assert gpu_targets.is_number(summary["first_call_s"][name]), name
    for name in linear:
        assert all(gpu_targets.is_number(r) for r in summary["layer_vs_sdpa"][name].values()), name
        assert all(gpu_targets.is_number(r) for r in summary["lm_vs_attention"][name].values()), name
    assert all(gpu_targets.is_number(r) for r in summary["kernel_vs_fla"]["delta_rule"].values())
    for name, row in json.loads((folder / "first_call.json").read_text())["rows"].items():  # nothing to compile
        assert "CUDA devices" in row["ahead_skipped"] and row["kernels_ahead"] == 0, name
        assert row["ahead_run_seconds"] == row["ahead_wait_seconds"] == row["ahead_load_seconds"] == 0, name
    for stage in ("kernel", "fla", "layers"):  # where each timed call's time went, kernel by kernel
        for row in json.loads((folder / f"{stage}.json").read_text())["rows"]:
            assert sum(k["calls"] for k in row["kernels"]) == row["launches"] > 0, (stage, row["T"])
            assert row["device_ms"] == pytest.approx(sum(k["ms"] for k in row["kernels"]), abs=1e-3)
            if stage == "layers":   # the host's side: no device to wait for on a CPU
                assert row["host_ms"] > 0 and row["syncs"] is None and row["sync_sites"] == [], row
    for row in json.loads((folder / "lm.json").read_text())["rows"]:  # one more step: its kernels and host time
        assert row["step_launches"] > 0 and row["step_device_ms"] >= 0, row
        kept = row["step_kernels"]   # the longest names of the step, longest first
        assert 0 < len(kept) <= gpu_speed.STEP_KERNELS and all(k["calls"] > 0 for k in kept), row
        assert [k["ms"] for k in kept] == sorted((k["ms"] for k in kept), reverse=True)
        assert sum(k["ms"] for k in kept) <= row["step_device_ms"] + 1e-3, row
        assert row["step_host_ms"] > 0 and row["step_syncs"] is None, row
        assert row["graph_error"] == "needs CUDA" and "graph_tokens_per_second" not in row, row
    for row in json.loads((folder / "layers.json").read_text())["rows"]:  # a graph of each layer: CUDA only
        assert row["graph_error"] == "needs CUDA" and "graph_fwd_bwd_ms" not in row, row
    report = (folder / "summary.md").read_text()
    assert "## Targets" in report and "## Where the time goes" in report
    assert "## Where a language model's step goes" in report
    assert gpu_speed.main(["--check", str(folder)]) == done.returncode
    # a run stopped before its summary: --check builds the same one from the stage files
    (folder / "summary.json").unlink()
    (folder / "summary.md").unlink()
    assert gpu_speed.main(["--check", str(folder)]) == done.returncode
    assert json.loads((folder / "summary.json").read_text()) == summary and (folder / "summary.md").exists()


def _passing(plan, rng: torch.Generator):
    """A summary (and kernel.json) of ``plan``'s shape with every value inside its target."""
    def u(low, high):
        return low + (high - low) * float(torch.rand((), generator=rng))

    names, linear = mixer_names()
    short, long = (str(T) for T in plan.layer_lengths)
    lm_short, lm_long = (str(T) for T in plan.lm_lengths)
    summary = {
        "card": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
        "kernel_vs_fla": {"delta_rule": {str(T): u(0.3, 1.2) for T in plan.kernel_lengths}},
        "layer_vs_sdpa": {n: {short: u(0.1, 1.5 if n == "deltaproduct" else 1.0), long: u(0.05, 0.5)} for n in linear},
        "lm_vs_attention": {n: {lm_short: u(0.9, 3.0), lm_long: u(1.5, 5.0)} for n in linear},
        "launches": {},
        "first_call_s": {n: u(0.1, 4.99) for n in names},
    }
    for n in names:
        count = int(torch.randint(1, 101, (), generator=rng))
        summary["launches"][n] = {short: count, long: count}
    rows = []
    for T in plan.kernel_lengths:
        one = {"fwd_ms": u(1, 10), "fwd_bwd_ms": u(3, 30)}
        rows.append({"op": "ours, n_h 1, gated", "backend": "triton", "n_h": 1, "gated": True, "T": T, **one})
        rows.append({"op": "ours, n_h 2, gated", "backend": "triton", "n_h": 2, "gated": True, "T": T,
                     **{k: v * u(1.0, 2.4) for k, v in one.items()}})
    return summary, {"about": "synthetic", "rows": rows}


def _write(folder: Path, summary, kernel):
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "summary.json", summary)
    write_json(folder / "kernel.json", kernel)
    return gpu_speed.main(["--check", str(folder)])


def test_the_verdicts_follow_the_targets(tmp_path, capsys):
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    summary, kernel = _passing(FULL, rng)
    assert _validate(summary, FULL) == []
    assert _write(tmp_path / "met", summary, kernel) == 0
    names, linear = mixer_names()
    pick = int(torch.randint(0, len(linear), (), generator=rng))
    mixer = linear[pick]

    def changed(path: list, value):
        broken = json.loads(json.dumps(summary))
        where = broken
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
        return broken

    long, lm_short = str(FULL.layer_lengths[1]), str(FULL.lm_lengths[0])
    misses = {
        "kernel": changed(["kernel_vs_fla", "delta_rule", "65536"], 1.21),
        "layer": changed(["layer_vs_sdpa", mixer, long], 0.51),
        "lm": changed(["lm_vs_attention", mixer, lm_short], 0.89),
        "launches unequal": changed(["launches", mixer], {"16384": 40, "65536": 41}),
        "launches many": changed(["launches", mixer], {"16384": 101, "65536": 101}),
        "first call": changed(["first_call_s", mixer], 5.0),
        "first call past its limit": changed(["first_call_s", mixer], "not measured: ran past its 20 s limit"),
    }
    for what, broken in misses.items():
        assert _validate(broken, FULL) == [], what
        assert _write(tmp_path / what.replace(" ", "-"), broken, kernel) == 1, what
    slow = json.loads(json.dumps(kernel))
    slow["rows"][3]["fwd_bwd_ms"] = 2.41 * slow["rows"][2]["fwd_bwd_ms"]  # n_h 2 at the longer length
    assert _write(tmp_path / "two-steps", summary, slow) == 1
    unmeasured = changed(["kernel_vs_fla", "delta_rule", "65536"], "not measured: autotune ran past the limit")
    assert _write(tmp_path / "unmeasured", unmeasured, kernel) == 3
    assert _write(tmp_path / "unmeasured-and-missed", {**unmeasured, "layer_vs_sdpa": misses["layer"]["layer_vs_sdpa"]},
                  kernel) == 1
    assert "| missed |" in capsys.readouterr().out


def test_the_shape_is_checked():
    summary, _ = _passing(FULL, torch.Generator().manual_seed(0))
    names, linear = mixer_names()
    assert _validate({**summary, "extra": 1}, FULL)
    assert _validate({k: v for k, v in summary.items() if k != "launches"}, FULL)
    assert _validate({**summary, "first_call_s": {n: 1.0 for n in names[1:]}}, FULL)  # a mixer missing
    assert _validate({**summary, "launches": {n: {"16384": 1.5, "65536": 2} for n in names}}, FULL)
    assert _validate({**summary, "kernel_vs_fla": {"delta_rule": {"16384": 1.0}}}, FULL)
    assert _validate({**summary, "lm_vs_attention": {n: {"2048": "fast", "8192": 2.0} for n in linear}}, FULL)
    assert _validate(summary, DRY)  # the GPU run's lengths are not the dry run's


def test_the_summary_holds_the_ratios_of_the_stage_files(tmp_path):
    plan = DRY
    names, linear = mixer_names()
    short, long = plan.kernel_lengths
    r = torch.rand(64, dtype=torch.float64).add(0.1).tolist()
    write_json(tmp_path / "env.json", {"card": "c", "commit": "x", "plan": dataclasses.asdict(plan),
                                       "mixers": names, "linear": linear, "environment": {}})
    write_json(tmp_path / "kernel.json", {"rows": [
        {"n_h": 1, "T": short, "fwd_ms": r[0], "fwd_bwd_ms": r[1]},
        {"n_h": 2, "T": short, "fwd_ms": r[2], "fwd_bwd_ms": r[3]},
        {"n_h": 1, "T": long, "fwd_ms": r[4], "fwd_bwd_ms": r[5]},
        {"n_h": 2, "T": long, "error": "OOM: boom"}]})
    # fla killed during its autotuning at the longer length: its forward there came back, its backward not
    write_json(tmp_path / "fla.json", {"rows": [{"T": short, "fwd_ms": r[6], "fwd_bwd_ms": r[7]},
                                                {"T": long, "fwd_ms": r[8]}], "stopped": "ran past its 90 s limit"})
    layer_rows, lm_rows, fb, tps, graph, graph_fb = [], [], {}, {}, {}, {}
    replays = torch.rand(2 * len(names), dtype=torch.float64).add(0.05).tolist()
    for i, name in enumerate(names):
        for j, T in enumerate(plan.layer_lengths):
            fb[name, T] = r[10 + 2 * i + j]
            row = {"mixer": name, "T": T, "fwd_bwd_ms": fb[name, T], "launches": 7 * i + j}
            # captured layers: all but one in three (attention's among them); one whose graph computed
            # something else than the eager call is not compared
            if i % 3 != 1:
                row.update(graph_fwd_bwd_ms=replays[2 * i + j], graph_grad_gap=1e-4,
                           graph_output_gap=0.0 if i % 3 == 0 else 0.2)
                if i % 3 == 0:
                    graph_fb[name, T] = replays[2 * i + j]
            else:
                row["graph_error"] = "capturing the step failed (RuntimeError: boom)"
            layer_rows.append(row)
        for j, T in enumerate(plan.lm_lengths):
            tps[name, T] = 1000 * r[40 + 2 * i + j]
            row = {"mixer": name, "T": T, "tokens_per_second": tps[name, T]}
            # captured steps: every model but one in two, and not attention at the longer length
            if i % 2 == 0 and not (name == "attention" and j == 1):
                row["graph_tokens_per_second"] = 1000 * r[10 + 2 * i + j] + tps[name, T]
                # a captured step that computed something else than the eager one is not compared
                row["graph_loss_gap"] = 0.0 if i % 4 == 0 else 0.5
                row["graph_grad_gap"] = 1e-3
                if i % 4 == 0:
                    graph[name, T] = row["graph_tokens_per_second"]
            else:
                row["graph_error"] = "capturing the step failed (RuntimeError: boom)"
            lm_rows.append(row)
    write_json(tmp_path / "layers.json", {"rows": layer_rows})
    write_json(tmp_path / "lm.json", {"rows": lm_rows[:-1], "stopped": "ran past its 110 s limit"})
    write_json(tmp_path / "first_call.json", {"rows": {n: {"seconds": float(i)} for i, n in enumerate(names)}})
    summary, two_steps = gpu_report.summarize(tmp_path)
    assert _validate(summary, plan) == []
    kernel = summary["kernel_vs_fla"]["delta_rule"]
    assert kernel[str(short)] == pytest.approx(max(r[0] / r[6], r[1] / r[7]))
    assert kernel[str(long)].startswith("not measured: autotune ran past the limit")
    assert two_steps[str(short)] == pytest.approx(max(r[2] / r[0], r[3] / r[1]))
    assert two_steps[str(long)] == "not measured: OOM: boom"
    for i, name in enumerate(names):
        assert summary["launches"][name] == {str(T): 7 * i + j for j, T in enumerate(plan.layer_lengths)}
        assert summary["first_call_s"][name] == float(i)
    last = linear[-1]
    for name in linear:
        for T in plan.layer_lengths:
            if (name, T) in graph_fb:   # both layers captured (attention's always): the replays compared
                want = graph_fb[name, T] / graph_fb["attention", T]
            else:
                want = fb[name, T] / fb["attention", T]
            assert summary["layer_vs_sdpa"][name][str(T)] == pytest.approx(want), (name, T)
        for T in plan.lm_lengths:
            got = summary["lm_vs_attention"][name][str(T)]
            if name == last and T == plan.lm_lengths[-1]:
                assert got == "not measured: the lm stage ran past its 110 s limit"
            elif (name, T) in graph and ("attention", T) in graph:  # both captured: graph steps compared
                assert got == pytest.approx(graph[name, T] / graph["attention", T])
            else:
                assert got == pytest.approx(tps[name, T] / tps["attention", T])
    assert any((n, plan.lm_lengths[0]) in graph for n in linear) and ("attention", plan.lm_lengths[0]) in graph
    assert any((n, plan.layer_lengths[0]) in graph_fb for n in linear)
    assert any((n, plan.layer_lengths[0]) not in graph_fb for n in linear)
    gapped = [n for i, n in enumerate(names) if i % 4 == 2 and n in linear]
    assert gapped and all(summary["lm_vs_attention"][n][str(plan.lm_lengths[0])] == pytest.approx(
        tps[n, plan.lm_lengths[0]] / tps["attention", plan.lm_lengths[0]]) for n in gapped)


def _writes_then_hangs(path):
    write_json(path, {"rows": [1]})
    time.sleep(600)


def test_a_stage_past_its_limit_is_killed_and_keeps_what_it_wrote(tmp_path):
    path = tmp_path / "stage.json"
    why = gpu_speed.in_child(_writes_then_hangs, (path,), {}, 2.0)
    assert why == "ran past its 2 s limit"
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert gpu_speed.in_child(write_json, (tmp_path / "done.json", {"ok": True}), {}, 60.0) is None
    assert gpu_speed.in_child(_writes_then_hangs, (tmp_path / "no" / "such" / "folder.json",), {}, 60.0) \
        == "failed with exit status 1 (traceback above)"


def _fake_first_call(plan, name, path, deadline):
    """A first call that takes half a second (gka: hangs), recording when it ran and with which cache."""
    began = time.time()
    time.sleep(600 if name == "gka" else 0.5)
    write_json(path, {"mixer": name, "seconds": 0.5, "began": began, "ended": time.time(),
                      "cache": os.environ["TRITON_CACHE_DIR"]})
    (Path(os.environ["TRITON_CACHE_DIR"]) / name).mkdir(parents=True)


def test_first_calls_run_a_few_at_a_time_each_in_its_own_cache(tmp_path, monkeypatch):
    """The first-call stage keeps ``first_call_workers`` fresh processes busy at once (never more), kills one
    past its limit, merges every process's cache into the shared one, lists the mixers in their order, and
    marks those it could not start before the stage's deadline."""
    monkeypatch.setattr(gpu_speed, "stage_first_call", _fake_first_call)
    names = mixer_names()[0]
    plan = dataclasses.replace(DRY, first_call_workers=3, first_call_seconds=3.0)
    shared = {"TRITON_CACHE_DIR": str(tmp_path / "shared")}
    why = gpu_speed._first_calls(plan, tmp_path / "first_call.json", tmp_path, shared, time.time() + 120)
    data = json.loads((tmp_path / "first_call.json").read_text())
    assert why is None and data["concurrent"] == 3 and list(data["rows"]) == names
    assert data["rows"]["gka"] == {"error": "ran past its 3 s limit"}
    spans = [(row["began"], row["ended"]) for row in data["rows"].values() if "began" in row]
    assert len(spans) == len(names) - 1
    overlap = max(sum(b <= t < e for b, e in spans) for t, _ in spans)
    assert 2 <= overlap <= 3, spans
    assert len({row["cache"] for row in data["rows"].values() if "cache" in row}) == len(names) - 1
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted(n for n in names if n != "gka")
    # a stage whose time is nearly spent starts what it can and says which mixers it did not reach
    why = gpu_speed._first_calls(plan, tmp_path / "late.json", tmp_path / "late", shared, time.time() + 1.2)
    rows = json.loads((tmp_path / "late.json").read_text())["rows"]
    assert list(rows) == names
    late = [n for n in names if rows[n].get("error") == "not reached: the stage's time was spent"]
    assert why == f"{len(late)} mixers not reached" and len(late) >= len(names) - 3


def test_card_folders():
    assert gpu_speed.card_folder("NVIDIA H100 80GB HBM3", "cuda") == "bench-gpu-h100"
    assert gpu_speed.card_folder("NVIDIA H200", "cuda") == "bench-gpu-h200"
    assert gpu_speed.card_folder("NVIDIA A100-SXM4-80GB", "cuda") == "bench-gpu-a100"
    assert gpu_speed.card_folder("Some Card", "cuda") == "bench-gpu-some-card"
    assert gpu_speed.card_folder("anything", "cpu") == "bench-gpu-cpu"


def test_the_lm_rate_leaves_out_the_warmup_and_keeps_to_its_time(monkeypatch):
    from zoo.benchmark.train_rate import MIN_TIMED_STEPS, MIN_WARMUP_STEPS, steady_rate
    from zoo.training import throughput

    now = [float(torch.randint(0, 1000, ()))]
    monkeypatch.setattr(throughput, "clock", lambda: now[0])
    costs = iter([30.0] + [2.0] * 4 + [float(c) for c in torch.rand(8).add(0.5)])
    spent = []

    def step():
        spent.append(next(costs))
        now[0] += spent[-1]

    rate = steady_rate(step, 1000, torch.device("cpu"), warmup=5, steps=8)
    assert (rate.warmup_steps, rate.timed_steps) == (5, 8)
    assert rate.warmup_seconds == pytest.approx(38.0) and rate.timed_seconds == pytest.approx(sum(spent[5:]))
    assert rate.tokens_per_second == pytest.approx(8000 / sum(spent[5:]))
    # a 20 s budget: the warm-up stops at its minimum (past half the budget), the timed steps at theirs
    costs = iter([30.0] * 100)
    rate = steady_rate(step, 1000, torch.device("cpu"), warmup=20, steps=50, seconds=20.0)
    assert (rate.warmup_steps, rate.timed_steps) == (MIN_WARMUP_STEPS, MIN_TIMED_STEPS)


def test_a_mixer_registered_outside_the_library_is_not_benchmarked():
    from mixers import MIXERS, register_mixer
    from tests.mixers.example_mixer import CumulativeMean
    register_mixer(CumulativeMean)  # as a test module or a recipe's imports do, for the rest of the process
    every, linear = mixer_names()
    assert "cumulative_mean" in MIXERS.names() and "cumulative_mean" not in every + linear
    assert set(every) == set(MIXERS.builtin_names("mixers")) and every[0] == "attention"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "gated_deltanet"])
def test_a_layer_captured_as_a_graph_computes_what_the_eager_call_does(name):
    plan = dataclasses.replace(FULL, d_model=256, head_dim=64)
    device = torch.device("cuda")
    mixer = gpu_speed.build_layer(name, plan, device, torch.bfloat16)
    found = gpu_speed.layer_graph(mixer, 512, device, torch.bfloat16, warmup=1, repeats=3)
    assert "graph_error" not in found, found
    assert found["graph_output_gap"] <= gpu_report.GRAPH_GAP_LIMIT, found
    assert found["graph_grad_gap"] <= gpu_report.GRAPH_GAP_LIMIT, found
    assert found["graph_fwd_bwd_ms"] > 0
    assert all(p.grad is None for p in mixer.parameters())   # the graph's gradients are let go
