"""zoo.benchmark.launch_tune: on the interpreter every kernel of a layer is timed under its launchers' options and
every variant, the fastest is picked per kernel, the tuned layer computes exactly what the default does (the
interpreter ignores warps and stages), and a variant that does not compile or load is left out for its kernel only."""
import json
import subprocess
import sys

import pytest
import torch

from kernels import launch_table
from kernels.backend import triton_interpreting
from tests.kernels.harness import compiler_env
from zoo.benchmark import launch_tune

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreting(),
                                reason="the dry run is the CPU pipeline")


def _check(out: dict, variants) -> None:
    assert "error" not in out, out
    assert out["kernels"], "no kernel was tuned"
    for name, row in out["kernels"].items():
        assert [(v["num_warps"], v["num_stages"]) for v in row["variants"]] == [tuple(v) for v in variants]
        timed = [v["ms"] for v in row["variants"] if "ms" in v] + [row["default"]["ms"]]
        assert all(ms > 0 for ms in timed), name
        assert row["best"]["ms"] == min(timed), name
    assert out["layer"]["difference"] == 0.0 and out["layer"]["agrees"]
    assert out["layer"]["default_ms"] > 0 and out["layer"]["tuned_ms"] > 0


def test_every_kernel_of_a_layer_is_timed_under_every_variant():
    out = launch_tune.tune_layer("mamba2", launch_tune.DRY, 16, launch_tune.DRY_VARIANTS, 0, 1)
    _check(out, launch_tune.DRY_VARIANTS)
    assert set(out["kernels"]) >= {"ssd._chunk_state", "ssd._chunk_out", "ssd._chunk_bwd_x", "ssd._chunk_bwd_bc"}


def test_a_variant_that_does_not_compile_is_left_out_for_its_kernel_only(monkeypatch):
    refused = ("ssd._chunk_out", 8, 1)

    def runs(layer, options):
        bad = options.get(refused[0])
        if bad and (bad["num_warps"], bad["num_stages"]) == refused[1:]:
            return "OutOfResources: shared memory"
        return None
    monkeypatch.setattr(launch_tune, "_runs", runs)
    out = launch_tune.tune_layer("mamba2", launch_tune.DRY, 16, launch_tune.DRY_VARIANTS, 0, 1)
    for name, row in out["kernels"].items():
        errors = [v for v in row["variants"] if "error" in v]
        if name == refused[0]:
            assert [(v["num_warps"], v["num_stages"]) for v in errors] == [refused[1:]]
            assert "OutOfResources" in errors[0]["error"]
        else:
            assert not errors, name


