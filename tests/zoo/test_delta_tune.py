"""zoo.benchmark.delta_tune: the candidate plans cover every setting of both groups of fields, and on the
interpreter every candidate runs the seven kernels and gives the current plan's outputs and gradients."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from kernels.backend import triton_interpreting
from kernels.delta.triton import block_chunk, kernel_plan
from tests.kernels.harness import compiler_env
from zoo.benchmark import delta_tune, device_time
from zoo.benchmark.delta_tune import PARALLEL_FIELDS, PARALLEL_KERNELS, STATE_FIELDS, STATE_KERNELS, candidates, combine


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_candidates_pair_every_state_setting_with_every_parallel_one_at_least_once(dim):
    current = kernel_plan(block_chunk(64, dim, dim, True), dim, dim, True)
    plans = candidates(current, dim, dim)
    assert plans[0] == current and len(set(plans)) == len(plans)
    for plan in plans:
        assert dim % plan.bv_state == 0 and dim % plan.bk == 0 and dim % plan.bv == 0
    state = {tuple(getattr(p, f) for f in STATE_FIELDS) for p in plans[1:]}
    parallel = {tuple(getattr(p, f) for f in PARALLEL_FIELDS) for p in plans[1:]}
    assert {s[0] for s in state} == {b for b in (16, 32, 64) if b <= dim}
    assert {(s[1], s[2]) for s in state} == {(4, 8), (8, 4)} and {s[3] for s in state} == {2, 3}
    assert len(parallel) == len({(p[0], p[1]) for p in parallel}) * 2
    assert len(plans) - 1 >= max(len(state), len(parallel))


def test_combine_takes_each_group_from_its_plan():
    current = kernel_plan(64, 128, 128, True)
    a = current._replace(bv_state=16, warps_fwd_state=8, stages_state=2, bk=64)
    b = current._replace(bk=32, bv=64, warps=4, bv_state=64)
    both = combine(a, b)
    assert [getattr(both, f) for f in STATE_FIELDS] == [getattr(a, f) for f in STATE_FIELDS]
    assert [getattr(both, f) for f in PARALLEL_FIELDS] == [getattr(b, f) for f in PARALLEL_FIELDS]


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreting(), reason="the dry run is the CPU pipeline")
def test_the_dry_run_times_every_kernel_of_every_candidate_and_they_agree():
    sizes = dataclasses.replace(delta_tune.DRY, T=int(torch.randint(40, 64, ())))   # a partial last chunk
    out = delta_tune.tune(sizes, dry_run=True)
    assert "error" not in out
    assert len(out["candidates"]) == len(candidates(kernel_plan(out["chunk"], 32, 32, True), 32, 32))
    for row in out["candidates"]:
        assert "error" not in row, row
        assert all(ms > 0 for ms in row["kernels"].values()) and len(row["kernels"]) == len(STATE_KERNELS + PARALLEL_KERNELS)
        assert row["difference"] <= 1e-3, row   # the interpreter: only the blocking of fp32 sums differs
    assert out["suggested"]["fwd_bwd_ms"] > 0 and out["suggested"]["current_fwd_bwd_ms"] > 0
    assert set(out["fastest_per_kernel"]) == set(delta_tune.STATE_KERNELS + delta_tune.PARALLEL_KERNELS)


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreting(), reason="the dry run is the CPU pipeline")
def test_a_current_plan_that_cannot_run_stops_the_sweep_with_its_reason():
    out = delta_tune.tune(dataclasses.replace(delta_tune.DRY, dim=256, T=16), dry_run=True)
    assert out["error"].startswith("the current plan failed") and "head dims" in out["error"]
    assert len(out["candidates"]) == 1 and "suggested" not in out


@pytest.mark.skipif(torch.cuda.is_available() or not triton_interpreting(), reason="the dry run is the CPU pipeline")
def test_a_profile_without_the_kernels_is_an_error_not_a_ranking(monkeypatch):
    monkeypatch.setattr(delta_tune, "breakdown",
                        lambda fn, device: device_time.group([("elementwise_kernel", 5.0), ("_fwd_state", 1.0)]))
    out = delta_tune.tune(dataclasses.replace(delta_tune.DRY, T=16), dry_run=True)
    assert out["error"].startswith("the current plan failed") and "elementwise_kernel" in out["error"]
    assert "suggested" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU pipeline")
def test_the_command_starts_the_interpreter_itself_for_a_dry_run(tmp_path):
    out = tmp_path / "tune.json"
    done = subprocess.run([sys.executable, "-m", "zoo.benchmark.delta_tune", "--dry-run", "--T", "16", "--json", str(out)],
                          env=compiler_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["sizes"]["T"] == 16 and result["suggested"]["speedup"] > 0
