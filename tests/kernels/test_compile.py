"""Every Triton kernel compiles for sm_80 and sm_90 at the launches its launcher makes (no GPU needed).

The interpreter runs kernels as Python, so it accepts code the compiler refuses (a kernel reading a
plain module global, a loop-carried variable changing type, ``tl.dot`` on mixed operand types) and
knows nothing of shared memory. These tests close that gap:

- ``test_kernels_compile_for_sm80_and_sm90`` runs ``python -m zoo.benchmark.compile_check --ci`` in a
  process without ``TRITON_INTERPRET``: each launcher is run on meta tensors (fp32, bf16, fp16) at one
  large size of its case (``--quick``, see zoo/benchmark/compile_check.py), and one launch per kernel and
  argument types is compiled for sm_80 and sm_90 (every kernel in every dtype its launcher accepts);
  the check fails on a compile error or on shared memory above the per-block limit. Compiling every
  recorded launch (every autotune config) took tens of minutes on this project's shared 2-core
  machine, so CI compiles one configuration per kernel and dtype, and so does the command that writes the
  resource table of BENCHMARKS.md (``--ci --markdown``); ``--quick`` compiles every config at one size
  (810 launches) and without either flag it runs the whole size grid.
- ``test_every_kernel_is_in_the_check``: every ``@triton.jit`` kernel that a launcher starts appears in
  the check in every input dtype, each with the cases that recorded it listed once, and no launcher starts a
  kernel except through :func:`kernels.launch.launch` (a direct ``kernel[grid](...)`` would be invisible to the
  check).
- ``test_16_bit_products_run_on_tensor_cores``: every kernel that calls ``tl.dot`` and is launched for bf16 or
  fp16 inputs compiles to ``mma``/``wgmma`` instructions (a launcher that upcasts to fp32 before its products
  fails), unless its module declares why its products stay fp32 (``FP32_DOT_KERNELS``); fp32 inputs never
  run tf32 products. ``test_no_16_bit_arithmetic_outside_products``: no kernel adds, multiplies, divides,
  reduces or accumulates bf16/fp16 values (its Triton IR), since the interpreter cannot check bf16 arithmetic.
  ``test_precision_rules_catch_an_upcast_and_16_bit_arithmetic`` compiles one small kernel each way.
- ``test_no_kernel_reads_a_plain_global`` (and the test that it catches one): a jitted function may
  read only constexpr globals, other jitted functions and modules.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from tests.kernels.harness import compiler_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRITON_FILES = sorted((ROOT / "kernels").glob("*/triton.py"))


def _is_jit(dec) -> bool:
    node = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(node, ast.Attribute) and node.attr == "jit" or isinstance(node, ast.Name) and node.id == "jit"


def jit_functions(tree):
    return [f for f in tree.body if isinstance(f, ast.FunctionDef) and any(_is_jit(d) for d in f.decorator_list)]


def _locals(fn: ast.FunctionDef) -> set:
    names = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def plain_globals_read(path: pathlib.Path, module) -> list[str]:
    """``kernel: name`` for every module global a jitted function reads that the compiler would refuse."""
    import triton.language as tl
    bad = []
    for fn in jit_functions(ast.parse(path.read_text())):
        local = _locals(fn)
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in local:
                continue
            if not hasattr(module, node.id):
                if not hasattr(builtins, node.id):
                    bad.append(f"{fn.name}: {node.id} (undefined)")
                continue
            value = getattr(module, node.id)
            jitted = hasattr(value, "arg_names") and hasattr(value, "fn")
            if not (isinstance(value, (tl.constexpr, types.ModuleType)) or jitted):
                bad.append(f"{fn.name}: {node.id} = {value!r}")
    return bad


def _module(path: pathlib.Path):
    return importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))


@pytest.mark.parametrize("path", TRITON_FILES, ids=lambda p: p.parent.name)
def test_no_kernel_reads_a_plain_global(path):
    assert plain_globals_read(path, _module(path)) == []


def test_plain_global_check_catches_one(tmp_path, monkeypatch):
    src = ("import triton\nimport triton.language as tl\n_PREC = 'ieee'\n_OK = tl.constexpr('ieee')\n\n"
           "@triton.jit\ndef k(x, B: tl.constexpr):\n    a = tl.arange(0, B)\n"
           "    tl.dot(a, a, input_precision=_PREC)\n    tl.dot(a, a, input_precision=_OK)\n")
    path = tmp_path / "fake_kernels.py"
    path.write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plain_globals_read(path, importlib.import_module("fake_kernels")) == ["k: _PREC = 'ieee'"]


def entry_kernels(path: pathlib.Path) -> set:
    """Jitted functions of a module that no other jitted function calls (the ones launchers start)."""
    fns = jit_functions(ast.parse(path.read_text()))
    called = {n.func.id for f in fns for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return {f"{path.parent.name}.{f.name}" for f in fns if f.name not in called}


def direct_launches(path: pathlib.Path) -> list[str]:
    """``name[grid](...)`` calls of a jitted function (launches that bypass kernels.launch.launch)."""
    jitted = {f.name for f in jit_functions(ast.parse(path.read_text()))}
    return [n.func.value.id for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in jitted]


@pytest.fixture(scope="module")
def check_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = compiler_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    proc = subprocess.run([sys.executable, "-m", "zoo.benchmark.compile_check", "--ci", "--jobs", jobs, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.exists(), f"compile_check did not run:\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def test_kernels_compile_for_sm80_and_sm90(check_report):
    proc, report = check_report
    failed = [r for r in report["results"] if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} sm_{r['arch']} {r['config']}: {r['status']}" for r in failed[:20])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["arch"] for r in report["results"]} == {80, 90}
    for r in report["results"]:
        assert r["shared"] <= r["shared_limit"] and r["registers"] > 0, r


def test_every_kernel_is_in_the_check(check_report):
    _, report = check_report
    for path in TRITON_FILES:
        assert direct_launches(path) == [], f"{path}: launch kernels through kernels.launch.launch"
    entries = set().union(*(entry_kernels(p) for p in TRITON_FILES))
    for r in report["results"]:  # a case that launches a kernel twice records it once
        assert len(r["cases"]) == len(set(r["cases"])), (r["kernel"], r["cases"])
    for dtype in ("fp32", "bf16", "fp16"):
        seen = {r["kernel"] for r in report["results"] if dtype in r["recorded_for"]}
        assert entries <= seen, f"{dtype}: kernels no launcher case reaches: {sorted(entries - seen)}"


def test_16_bit_products_run_on_tensor_cores(check_report):
    _, report = check_report
    missing = [f"{r['kernel']} sm_{r['arch']} ({r['pointers']} pointers for {'/'.join(r['case_dtypes'])} inputs)"
               for r in report["results"] if r["calls_dot"] and set(r["case_dtypes"]) & {"bf16", "fp16"}
               and r["tensor_core_ops"] == 0 and not r["fp32_dots_because"]]
    assert not missing, "tl.dot kernels without a tensor-core instruction for 16-bit inputs:\n" + "\n".join(missing)
    tf32 = [f"{r['kernel']} sm_{r['arch']}" for r in report["results"] if r["pointers"] == "fp32" and r["tf32_ops"]]
    assert not tf32, f"fp32 inputs multiplied in tf32: {tf32}"


def test_no_16_bit_arithmetic_outside_products(check_report):
    _, report = check_report
    rounded = [f"{r['kernel']} sm_{r['arch']} ({r['pointers']}): {r['half_arith_ops']}" for r in report["results"]
               if r["half_arith_ops"]]
    assert not rounded, "rounding operations on 16-bit values (compute in fp32, round once as an operand):\n" + \
        "\n".join(rounded)


_TINY_DOT = """
import triton
import triton.language as tl


