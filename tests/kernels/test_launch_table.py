"""Launch tables (kernels/launch_table.py): a launch on a GPU of the table's architecture takes the options the
table measured for exactly its configuration (kernel, 16-bit tensors or not, every constexpr) and no other launch
does; options given for a tuning sweep win; a table that cannot be read stops with its file, its entry and the
fix; what launch_tune measures becomes entries that take effect.

Without a GPU the architecture is forced (:func:`kernels.launch_table.as_if_arch`) and the launches of a layer's
GPU path are counted with the options they are made with (:func:`kernels.launch.counting`, kernels not run).
"""
from __future__ import annotations

import json

import pytest
import torch

from kernels import launch_table
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting, launch_options
from mixers import build_mixer
from tests.kernels.harness import needs_triton
from zoo.benchmark import launch_tune

pytestmark = needs_triton

MEASURED = {"card": "test card", "commit": "0000000", "mixer": "jordan", "T": 64, "d_model": 32, "head_dim": 16,
            "dtype": "fp32", "launcher_ms": 1.0, "ms": 0.5}


def launches(dtype=torch.float32, arch=None, tables=None, options=None):
    """``(options, configs)`` by kernel name of one forward+backward of a small jordan layer on the GPU path."""
    layer = build_mixer("jordan", 32, {"backend": "triton"}).to(dtype)
    x = torch.randn(1, 64, 32, dtype=dtype, requires_grad=True)
    with gpu_path_on_cpu(), counting(execute=False) as launched, launch_options(options or {}):
        if arch is None:
            layer(x).float().sum().backward()
        else:
            with launch_table.as_if_arch(arch, tables):
                layer(x).float().sum().backward()
    return launched.options, launched.configs


def entry(name, config, warps=2, stages=1, **changes):
    sixteen, consts = config
    consts = {**dict(consts), **changes}
    return {"kernel": name, "sixteen_bit": sixteen, "constexprs": consts, "num_warps": warps, "num_stages": stages,
            "measured": MEASURED}


def write(tmp_path, arch, entries):
    path = launch_table.table_path(arch, tmp_path)
    path.write_text(json.dumps({"format": 1, "arch": arch, "entries": entries}))
    launch_table.options_by_kernel.cache_clear()
    return path


@pytest.fixture(autouse=True)
def _fresh_tables():
    launch_table.options_by_kernel.cache_clear()
    yield
    launch_table.options_by_kernel.cache_clear()


def test_a_launch_takes_its_tables_options_only_for_its_exact_configuration(tmp_path):
    default, configs = launches()
    name = sorted(configs)[0]
    config, other = sorted(configs[name], key=repr)    # each jordan kernel runs twice, with two configurations
    assert default[name] != {(2, 1)}
    write(tmp_path, 90, [entry(name, config)])
    tuned, _ = launches(arch=90, tables=tmp_path)
    assert tuned[name] == {(2, 1)} | default[name]      # the other configuration keeps its launcher's options
    write(tmp_path, 90, [entry(name, config), entry(name, other)])
    tuned, _ = launches(arch=90, tables=tmp_path)
    assert tuned[name] == {(2, 1)}
    assert {k: v for k, v in tuned.items() if k != name} == {k: v for k, v in default.items() if k != name}
    # another architecture, another constexpr value, other tensor widths: the launcher's own options
    assert launches(arch=80, tables=tmp_path)[0] == default
    some_constexpr = sorted(dict(config[1]))[0]
    write(tmp_path, 90, [entry(name, config, **{some_constexpr: 12345})])
    assert launches(arch=90, tables=tmp_path)[0] == default
    write(tmp_path, 90, [entry(name, (not config[0], config[1]))])
    assert launches(arch=90, tables=tmp_path)[0] == default
    # a tuning sweep's options win over the table
    write(tmp_path, 90, [entry(name, config), entry(name, other)])
    swept, _ = launches(arch=90, tables=tmp_path, options={name: {"num_warps": 8, "num_stages": 3}})
    assert swept[name] == {(8, 3)}


