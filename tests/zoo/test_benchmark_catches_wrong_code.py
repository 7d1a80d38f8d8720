"""The benchmark's numbers against independent computations, with fake clocks, fake CPU counters and fake
measurements fed in (nothing is timed): repetitions in milliseconds with the warm-up left out, the bytes autograd
saves and a decode state holds, which peak is which, the flags that skip work, ``zoo bench``'s rounds
interleaved and its exit status, the scaling fits at any step of ``T``, the steady-state window's time budget,
the GPU summary's shape and ratios, and the resident blocks of a kernel."""
from __future__ import annotations

import argparse
import json
import math
import types

import pytest
import torch
from torch import nn

from zoo.benchmark import gpu_report, gpu_targets, layer_resources, scaling
from zoo.benchmark import measure as measure_module
from zoo.benchmark import runner as bench
from zoo.benchmark.runner import _predicted_seconds, write_json
from zoo.benchmark.train_rate import lm_step, steady_rate
from zoo.training import throughput


def _draw(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(()))


def _int(low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, ()))


# --- measure.py ---------------------------------------------------------------------------------------------


def test_repetitions_are_timed_in_ms_after_the_warmup_with_their_cpu_seconds(monkeypatch):
    """``times_ms`` calls ``fn`` ``warmup + repeats`` times, returns the ``repeats`` timed ones' durations in
    milliseconds (fake clock) and records the CPU seconds of the timed calls only, user before system."""
    warmup, repeats = _int(0, 3), _int(1, 5)
    costs = [_draw(0.001, 0.5) for _ in range(warmup + repeats)]
    user_costs, sys_costs = [_draw(0.0, 0.4) for _ in costs], [_draw(0.0, 0.1) for _ in costs]
    now, cpu_now, calls = [_draw(0, 100)], [_draw(0, 50), _draw(0, 5)], []

    def fn():
        i = len(calls)
        calls.append(i)
        now[0] += costs[i]
        cpu_now[0] += user_costs[i]
        cpu_now[1] += sys_costs[i]

    monkeypatch.setattr(measure_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(measure_module, "cpu_seconds", lambda: tuple(cpu_now))
    cpu: list = []
    got = measure_module.times_ms(fn, torch.device("cpu"), warmup, repeats, cpu)
    assert len(calls) == warmup + repeats
    assert got == pytest.approx([c * 1000 for c in costs[warmup:]], rel=1e-9, abs=1e-9)
    (user, system, n), = cpu
    assert n == repeats
    assert user == pytest.approx(sum(user_costs[warmup:]), abs=1e-9)
    assert system == pytest.approx(sum(sys_costs[warmup:]), abs=1e-9)


class _ToyMixer(nn.Module):
    """``y = exp(x[..., :k] * w[:k])`` padded back to ``d``: saves a view of the input (its whole storage), a
    parameter (not counted) and the exponential's output; its decode state has tensors of three dtypes."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.d_model, self.k = d, k
        self.w = nn.Parameter(torch.randn(d))
        self.prefilled = 0

    def forward(self, x):
        y = torch.exp(x[..., :self.k] * self.w[:self.k])
        return torch.cat([y, x[..., self.k:]], dim=-1)

    def prefill(self, x):
        self.prefilled += 1
        b = x.shape[0]
        return x, {"h": torch.zeros(b, self.d_model, 3), "count": torch.zeros(b, dtype=torch.int64),
                   "half": torch.zeros(b, 5, dtype=torch.float16)}

    def step(self, x_t, state):
        return x_t

    def state_size(self, T):
        return 3 * self.d_model + T

    def active_state_size(self, T):
        return 3 * self.d_model


def _fake_times(fn, device, warmup, repeats, cpu=None):
    fn()
    if cpu is not None:
        cpu.append((0.01, 0.001, repeats))
    return [1.0] * repeats


def test_the_saved_bytes_the_state_bytes_and_each_peak_are_those_of_the_mixer(monkeypatch):
    """``saved_mib``: the storages autograd keeps (the input's whole storage for a view of it, the exponential's
    output; the parameter left out); ``state_bytes``: the state's numel x element size; each peak the number of
    the call that made it (prefill, then forward+backward); the size cross-checks each their own function."""
    batch, T, d = _int(1, 3), _int(2, 9), _int(4, 9)
    k = _int(1, d - 1)
    mixer = _ToyMixer(d, k)
    peaks = [_draw(1, 100), _draw(1, 100)]
    seen = []

    def fake_peaks(fns, device):
        before = mixer.prefilled
        fns[0]()
        seen.append(mixer.prefilled - before)
        return list(peaks)

    monkeypatch.setattr(measure_module, "times_ms", _fake_times)
    monkeypatch.setattr(measure_module, "peak_mibs", fake_peaks)
    row = measure_module.measure(mixer, T, batch, torch.device("cpu"), torch.float32, 0, 2)
    assert row["error"] is None
    assert row["saved_mib"] * 2**20 == 4 * batch * T * d + 4 * batch * T * k
    assert row["state_bytes"] == batch * (4 * 3 * d + 8 + 2 * 5)
    assert seen == [1] and (row["prefill_peak_mib"], row["peak_mib"]) == (peaks[0], peaks[1])
    assert (row["state_size"], row["active_state_size"]) == (3 * d + T, 3 * d)


def test_skipping_memory_or_decode_measures_neither(monkeypatch):
    """``memory=False`` leaves out every memory number and ``decode=False`` the decode step (no prefill at all)."""
    mixer = _ToyMixer(6, 3)
    monkeypatch.setattr(measure_module, "times_ms", _fake_times)
    row = measure_module.measure(mixer, _int(2, 6), 2, torch.device("cpu"), torch.float32, 0, 1,
                                 decode=False, memory=False)
    assert row["error"] is None and "fwd_ms" in row and "fwd_bwd_ms" in row
    assert not {"saved_mib", "peak_mib", "prefill_peak_mib", "decode_ms", "state_bytes"} & row.keys()
    assert mixer.prefilled == 0


def test_every_peak_is_taken_above_the_memory_before_the_first_call(monkeypatch):
    """On a CPU each piece of work's peak is measured against the resident size before the first one."""
    made = []

    class FakePeak:
        def __init__(self, after=None):
            self.after, self.mib = after, None
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.mib = float(len(made))

    n = _int(3, 5)
    monkeypatch.setattr(measure_module, "PeakRSS", FakePeak)
    assert measure_module.peak_mibs([lambda: None] * n, torch.device("cpu")) == [float(i + 1) for i in range(n)]
    assert made[0].after is None and all(p.after is made[0] for p in made[1:])


def test_the_largest_difference_is_relative_to_the_reference_and_oom_is_named():
    """``largest_difference``: the largest ``max|a - b| / max|b|`` over the pairs (hand computed); a
    ``MemoryError`` or an "out of memory" message reads ``OOM``, other errors their type."""
    pairs = [(torch.randn(_int(2, 6)) * _draw(0.1, 10), torch.randn(_int(2, 6)) * _draw(0.1, 10)) for _ in range(3)]
    pairs = [(a, b[:1].expand_as(a) + torch.randn_like(a)) for a, b in pairs]
    want = max(max(abs(x - y) for x, y in zip(a.tolist(), b.tolist())) / max(abs(y) for y in b.tolist())
               for a, b in pairs)
    got = measure_module.largest_difference([a for a, _ in pairs], [b for _, b in pairs])
    assert got == pytest.approx(want, rel=1e-5)
    assert measure_module.error_text(MemoryError("cannot allocate")) == "OOM: cannot allocate"
    assert measure_module.error_text(RuntimeError("CUDA out of memory. Tried")).startswith("OOM: ")
    assert measure_module.error_text(ValueError("bad shape")) == "ValueError: bad shape"


# --- runner.py ----------------------------------------------------------------------------------------------


def _bench_args(tmp_path, *extra, mixers="mamba2,gla", seq_lens="16,32"):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    return parser.parse_intermixed_args(["--mixers", mixers, "--seq-lens", seq_lens, "--repeats", "1",
                                         "--threads", "1", "--no-progress", "--no-plot", "--out", str(tmp_path),
                                         *extra, "model.d_model=32"])


def test_rounds_measure_the_whole_sweep_once_before_the_next_round(tmp_path, monkeypatch):
    """``--rounds R`` measures every entry at every length, then again in that order, R times (not one row R
    times in a row); on a CPU in fp32 by default, and the first entry is the baseline."""
    rounds, calls = _int(2, 3), []

    def fake_measure(mixer, T, batch, device, dtype, *args, memory=True, **kwargs):
        calls.append((type(mixer).__name__, T, memory, dtype))
        return {"fwd_ms": 1.0, "fwd_ms_samples": [1.0], "fwd_bwd_ms": 2.0, "fwd_bwd_ms_samples": [2.0],
                "error": None}

    monkeypatch.setattr(bench, "measure", fake_measure)
    assert bench.run(_bench_args(tmp_path, "--rounds", str(rounds))) == 0
    one_round = [(name, T) for name, T, _, _ in calls[:4]]
    assert len(calls) == 4 * rounds and len(set(one_round)) == 4
    assert [(name, T) for name, T, _, _ in calls] == one_round * rounds
    assert [m for _, _, m, _ in calls] == [True] * 4 + [False] * 4 * (rounds - 1)
    assert {dtype for *_, dtype in calls} == {torch.float32}
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["config"]["dtype"] == "fp32" and result["config"]["baseline"] == "mamba2"
    assert all(r["rounds"] == rounds and r["dtype"] == "fp32" for r in result["rows"])


def test_a_bench_whose_every_row_failed_exits_1(tmp_path, monkeypatch):
    """No row with a time: exit status 1 (every error still written down in bench.json); ``--no-decode``,
    ``--batch`` and ``--warmup`` reach every measurement."""
    batch, warmup, asked = _int(2, 4), _int(0, 3), set()

    def failing(mixer, T, batch, device, dtype, warmup, repeats, decode=True, memory=True):
        asked.add((batch, warmup, repeats, decode))
        return {"error": "forward: OOM: out of memory"}

    monkeypatch.setattr(bench, "measure", failing)
    args = _bench_args(tmp_path, "--no-decode", "--batch", str(batch), "--warmup", str(warmup))
    assert bench.run(args) == 1
    assert asked == {(batch, warmup, 1, False)}
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["error"] == "forward: OOM: out of memory" for r in rows)