@triton.jit
def tiny_dot(a_ptr, b_ptr, c_ptr, UPCAST: tl.constexpr, HALF_ARITH: tl.constexpr = False):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    if HALF_ARITH:     # a 16-bit product of elements, rounded to bf16 before the dot
        a = a * b
    else:              # the same computed in fp32, rounded once as the dot's operand
        a = (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype)
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    tl.store(c_ptr + r[:, None] * 16 + r[None, :], c)
"""


def test_precision_rules_catch_an_upcast_and_16_bit_arithmetic(tmp_path, monkeypatch):
    """The tensor-core rule reads the PTX: bf16 operands give mma/wgmma, the same product after an upcast gives
    none. The arithmetic rule reads the Triton IR: an elementwise product computed in bf16 fails, the same
    product computed in fp32 and rounded once as the dot's operand passes."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.delenv("TRITON_INTERPRET")
    (tmp_path / "tiny_dot_kernels.py").write_text(_TINY_DOT)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = ("import json, sys\n"
            "from kernels.launch import Launch\n"
            "from zoo.benchmark.compile_check import compile_launch\n"
            "from tiny_dot_kernels import tiny_dot\n"
            "out = []\n"
            "for upcast, half in ((False, False), (True, False), (False, True)):\n"
            "    launch = Launch(tiny_dot, (('a_ptr', '*bf16'), ('b_ptr', '*bf16'), ('c_ptr', '*fp32')),\n"
            "                    (('UPCAST', upcast), ('HALF_ARITH', half)), tags=(('tiny', 'bf16', ''),))\n"
            "    r = compile_launch(launch, 90)\n"
            "    out.append([r.error, r.dot, r.tensor_core_ops, r.missing_tensor_cores, r.half_arith_ops, r.ok])\n"
            "print(json.dumps(out))\n")
    env = compiler_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16, upcast, half = json.loads(proc.stdout.splitlines()[-1])
    assert bf16[0] is None and upcast[0] is None and half[0] is None
    assert bf16[1] and upcast[1]
    assert bf16[2] > 0 and not bf16[3] and bf16[4] == 0 and bf16[5]
    assert upcast[2] == 0 and upcast[3] and not upcast[5]
    # the one multiplication rounded to bf16 (tensor cores or not) fails the check
    assert half[2] > 0 and not half[3] and half[4] == 1 and not half[5]