def test_the_command_starts_the_interpreter_itself_and_refuses_a_mixer_without_kernels(tmp_path):
    env = compiler_env(OMP_NUM_THREADS="1")
    out = tmp_path / "tune.json"
    # --isolate: the mixer is tuned (and its table entries written) by a process of its own, as on CUDA
    done = subprocess.run([sys.executable, "-m", "zoo.benchmark.launch_tune", "jordan", "--dry-run", "--T", "16",
                           "--json", str(out), "--write-table", "--arch", "90", "--table-dir", str(tmp_path),
                           "--isolate"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    _check(result["mixers"]["jordan"], launch_tune.DRY_VARIANTS)
    # the table holds what launch_tune.table_entries makes of the result (the interpreter's times decide how many)
    table = launch_table.read(launch_table.table_path(90, tmp_path))
    assert len(table["entries"]) == len(launch_tune.table_entries(result))
    assert f"jordan: {len(table['entries'])} entries written into {launch_table.table_path(90, tmp_path)}" in done.stderr
    unsafe = subprocess.run([sys.executable, "-m", "zoo.benchmark.launch_tune", "jordan", "--dry-run", "--write-table"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert unsafe.returncode == 2 and "only with --arch and --table-dir" in unsafe.stderr
    refused = subprocess.run([sys.executable, "-m", "zoo.benchmark.launch_tune", "attention", "--dry-run"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no Triton kernels to tune in ['attention']" in refused.stderr


def test_a_profile_without_the_layers_kernels_is_an_error(monkeypatch):
    monkeypatch.setattr(launch_tune, "kernel_ms", lambda layer, options: {"elementwise_kernel": 1.0})
    with pytest.raises(RuntimeError, match="not in the profile, whose kernels are \\['elementwise_kernel'\\]"):
        launch_tune.tune_layer("jordan", launch_tune.DRY, 16, launch_tune.DRY_VARIANTS, 0, 1)


def test_a_run_starts_no_mixer_past_its_budget_reports_each_one_it_finishes_and_takes_a_size():
    seen = []
    out = launch_tune.tune(["jordan", "mamba2"], dry_run=True, T=16, budget=0.0,
                           after_each=lambda result, name: seen.append(name))
    assert out["skipped"] == ["jordan", "mamba2"] and out["mixers"] == {} and seen == []
    out = launch_tune.tune(["jordan"], dry_run=True, T=16, d_model=32, after_each=lambda result, name: seen.append(
        (name, sorted(result["mixers"]))))
    assert seen == [("jordan", ["jordan"])] and out["skipped"] == []
    assert (out["d_model"], out["head_dim"]) == (32, launch_tune.DRY.head_dim)   # another layer size when asked


def test_a_variant_that_faults_on_the_card_ends_the_run_naming_it_and_keeps_what_was_measured(monkeypatch):
    under = launch_tune._Layer.under

    def faulting(layer, options):   # warps 8 make some kernel of the first mixer read outside its tensors
        if layer.mixer_name == "jordan" and any(o["num_warps"] == 8 for o in options.values()):
            def call():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return call
        return under(layer, options)
    init = launch_tune._Layer.__init__

    def named(layer, name, *args):
        init(layer, name, *args)
        layer.mixer_name = name
    monkeypatch.setattr(launch_tune._Layer, "__init__", named)
    monkeypatch.setattr(launch_tune._Layer, "under", faulting)
    seen = []
    out = launch_tune.tune(["jordan", "mamba2", "bdlru"], dry_run=True, T=16,
                           after_each=lambda result, name: seen.append(name))
    error = out["mixers"]["jordan"]["error"]
    assert "variant num_warps=8, num_stages=1" in error and "illegal memory access" in error, error
    assert out["mixers"]["jordan"]["faulted_variant"] == [8, 1]   # what --isolate tunes it again without
    assert out["skipped"] == ["mamba2", "bdlru"] and out["context_lost"] == "jordan" and seen == ["jordan"]


def test_a_mixer_whose_process_faulted_is_tuned_again_without_the_variants_that_faulted(monkeypatch):
    bad = [(8, 1), (4, 2)]      # the first two processes fault, on these variants in turn; the third finishes
    calls = []

    def in_process(name, arguments):
        calls.append(arguments)
        if len(calls) <= len(bad):
            w, s = bad[len(calls) - 1]
            return {"card": "test", "mixers": {name: {"mixer": name, "faulted_variant": [w, s],
                                                      "error": f"variant num_warps={w}, num_stages={s} faulted"}}}
        return {"card": "test", "mixers": {name: {"mixer": name, "kernels": {}, "layer": {}}}}
    monkeypatch.setattr(launch_tune, "tune_in_process", in_process)
    out = launch_tune.tune_isolated(["jordan"], ["--dry-run"])
    assert calls == [["--dry-run"], ["--dry-run", "--skip-variant", "8,1"],
                     ["--dry-run", "--skip-variant", "8,1", "--skip-variant", "4,2"]]
    jordan = out["mixers"]["jordan"]
    assert "error" not in jordan and out["card"] == "test"
    assert [(v["num_warps"], v["num_stages"]) for v in jordan["faulted_variants"]] == bad
    # a mixer that keeps faulting is given up after MAX_FAULTS new processes, its last error kept
    calls.clear()
    bad[:] = [(w, 3) for w in range(launch_tune.MAX_FAULTS + 5)]
    out = launch_tune.tune_isolated(["jordan"], [])
    assert len(calls) == launch_tune.MAX_FAULTS + 1 and "faulted" in out["mixers"]["jordan"]["error"]
    assert len(out["mixers"]["jordan"]["faulted_variants"]) == launch_tune.MAX_FAULTS


def test_skipped_variants_are_not_tried():
    skip = launch_tune.DRY_VARIANTS[:1]
    out = launch_tune.tune(["jordan"], dry_run=True, T=16, skip_variants=skip)
    assert out["variants"] == [list(v) for v in launch_tune.DRY_VARIANTS[1:]]
    _check(out["mixers"]["jordan"], launch_tune.DRY_VARIANTS[1:])
    with pytest.raises(SystemExit):
        launch_tune.main(["jordan", "--dry-run", "--skip-variant", "eight"])