def test_the_prediction_scales_the_wall_time_on_a_gpu_and_a_length_of_zero_is_refused():
    """Off a CPU the prediction is the wall time x (T / T_last) ** (2 or 1), whatever the CPU time says; a
    length of 0 is not a length."""
    T0, ratio = _int(8, 64), _int(2, 8)
    wall, cpu = _draw(10, 1000), _draw(0.1, 5)
    row = {"T": T0, "device": "cuda:0", "fwd_bwd_ms": wall, "fwd_bwd_user_ms": cpu, "fwd_bwd_sys_ms": cpu / 10}
    assert _predicted_seconds(row, T0 * ratio, False) == pytest.approx(wall / 1000 * ratio)
    assert _predicted_seconds(row, T0 * ratio, True) == pytest.approx(wall / 1000 * ratio ** 2)
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        bench._int_list(f"{T0},0")


# --- scaling.py ---------------------------------------------------------------------------------------------


def _scaling_rows(label: str = "mamba2") -> list[dict]:
    """Rows at 3 or 4 lengths, each step 2x to 8x, with random times, CPU times and peaks."""
    T, rows = _int(64, 512), []
    for _ in range(_int(3, 4)):
        wall, user, system, peak = _draw(10, 1000), _draw(10, 1000), _draw(0, 100), _draw(10, 1000)
        rows.append({"label": label, "mixer": label, "T": T, "fwd_bwd_ms": wall, "tok_s_train": T / (wall / 1e3),
                     "fwd_bwd_user_ms": user, "fwd_bwd_sys_ms": system, "fwd_bwd_cpu": [user / 1e3, system / 1e3, 1],
                     "peak_mib": peak, "prefill_peak_mib": _draw(1, 10), "decode_ms": _draw(0.1, 1),
                     "state_grows_with_seq_len": False})
        T *= 2 ** _int(1, 3)
    return rows


