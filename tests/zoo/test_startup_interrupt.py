"""A Ctrl-C while ``zoo`` is still importing its modules ends the command in one line with exit status 130, as a
Ctrl-C during a command does, through both entry points (``python -m zoo`` and the installed ``zoo`` script).
The interrupt is delivered without timing: an import finder raises KeyboardInterrupt when the command line's
import reaches a chosen module, at the moment a real Ctrl-C would interrupt that import. Before, the
interrupt printed a Python traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

#: installs a finder that raises KeyboardInterrupt on the first import of the module named in argv[1]
INTERRUPT_AT = """
import sys
target = sys.argv.pop(1)

class InterruptAt:
    def find_spec(self, name, path=None, module=None):
        if name == target:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, InterruptAt())
sys.argv[0] = "zoo"
"""
#: the two entry points: python -m zoo, and the script pip installs for zoo = "zoo.cli:main"
ENTRY_POINTS = {"python -m zoo": "import runpy\nrunpy.run_module('zoo', run_name='__main__', alter_sys=True)\n",
                "zoo script": "from zoo.cli import main\nsys.exit(main())\n"}


def _modules_the_command_line_imports() -> list[str]:
    """The modules the imports of ``zoo.cli`` load beyond what ``import zoo`` does: this project's, and the top-level
    packages it imports itself; but ``zoo.errors``, which defines the one-line handler and is imported before it."""
    listed = subprocess.run([sys.executable, "-c", "import sys, zoo\nbefore = set(sys.modules)\nimport zoo.cli\n"
                             "print(*sorted(set(sys.modules) - before))"],
                            capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    return [m for m in listed if (m.startswith("zoo.") or m in ("torch", "triton", "tabulate", "matplotlib"))
            and m not in ("zoo.cli", "zoo.errors")]  # zoo.errors holds the handler itself (a few lines, no imports)


def _run(entry: str, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", INTERRUPT_AT + ENTRY_POINTS[entry], module, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_interrupt_while_importing_ends_in_one_line_with_130(entry):
    modules = _modules_the_command_line_imports()
    assert {"zoo.preflight", "tabulate", "torch"} <= set(modules), modules
    module = modules[int(torch.randint(len(modules), ()))]
    _assert_one_line_130(_run(entry, module, "list"), module)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_interrupt_while_torch_loads_ends_in_one_line_with_130(entry):
    """torch is most of the start-up time, so the likeliest moment of a Ctrl-C: ``import zoo`` must not load it."""
    _assert_one_line_130(_run(entry, "torch", "list"), "torch")


def _assert_one_line_130(out: subprocess.CompletedProcess, module: str) -> None:
    assert out.returncode == 130, (module, out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.strip() == "zoo: interrupted while starting; nothing was run", \
        (module, out.stderr)
    assert out.stdout == ""


def test_without_an_interrupt_the_command_runs():
    out = _run("zoo script", "a_module_no_one_imports", "list")
    assert out.returncode == 0 and "Tasks (task.name)" in out.stdout, out.stderr


def test_an_interrupt_before_the_command_line_module_starts_ends_in_one_line_with_130():
    out = _run("python -m zoo", "zoo.cli", "list")
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == "zoo: interrupted while starting; nothing was run"