@pytest.mark.parametrize("table, says", [
    ("{not json", "not a readable JSON launch table"),
    ('{"format": 1, "arch": 80, "entries": []}', "says arch 80 but its name is for sm_90"),
    ('{"format": 1, "arch": 90, "entries": [{"kernel": "a.b"}]}', "entry 0 (a.b) lacks"),
    ('{"format": 1, "arch": 90, "entries": [{"kernel": "a.b", "sixteen_bit": true, "constexprs": {}, '
     '"num_warps": 3, "num_stages": 1, "measured": ' + json.dumps(MEASURED) + '}]}', "num_warps 3 is not a power of two"),
    ('{"format": 1, "arch": 90, "entries": [{"kernel": "a.b", "sixteen_bit": true, "constexprs": {}, '
     '"num_warps": 4, "num_stages": 1, "measured": {"card": "x"}}]}', "measured lacks ['commit'"),
])
def test_a_table_that_cannot_be_read_names_its_file_and_entry(tmp_path, table, says):
    path = launch_table.table_path(90, tmp_path)
    path.write_text(table)
    with pytest.raises(launch_table.LaunchTableError) as err:
        launch_table.read(path)
    assert str(path) in str(err.value) and says in str(err.value)


def test_a_table_named_for_no_architecture_is_refused(tmp_path):
    with pytest.raises(launch_table.LaunchTableError, match="is named sm_<NN>.json for its architecture"):
        launch_table.read(tmp_path / "sm_hopper.json")


def test_merging_replaces_the_same_launch_and_keeps_the_others(tmp_path):
    a = entry("x.k", (True, {"B": 64}), warps=4)
    b = entry("x.k", (True, {"B": 32}), warps=8)
    launch_table.merge(90, [a, b], tmp_path)
    launch_table.merge(90, [entry("x.k", (True, {"B": 64}), warps=16)], tmp_path)
    table = launch_table.read(launch_table.table_path(90, tmp_path))
    assert sorted((e["constexprs"]["B"], e["num_warps"]) for e in table["entries"]) == [(32, 8), (64, 16)]
    assert launch_table.lookup(90, "x.k", True, {"B": 64}, str(tmp_path)) == {"num_warps": 16, "num_stages": 1}
    assert launch_table.lookup(90, "x.k", False, {"B": 64}, str(tmp_path)) is None
    dup = launch_table.table_path(90, tmp_path)
    dup.write_text(json.dumps({"format": 1, "arch": 90, "entries": [a, a]}))
    with pytest.raises(launch_table.LaunchTableError, match="repeats the launch of an earlier entry"):
        launch_table.read(dup)


def test_what_launch_tune_measures_becomes_entries_that_take_effect(tmp_path):
    out = launch_tune.tune_layer("jordan", launch_tune.DRY, 64, launch_tune.DRY_VARIANTS, 0, 1)
    # the interpreter ignores warps: make the tuned layer the faster one, and one kernel's best another variant
    out["layer"].update(default_ms=2.0, tuned_ms=1.0, agrees=True)
    name = sorted(out["kernels"])[0]
    row = out["kernels"][name]
    row["best"] = {"num_warps": 8, "num_stages": 1, "ms": row["default"]["ms"] / 2}
    out["tuned_options"] = {name: {"num_warps": 8, "num_stages": 1}}
    result = {"card": "test card", "commit": "0000000", "d_model": launch_tune.DRY.d_model,
              "head_dim": launch_tune.DRY.head_dim, "dtype": "fp32", "mixers": {"jordan": out}}
    entries = launch_tune.table_entries(result)
    assert [(e["kernel"], e["num_warps"], e["num_stages"]) for e in entries] == [(name, 8, 1)] * len(row["configs"])
    assert len(row["configs"]) == 2 and row["configs"][0] != row["configs"][1]
    assert entries[0]["measured"]["mixer"] == "jordan" and entries[0]["measured"]["ms"] < \
        entries[0]["measured"]["launcher_ms"]
    launch_table.merge(90, entries, tmp_path)

    layer = launch_tune._Layer("jordan", launch_tune.DRY, 64, torch.device("cpu"))
    with gpu_path_on_cpu(), launch_table.as_if_arch(90, tmp_path), counting(execute=False) as launched:
        layer.forward_backward()
    assert launched.options[name] == {(8, 1)}
    # a layer that got slower, or computes something else, writes nothing
    out["layer"].update(tuned_ms=3.0)
    assert launch_tune.table_entries(result) == []
    out["layer"].update(tuned_ms=1.0, agrees=False)
    assert launch_tune.table_entries(result) == []