def test_the_scaling_numbers_of_random_rows_at_any_step_of_the_length():
    """Growth limits ``growth ** log4(T ratio)`` at steps of 2x to 8x, tokens/s longest over shortest, the largest
    system share of any row, memory per token over the shortest length's, all against a hand computation."""
    rows = _scaling_rows()
    growth, tok_ratio, share = _draw(2, 6), _draw(0.3, 1.5), _draw(0.02, 0.2)
    s = scaling.mixer_scaling(list(reversed(rows)), growth, tok_ratio, share)
    steps = list(zip(rows, rows[1:]))
    limits = [growth ** (math.log2(b["T"] / a["T"]) / 2) for a, b in steps]
    assert s["limits"] == pytest.approx(limits)
    assert s["wall"] == pytest.approx([b["fwd_bwd_ms"] / a["fwd_bwd_ms"] for a, b in steps])
    tok = rows[-1]["tok_s_train"] / rows[0]["tok_s_train"]
    assert s["tok"] == pytest.approx(tok)
    shares = [r["fwd_bwd_sys_ms"] / (r["fwd_bwd_user_ms"] + r["fwd_bwd_sys_ms"]) for r in rows]
    assert s["sys"] == pytest.approx(max(shares))
    per_token = [r["peak_mib"] / r["T"] for r in rows]
    assert s["memory_per_token"] == pytest.approx([p / per_token[0] for p in per_token[1:]])
    assert s["checks"]["growth"] == all(s["wall"][i] <= limits[i] for i in range(len(steps)))
    assert s["checks"]["tok/s"] == (tok >= tok_ratio) and s["checks"]["sys"] == (max(shares) < share)


