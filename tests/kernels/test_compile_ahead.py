"""Compiling a run's Triton kernels ahead of it (kernels.ahead).

- ``test_a_layer_compiled_ahead_finds_its_kernels``: in a process without ``TRITON_INTERPRET`` and with a
  stand-in CUDA driver (``python -m zoo.benchmark.first_compile``), a layer's forward+backward compiled
  ahead on two threads compiles as many kernels as the distinct launches :func:`kernels.launch.recording`
  lists for it (an independent model of Triton's specialisation), and a second compile-ahead of the same
  call compiles none: every launch found the kernel the first one compiled, under the key a launch looks up.
- Under the interpreter: launches inside a compile-ahead are warmed up, never run; a nested compile-ahead
  joins the outer one; a CPU tensor (or the interpreter) has nothing to compile and the module never runs.
- On CUDA (GPU-marked): a layer compiled ahead leaves no gradient and the random streams where they were,
  and its real forward+backward afterwards compiles nothing (Triton's cache hook, asked before every
  compile, is never asked).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from kernels import ahead
from kernels.launch import launch
from tests.kernels.harness import compiler_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mixer", ["gated_deltanet", "kronecker_slots"])
def test_a_layer_compiled_ahead_finds_its_kernels(mixer, tmp_path):
    env = compiler_env()
    rows = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "zoo.benchmark.first_compile", "--toy", "--threads", "2",
                           "--modes", "ahead", "--json", str(rows), mixer],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(rows.read_text())
    assert row["threads"] == 2 and row["launches"] >= row["compiled"] > 5, row
    assert row["compiled"] == row["distinct_launches"], row
    assert row["recompiled"] == 0, row


class _StubCompiled:
    """Stands for a compiled kernel: its first launch (``_init_handles``) loads it; records the thread."""

    def __init__(self):
        self.module, self.loads = None, []

    def _init_handles(self):
        self.loads.append(threading.current_thread().name)
        self.module = "loaded"


class _StubKernel:
    """Stands for a JITFunction: records warm-ups (each compiles a kernel into its cache), refuses to run."""

    def __init__(self):
        self.device_caches, self.warmed = {}, []

    def __getitem__(self, grid):
        raise AssertionError("a kernel ran inside a compile-ahead")

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((args, grid, kwargs))
        self.device_caches.setdefault(0, ({},))[0][("key", len(self.warmed))] = _StubCompiled()


def test_launches_inside_a_compile_ahead_are_warmed_up_not_run(monkeypatch):
    monkeypatch.setattr(ahead, "triton_interpreting", lambda: False)  # the stub compiles, the interpreter not
    kernel, x = _StubKernel(), torch.randn(3)
    report = ahead.compile_ahead(lambda: [launch(kernel, (4,), x, 7, BLOCK=16) for _ in range(2)], workers=1)
    assert [(a[1], g, kw) for a, g, kw in kernel.warmed] == [(7, (4,), {"BLOCK": 16})] * 2
    assert all(a[0] is x for a, _, _ in kernel.warmed)
    assert (report.launches, report.compiled, report.workers, report.skipped) == (2, 2, 1, None)
    cached = list(kernel.device_caches[0][0].values())
    assert report.loaded == 2 and [c.loads for c in cached] == [[threading.current_thread().name]] * 2
    assert report.describe().startswith("compiled 2 Triton kernels for 2 launches ahead (2 loaded onto the device) in ")
    assert ahead.warming_up() is None  # over once it returns

    def nested():
        inner.append(ahead.compile_ahead(lambda: launch(kernel, (1,), x, 1)))
        launch(kernel, (2,), x, 2)

    inner = []
    outer = ahead.compile_ahead(nested, workers=1)
    assert outer.launches == 2 and inner[0].launches == 1 and "joined" in inner[0].skipped


def test_a_compile_ahead_says_where_its_time_went(monkeypatch):
    """The run (here compiling at each launch, one thread), the wait and the loading add up to the whole, each
    measured where it happens: a stand-in clock that a compile advances by 1 s and a load by 10 s."""
    clock = [100.0]
    monkeypatch.setattr(ahead, "triton_interpreting", lambda: False)
    monkeypatch.setattr(ahead.time, "perf_counter", lambda: clock[0])

    class SlowCompiled(_StubCompiled):
        def _init_handles(self):
            clock[0] += 10.0
            super()._init_handles()

    class SlowKernel(_StubKernel):
        def warmup(self, *args, grid, **kwargs):
            clock[0] += 1.0
            self.warmed.append((args, grid, kwargs))
            self.device_caches.setdefault(0, ({},))[0][("key", len(self.warmed))] = SlowCompiled()

    kernel, x = SlowKernel(), torch.randn(3)
    n = int(torch.randint(1, 5, ()))
    report = ahead.compile_ahead(lambda: [launch(kernel, (1,), x, i) for i in range(n)], workers=1)
    assert (report.run_seconds, report.wait_seconds, report.load_seconds, report.seconds) == (n, 0, 10 * n, 11 * n)
    assert f"(the run {float(n):.1f} s, then waiting for compiles 0.0 s, loading {10.0 * n:.1f} s)" in report.describe()


def test_nothing_to_compile_on_a_cpu_or_under_the_interpreter():
    class Refuses(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("the module ran although nothing can be compiled")

    report = ahead.forward_backward_ahead(Refuses(), torch.randn(2, 3))
    assert report.launches == 0 and "cpu" in report.skipped
    assert "CUDA" in ahead.skip_reason(torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert "interpreter" in ahead.skip_reason(torch.device("cuda"))
        ran = []
        report = ahead.compile_ahead(lambda: ran.append(1))
        assert not ran and "interpreter" in report.skipped and report.describe().startswith("no kernels")


@pytest.mark.gpu
def test_a_layer_compiled_ahead_runs_without_compiling_and_keeps_its_state():
    from mixers import build_mixer

    torch.manual_seed(0)
    layer = build_mixer("gated_deltanet", 256, {"backend": "triton", "n_heads": 2}).cuda().bfloat16()
    x = torch.randn(1, 1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rng = torch.cuda.get_rng_state(), torch.get_rng_state()
    report = ahead.forward_backward_ahead(layer, x)
    assert report.skipped is None and report.launches > 0 and report.loaded == report.compiled
    assert all(p.grad is None for p in layer.parameters()) and x.grad is None
    assert torch.equal(rng[0], torch.cuda.get_rng_state()) and torch.equal(rng[1], torch.get_rng_state())
    # the real call: every launch finds its kernel (Triton asks its cache hook only before a compile)
    import triton

    misses = []
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.jit_cache_hook = lambda **hook: misses.append(hook["repr"]) and False
        layer(x).backward(torch.randn_like(x))
        torch.cuda.synchronize()
    assert misses == []


def test_a_compile_ahead_loads_the_kernels_it_compiled_on_its_threads_and_no_others(monkeypatch):
    """Loading a kernel (its binary onto the device, its launcher built: a C compile with Triton <= 3.6) is
    what a first launch does after compiling; a compile-ahead does it too, on its threads, for the kernels it
    compiled; a kernel compiled before keeps its state, and a Triton without that step loads nothing."""
    monkeypatch.setattr(ahead, "triton_interpreting", lambda: False)
    kernel, x = _StubKernel(), torch.randn(3)
    launch_count = int(torch.randint(2, 6, ()).item())
    kernel.device_caches[0] = ({("before", 0): _StubCompiled()},)
    report = ahead.compile_ahead(lambda: [launch(kernel, (1,), x, i) for i in range(launch_count)], workers=2)
    cache = kernel.device_caches[0][0]
    assert report.loaded == report.compiled == launch_count
    assert cache[("before", 0)].loads == []
    new = [c for k, c in cache.items() if k[0] == "key"]
    assert len(new) == launch_count and all(len(c.loads) == 1 and c.loads[0].startswith("load-ahead") for c in new)
    assert ahead.load_kernels([(0, object())], workers=2) == 0          # nothing to load with
