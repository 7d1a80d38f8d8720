"""zoo.benchmark.device_time: a call's kernels grouped by name, counted and timed, on the CPU stand-in (ATen
operators) and through torch.profiler's events (CPU events here, the device's on a GPU)."""
import pytest
import torch
from torch.profiler import ProfilerActivity

from kernels.backend import triton_interpreting
from kernels.launch import counting
from zoo.benchmark.device_time import (
    NAME_CHARS,
    breakdown,
    cpu_breakdown,
    group,
    host_issue,
    is_annotation,
    profiled_events,
    short_name,
    warnings_of_this_thread,
)


def _three_products_and_a_sum(n: int):
    a, b = torch.randn(n, n), torch.randn(n, n)

    def call():
        c = a @ b
        c = c @ b
        c = c @ b
        return c.sum()
    return call


def test_the_cpu_stand_in_counts_and_times_every_operator():
    n = int(torch.randint(96, 160, ()))
    found = cpu_breakdown(_three_products_and_a_sum(n))
    by_name = {k["name"]: k for k in found.kernels}
    assert by_name["aten.mm.default"]["calls"] == 3 and by_name["aten.sum.default"]["calls"] == 1
    assert found.launches == sum(k["calls"] for k in found.kernels) == 4
    assert found.device_ms == pytest.approx(sum(k["ms"] for k in found.kernels), abs=1e-3)
    assert all(k["ms"] > 0 for k in found.kernels)
    # longest first (which operator is longest is the machine's business: a preempted sum can outlast the products)
    assert [k["ms"] for k in found.kernels] == sorted((k["ms"] for k in found.kernels), reverse=True)
    assert breakdown(_three_products_and_a_sum(n), torch.device("cpu")).launches == 4


def test_grouping_sums_by_name_and_orders_longest_first():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    names = ["void k_a<float>(float*)", "k_b", "k_c"]
    timed = [(names[int(torch.randint(3, (), generator=g))], float(torch.rand((), generator=g)) * 100)
             for _ in range(50)]
    found = group(timed)
    assert found.launches == 50
    assert found.device_ms == pytest.approx(sum(us for _, us in timed) / 1e3)
    for name in set(n for n, _ in timed):
        entry = next(k for k in found.kernels if k["name"] == short_name(name))
        assert entry["calls"] == sum(1 for n, _ in timed if n == name)
        assert entry["ms"] == pytest.approx(sum(us for n, us in timed if n == name) / 1e3, abs=1e-4)
    assert [k["ms"] for k in found.kernels] == sorted((k["ms"] for k in found.kernels), reverse=True)


def test_kernel_names_are_shortened_for_tables():
    assert short_name("void at::native::elementwise_kernel<128, 4>(int, \n  Functor)") == \
        "at::native::elementwise_kernel<128, 4>(int, Functor)"
    long = "void " + "x" * 300
    assert len(short_name(long)) == NAME_CHARS and short_name(long).endswith("...")
    assert short_name("_fwd_state") == "_fwd_state"


def test_profiler_events_carry_their_durations():
    """The profiler call the CUDA breakdown makes, on CPU events: names and positive durations."""
    n = int(torch.randint(128, 192, ()))
    events = profiled_events(_three_products_and_a_sum(n), ProfilerActivity.CPU, torch.autograd.DeviceType.CPU)
    names = [name for name, _ in events]
    assert names.count("aten::mm") == 3 and all(us >= 0 for _, us in events)
    assert sum(us for name, us in events if name == "aten::mm") > 0


@pytest.mark.gpu
def test_cuda_kernels_are_listed_with_device_times():
    a = torch.randn(512, 512, device="cuda")
    found = breakdown(lambda: (a @ a @ a).sum(), torch.device("cuda"))
    assert found.launches >= 3 and found.device_ms > 0
    assert sum(k["calls"] for k in found.kernels) == found.launches


@pytest.mark.gpu
def test_host_issue_finds_each_wait_for_the_device_and_where_it_is_asked():
    a = torch.randn(256, 256, device="cuda")
    n = int(torch.randint(2, 5, ()).item())

    def call():
        for _ in range(n):
            (a @ a).sum().item()   # each .item() waits for the device
        a @ a                      # queued, not waited for

    found = host_issue(call, torch.device("cuda"))
    assert found["syncs"] == n and found["host_ms"] > 0
    assert len(found["sync_sites"]) == 1 and found["sync_sites"][0].startswith(__file__), found["sync_sites"]
    assert host_issue(lambda: a @ a, torch.device("cuda"))["syncs"] == 0


def test_record_function_ranges_are_not_counted_as_work():
    from types import SimpleNamespace
    kernel = SimpleNamespace(name="_fwd_state", is_user_annotation=False, activity_type="kernel")
    range_on_device = SimpleNamespace(name="Optimizer.step#AdamW.step", is_user_annotation=True,
                                      activity_type="gpu_user_annotation")
    marked_by_kind = SimpleNamespace(name="ProfilerStep#1", is_user_annotation=False,
                                     activity_type="gpu_user_annotation")
    assert not is_annotation(kernel) and is_annotation(range_on_device) and is_annotation(marked_by_kind)
    n = int(torch.randint(1, 4, ()).item())

    def call():
        with torch.profiler.record_function("a range"):
            for _ in range(n):
                torch.ones(3) @ torch.ones(3)
    names = [name for name, _ in profiled_events(call, ProfilerActivity.CPU, torch.autograd.DeviceType.CPU)]
    assert "a range" not in names and names.count("aten::dot") == n, names


def test_only_the_calling_threads_warnings_are_kept():
    import threading
    import warnings
    n = int(torch.randint(1, 4, ()).item())
    with warnings_of_this_thread("synchronizing") as found:
        other = threading.Thread(target=lambda: warnings.warn("another thread synchronizing", stacklevel=1))
        other.start()
        other.join()
        for _ in range(n):
            warnings.warn("a call synchronizing", stacklevel=1)   # each time, though from one place
        warnings.warn("unrelated", stacklevel=1)
    assert len(found) == n and len(set(found)) == 1 and found[0].startswith(__file__), found


def test_host_issue_on_a_cpu_times_the_call_and_counts_no_syncs():
    import time
    found = host_issue(lambda: time.sleep(0.02), torch.device("cpu"))
    assert found["host_ms"] >= 20 and found["syncs"] is None and found["sync_sites"] == []


@pytest.mark.skipif(not triton_interpreting(), reason="times interpreted launches: needs TRITON_INTERPRET=1, "
                    "which the test suite sets")
def test_an_interpreted_triton_launch_is_one_kernel():
    """Under the interpreter a launch is timed as one kernel named as the profiler names it on CUDA, and the
    interpreter's own torch operations inside it are not counted."""
    from kernels.gate.triton import log_decay_triton
    H = 4
    args = (torch.randn(2, int(torch.randint(16, 48, ())), H), torch.randn(H), torch.randn(H))
    with counting() as launched:
        log_decay_triton(*args)
    found = cpu_breakdown(lambda: log_decay_triton(*args))
    names = {k["name"]: k["calls"] for k in found.kernels}
    for name, calls in launched.items():
        assert names[name.rsplit(".", 1)[-1]] == calls
    assert sum(launched.values()) >= 1 and found.launches < 40   # the interpreter runs hundreds of operations