def test_the_scaling_targets_on_their_thresholds():
    """A growth and a tokens/s ratio exactly on their targets are met, a system share exactly on its target is
    missed (it must stay under it)."""
    rows = [{"label": "m", "mixer": "m", "T": 1024, "fwd_bwd_ms": 1.0, "tok_s_train": 10.0, "fwd_bwd_user_ms": 0.85,
             "fwd_bwd_sys_ms": 0.15, "peak_mib": 1.0},
            {"label": "m", "mixer": "m", "T": 4096, "fwd_bwd_ms": 4.6, "tok_s_train": 8.0, "fwd_bwd_user_ms": 0.85,
             "fwd_bwd_sys_ms": 0.15, "peak_mib": 4.0}]
    s = scaling.mixer_scaling(rows, 4.6, 0.8, 0.15)
    assert s["wall"] == [4.6] and s["tok"] == 0.8 and s["sys"] == 0.15
    assert {k for k, ok in s["checks"].items() if not ok} == {"sys"}


def test_the_scaling_command_exits_1_on_a_miss_and_reports_system_shares(tmp_path, capsys):
    """``python -m zoo.benchmark.scaling``: exit 0 when every linear-state mixer meets its targets (a growing one
    is not judged), 1 on a miss; the system shares are system over user + system, of the timed calls and the run."""
    rows = _scaling_rows()
    for r in rows:
        r["fwd_bwd_ms"] = r["T"] / 100.0
        r["tok_s_train"], r["peak_mib"], r["fwd_bwd_sys_ms"] = 100_000.0, r["T"] / 100.0, 0.0
        r["fwd_bwd_cpu"] = [r["fwd_bwd_user_ms"] / 1e3, 0.0, 1]
    grows = [{**r, "label": "attention", "mixer": "attention", "fwd_bwd_ms": r["T"] ** 2,
              "state_grows_with_seq_len": True} for r in _scaling_rows()]
    user, system = _draw(1, 100), _draw(0.1, 10)
    rows[0]["fwd_bwd_cpu"] = [user, system, 1]
    rows[0]["fwd_bwd_sys_ms"] = 1e-3 * rows[0]["fwd_bwd_user_ms"]
    run = {"wall_s": _draw(100, 200), "user_s": _draw(10, 100), "sys_s": _draw(1, 10)}
    path = tmp_path / "bench.json"
    write_json(path, {"rows": rows + grows, "run": run})
    assert scaling.main([str(path)]) == 0
    out = capsys.readouterr().out
    timed_user = user + sum(r["fwd_bwd_cpu"][0] for r in rows[1:]) + sum(r["fwd_bwd_cpu"][0] for r in grows)
    timed_sys = system + sum(r["fwd_bwd_cpu"][1] for r in grows)
    assert f"timed calls' CPU time: {100 * timed_sys / (timed_user + timed_sys):.1f} %" in out
    assert f"system, {run['wall_s']:.0f} s wall): {100 * run['sys_s'] / (run['user_s'] + run['sys_s']):.1f} %" in out
    rows[-1]["fwd_bwd_ms"] *= 10
    write_json(path, {"rows": rows + grows, "run": run})
    assert scaling.main([str(path)]) == 1


