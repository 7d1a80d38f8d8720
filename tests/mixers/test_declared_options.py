"""Options and backends are declared once.

- Every numeric option of every registered mixer and state mixer declares its range with ``opt(...)``
  (so it is validated with its key path and shown by ``zoo list --options``), and its default is in it.
- No ``__post_init__`` in ``mixers/`` checks a single field: those hold only rules across fields.
- Each mixer's ``backend`` choices are ``auto`` plus its kernel family's ``BACKENDS``.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

import kernels.attention
import kernels.blockscan
import kernels.delta
import kernels.gka
import kernels.gla
import kernels.ska
import kernels.slots
import kernels.ssd
import mixers
from mixers import MIXERS, STATE_MIXERS, build_mixer
from mixers.options import OptionError, check_range, describe_options, has_range

OPTION_CLASSES = [(f"{reg.kind} {name}", reg.get(name).Options) for reg in (MIXERS, STATE_MIXERS) for name in reg.names()]


def _numeric(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


@pytest.mark.parametrize("name, cls", OPTION_CLASSES, ids=[n for n, _ in OPTION_CLASSES])
def test_every_numeric_option_declares_its_range(name, cls):
    hints = typing.get_type_hints(cls)
    numeric = [f for f in dataclasses.fields(cls) if _numeric(hints[f.name])]
    assert [f.name for f in numeric if not has_range(f)] == [], f"{name}: declare a range with opt(...)"
    shown = {row["name"]: row["range"] for row in describe_options(cls)}
    assert all(shown[f.name] for f in numeric), f"{name}: zoo list --options would show an empty range"
    for f in numeric:
        default = f.default if f.default is not dataclasses.MISSING else None
        check_range(default, f.metadata["range"], f"{name}.{f.name}")   # the default is in its own range


def _single_field_rules(source: str) -> list[int]:
    """Line numbers of checks in a ``__post_init__`` that raise on one field only (counting the fields of the
    ``if`` statements that enclose them)."""
    found = []

    def fields(expr):
        return {n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}

    def visit(node, outer: frozenset):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If):
                seen = outer | fields(child.test)
                if len(seen) == 1 and any(isinstance(s, ast.Raise) for s in child.body):
                    found.append(child.lineno)
                for part in child.body + child.orelse:
                    visit(ast.Module(body=[part], type_ignores=[]), seen)
            elif isinstance(child, ast.For) and any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"
                                                     for n in ast.walk(child)):
                found.append(child.lineno)  # a loop of getattr(self, name) checks: one field at a time
            else:
                visit(child, outer)

    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__":
            visit(fn, frozenset())
    return found


def test_no_post_init_checks_a_single_field():
    root = Path(mixers.__file__).parent
    offenders = {p.name: lines for p in sorted(root.glob("*.py")) if (lines := _single_field_rules(p.read_text()))}
    assert offenders == {}, "declare single-field ranges with opt(at_least=..., above=..., at_most=..., below=...)"


def test_the_grep_finds_single_field_rules():
    bad = ("class O:\n    def __post_init__(self):\n        if self.n <= 0:\n            raise ValueError('n')\n"
           "        for f in ('a', 'b'):\n            if getattr(self, f) < 1:\n                raise ValueError(f)\n"
           "        if self.backend == 'triton':\n            if self.chunk < 16:\n                raise ValueError\n"
           "            if self.backend == 'x':\n                raise ValueError\n")
    assert _single_field_rules(bad) == [3, 5, 11]


FAMILIES = {"attention": kernels.attention, "bdlru": kernels.blockscan, "jordan": kernels.blockscan,
            "deltaproduct": kernels.delta, "deltanet": kernels.delta, "gated_deltanet": kernels.delta,
            "gka": kernels.gka, "gla": kernels.gla, "ska": kernels.ska, "mamba2": kernels.ssd,
            "kronecker_slots": kernels.slots}
#: accepted older spellings that are not backends of the family
ALIASES = {"kronecker_slots": ("dense", "sparse")}


@pytest.mark.parametrize("name", MIXERS.names())
def test_backend_choices_come_from_the_kernel_family(name):
    field = {f.name: f for f in dataclasses.fields(MIXERS.get(name).Options)}.get("backend")
    if field is None:
        assert name not in FAMILIES
        return
    assert name in FAMILIES, f"{name}: add its kernel family to FAMILIES"
    assert field.metadata["choices"] == ("auto", *FAMILIES[name].BACKENDS, *ALIASES.get(name, ()))


def test_gla_offers_no_backend_it_refuses():
    build_mixer("gla", 16, {"backend": "triton"})
    with pytest.raises(OptionError, match="'mamba_ssm' is not one of 'auto', 'reference', 'torch', 'triton', 'fla'"):
        build_mixer("gla", 16, {"backend": "mamba_ssm"})


@pytest.mark.parametrize("name, options, message", [
    ("attention", {"rope_base": 0.0}, "rope_base: 0.0 is out of range: must be > 0"),
    ("deltanet", {"norm_eps": 0.0}, "norm_eps: 0.0 is out of range: must be > 0"),
    ("jordan", {"rho": 1.0}, "rho: 1.0 is out of range: must be > 0 and < 1"),
    ("gka", {"ridge_a": 0.0, "ridge_eps": 0.0}, "cannot both be 0"),
    ("kronecker_slots", {"d_p": 1}, "d_p: 1 is out of range: must be >= 2"),
])
def test_declared_ranges_refuse_with_the_key_path(name, options, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(")):
        build_mixer(name, 16, options)