# --- train_rate.py ------------------------------------------------------------------------------------------


def test_the_time_budget_gives_half_to_the_warmup_and_the_rest_to_the_timed_steps(monkeypatch):
    """Steps of ``c`` seconds each, a budget of ``seconds``: the warm-up stops at the first step past
    ``seconds / 2`` from the start, the timed steps at the first past ``seconds`` from the start (not from
    where the timed window opened)."""
    now = [_draw(0, 1000)]
    monkeypatch.setattr(throughput, "clock", lambda: now[0])
    cost, seconds = _draw(0.5, 1.5), _draw(20, 40)

    def step():
        now[0] += cost

    rate = steady_rate(step, 100, torch.device("cpu"), warmup=1000, steps=1000, seconds=seconds)
    warmup = math.floor(seconds / 2 / cost) + 1
    total = math.floor(seconds / cost) + 1
    assert rate.warmup_steps == warmup and rate.timed_steps == total - warmup
    assert rate.tokens_per_second == pytest.approx(100 / cost)


def test_an_eager_training_step_uses_this_steps_gradients_only():
    """``lm_step`` twice on one batch with a learning rate of 0: the gradients are one step's, equal to those of
    the cross-entropy of the next tokens computed here."""
    vocab, d, batch, T = 11, 8, 2, _int(3, 7)
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, vocab))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    inputs, labels = torch.randint(0, vocab, (batch, T)), torch.randint(0, vocab, (batch, T))
    lm_step(model, optimizer, inputs, labels)
    lm_step(model, optimizer, inputs, labels)
    got = [p.grad.clone() for p in model.parameters()]
    logits = model(inputs)
    loss = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).mean()
    want = torch.autograd.grad(loss, list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# --- gpu_targets.py and gpu_report.py -----------------------------------------------------------------------


def _summary(mixers=("attention", "m"), linear=("m",), lengths=("64", "256")) -> dict:
    per = {T: _draw(0.1, 2) for T in lengths}
    return {"card": "c", "commit": "x", "kernel_vs_fla": {"delta_rule": dict(per)},
            "layer_vs_sdpa": {n: dict(per) for n in linear}, "lm_vs_attention": {n: dict(per) for n in linear},
            "launches": {n: {T: _int(1, 50) for T in lengths} for n in mixers},
            "first_call_s": {n: _draw(0.1, 4) for n in mixers}}


def test_the_summary_shape_refuses_negative_booleans_extra_kernels_and_an_empty_commit():
    """The documented form holds for a well-formed summary; a negative ratio, a boolean count, another kernel
    than the delta rule and an empty commit are each named as a problem."""
    lengths = ("64", "256")

    def problems(summary):
        return gpu_targets.validate(summary, ["attention", "m"], ["m"], lengths, lengths, lengths)

    assert problems(_summary()) == []
    bad = {"negative": ("layer_vs_sdpa", {"m": {"64": -0.5, "256": 0.3}}),
           "boolean count": ("launches", {"attention": {"64": True, "256": 1}, "m": {"64": 1, "256": 1}}),
           "boolean time": ("first_call_s", {"attention": False, "m": 1.0}),
           "other kernel": ("kernel_vs_fla", {"delta_rule": {"64": 1.0, "256": 1.0}, "gla": {"64": 1.0}}),
           "empty commit": ("commit", "")}
    for what, (key, value) in bad.items():
        assert problems({**_summary(), key: value}), what
    assert not gpu_targets.is_number(True) and gpu_targets.is_number(_draw(0, 1))


def _stage_folder(tmp_path):
    lengths = [64, 256]
    plan = {"kernel_lengths": lengths, "layer_lengths": lengths, "lm_lengths": lengths}
    write_json(tmp_path / "env.json", {"card": "c", "commit": "x", "plan": plan, "mixers": ["attention", "m"],
                                       "linear": ["m"]})
    return lengths


def test_a_zero_baseline_and_a_stopped_stage_are_not_measured_with_their_reasons(tmp_path):
    """A baseline time of 0 gives no ratio (it says so); the fla stage stopped by its limit says its autotune ran
    past it, another stage stopped by its limit says that stage was stopped."""
    lengths = _stage_folder(tmp_path)
    write_json(tmp_path / "kernel.json", {"run": "r", "rows": [
        {"n_h": n, "T": T, "fwd_ms": 1.0, "fwd_bwd_ms": 2.0} for T in lengths for n in (1, 2)]})
    write_json(tmp_path / "fla.json", {"run": "r", "rows": [{"T": 64, "fwd_ms": 0.0, "fwd_bwd_ms": 1.0}],
                                       "stopped": "ran past its 90 s limit"})
    write_json(tmp_path / "layers.json", {"rows": [{"mixer": "m", "T": 64, "fwd_bwd_ms": 1.0}],
                                          "stopped": "ran past its 60 s limit"})
    summary, _ = gpu_report.summarize(tmp_path)
    assert summary["kernel_vs_fla"]["delta_rule"] == {
        "64": "not measured: fwd_ms of the baseline is 0",
        "256": "not measured: autotune ran past the limit (the fla stage ran past its 90 s limit)"}
    assert summary["layer_vs_sdpa"]["m"]["64"] == "not measured: the layers stage ran past its 60 s limit"


def test_checking_a_folder_judges_the_two_step_ratio_of_its_kernel_json(tmp_path, capsys):
    """``--check`` of a finished folder: every summary target met, DeltaProduct's two steps over one from its
    kernel.json above 2.4 at one length: missed, exit 1."""
    summary = _summary(lengths=("64", "256"))
    for T in ("64", "256"):
        summary["kernel_vs_fla"]["delta_rule"][T] = _draw(0.1, 1.2)
        summary["layer_vs_sdpa"]["m"] = {"64": _draw(0.1, 1.0), "256": _draw(0.1, 0.5)}
        summary["lm_vs_attention"]["m"] = {"64": _draw(0.9, 3), "256": _draw(1.5, 3)}
    summary["launches"] = {n: {"64": 7, "256": 7} for n in ("attention", "m")}
    write_json(tmp_path / "summary.json", summary)
    slow = _draw(2.41, 4)
    write_json(tmp_path / "kernel.json", {"rows": [{"n_h": 1, "T": T, "fwd_ms": 1.0, "fwd_bwd_ms": 1.0}
                                                   for T in (64, 256)] + [
        {"n_h": 2, "T": 64, "fwd_ms": 2.0, "fwd_bwd_ms": 2.0}, {"n_h": 2, "T": 256, "fwd_ms": 2.0, "fwd_bwd_ms": slow}]})
    assert gpu_report.check_folder(tmp_path) == 1
    missed = [line for line in capsys.readouterr().out.splitlines() if line.endswith("| missed |")]
    assert len(missed) == 1 and "DeltaProduct n_h 2 / n_h 1, T 256" in missed[0]


# --- layer_resources.py -------------------------------------------------------------------------------------


def test_the_reserved_shared_memory_per_block_can_cost_a_block():
    """Two blocks of 114 KB fill sm_90's 228 KB, but with 1 KB reserved for each only one fits; the count follows
    ``floor(233472 / (shared + 1024))`` for any shared size."""
    assert layer_resources.blocks_per_sm(16, 1, 116000, 90) == (1, "shared")
    shared = _int(20_000, 200_000)
    assert layer_resources.blocks_per_sm(8, 1, shared, 90)[0] == min(32, 233472 // (shared + 1024))


def test_the_table_gives_shared_memory_in_kib_and_the_command_fails_on_a_failed_launch(monkeypatch, capsys):
    """A launch's row shows its shared memory in KiB and its blocks; a launch that fails the compile rules makes
    the command exit 1, all passing exit 0."""
    shared = _int(1, 100) * 1024 + 512
    launch = types.SimpleNamespace(name="k", constexprs=(("BLOCK", 64),), num_warps=4)
    results = [types.SimpleNamespace(launch=launch, registers=64, spill_stores=0, spill_loads=0, shared=shared,
                                     arch=90, error=None, ok=True)]
    monkeypatch.setattr(layer_resources, "table_rows", lambda rs: [["ok"]])
    monkeypatch.setattr(layer_resources, "interpreting_refused", lambda command: False)
    monkeypatch.setattr(layer_resources, "layer_results", lambda mixer, arch, T: results)
    row = layer_resources.rows("m", results)[0]
    assert row[6] == f"{shared / 1024:.1f}" and row[7].startswith(f"{layer_resources.blocks_per_sm(64, 4, shared, 90)[0]} (")
    assert layer_resources.main(["gated_deltanet"]) == 0
    results[0].ok = False
    assert layer_resources.main(["gated_deltanet"]) == 1
    capsys.readouterr()


def test_captured_times_are_compared_only_where_both_sides_captured_theirs_faithfully():
    """A layer (or language model) is compared by its captured graph's time (rate) only where it and the baseline
    both captured one with every gap within the limit; one side eager or off by a gap: both sides eager."""
    def layer(gap=None):
        row = {"fwd_bwd_ms": _draw(1, 10)}
        if gap is not None:
            row.update(graph_fwd_bwd_ms=_draw(0.5, 5), graph_output_gap=gap, graph_grad_gap=_draw(0, 1e-3))
        return row

    def lm(gap=None):
        row = {"tokens_per_second": _draw(1, 10)}
        if gap is not None:
            row.update(graph_tokens_per_second=_draw(1, 10), graph_loss_gap=_draw(0, 1e-3), graph_grad_gap=gap)
        return row

    good, bad = _draw(0, 1e-3), _draw(0.02, 1)
    assert gpu_report.layer_mode(layer(good), layer(good)) == "graph_fwd_bwd_ms"
    for mine, base in ((layer(good), layer()), (layer(), layer(good)), (layer(good), layer(bad)),
                       (layer(bad), layer(good))):
        assert gpu_report.layer_mode(mine, base) == "fwd_bwd_ms", (mine, base)
    assert gpu_report.lm_mode(lm(good), lm(good)) == "graph_tokens_per_second"
    for mine, base in ((lm(good), lm()), (lm(), lm(good)), (lm(good), lm(bad)), (lm(bad), lm(good))):
        assert gpu_report.lm_mode(mine, base) == "tokens_per_second", (mine, base)
