"""The path of CONTRIBUTING.md ("Adding a mixer", "Out of tree") for a mixer kept in the author's own package.

The guide's imports are the ones an out-of-tree module needs; its pytest command runs the contract suite and the
option checks on a mixer registered by a module outside the repository (every check selected, none failing); and
a ``step`` that returns another state layout is reported in the words the guide quotes.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import contract
from .example_mixer import CumulativeMean
from .test_contract import BY_DTYPE, SIMPLE

ROOT = Path(__file__).parents[2]
GUIDE = (ROOT / "CONTRIBUTING.md").read_text()

#: an exponentially decayed running sum, y_t = W_o (gain * sum_{s<=t} 2^-(t-s) W_v x_s); its header is filled in
#: with the guide's imports
MODULE = '''"""A decayed running sum, kept outside the repository."""
{imports}


@register_mixer
class DecayedSum(Mixer):
    name = "my_mixer"
    description = "decayed running sum of a value projection"
    state_formula = "d_inner  (constant in T)"
    contract_options = {{"d_inner": 8}}

    @dataclass
    class Options:
        d_inner: int = opt(16, "width of the value projection", at_least=1)

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.v_proj = nn.Linear(d_model, options.d_inner, bias=False)
        self.o_proj = nn.Linear(options.d_inner, d_model, bias=False)
        self.gain = nn.Parameter(torch.ones(options.d_inner))
        no_weight_decay(self, "gain")

    def prefill(self, x, mask=None):
        v = self.v_proj(x) * self.gain
        t = torch.arange(x.shape[1], device=x.device, dtype=v.dtype)
        lag = t[:, None] - t[None, :]
        decay = torch.where(lag >= 0, torch.pow(2.0, -lag.clamp_min(0)), torch.zeros_like(lag))
        s = torch.einsum("ts,bsd->btd", decay, v)
        return self.o_proj(s), {{"s": s[:, -1]}}

    def init_state(self, batch_size, device=None, dtype=None):
        return {{"s": torch.zeros(batch_size, self.options.d_inner, device=device, dtype=dtype)}}

    def step(self, x_t, state):
        s = 0.5 * state["s"] + self.v_proj(x_t) * self.gain
        return self.o_proj(s), {{"s": s}}

    def state_size(self, seq_len):
        return self.options.d_inner
'''


def guide_imports() -> list[str]:
    """The import statements the guide names for the worked example's file."""
    assert "The file's imports:" in GUIDE, "CONTRIBUTING.md no longer names the imports of the example's file"
    sentence = GUIDE.split("The file's imports:", 1)[1].split("\n\n", 1)[0]
    return [s for s in re.findall(r"`([^`]+)`", sentence) if s.startswith(("import ", "from "))]


def guide_contract_command() -> list[str]:
    """The guide's command that runs the contract suite on an out-of-tree mixer, without its PYTHONPATH= prefix."""
    lines = [line.strip() for line in GUIDE.splitlines() if "-p my_pkg.my_mixer" in line]
    assert lines, "CONTRIBUTING.md shows no command that runs the contract suite on an out-of-tree module"
    words = shlex.split(lines[0])
    words = [w for w in words if not w.startswith("PYTHONPATH=")]
    assert words[0] == "python", f"expected a python -m pytest command, got {lines[0]!r}"
    return [sys.executable, *words[1:]]


def test_the_guide_names_the_imports_an_out_of_tree_module_needs():
    imports = guide_imports()
    assert any("register_mixer" in s for s in imports) and any(" opt" in s for s in imports)
    namespace: dict = {}
    for statement in imports:
        exec(statement, namespace)  # each one imports as written
    assert namespace["Mixer"].__name__ == "Mixer" and callable(namespace["register_mixer"])


def test_the_guides_command_runs_the_contract_suite_on_an_out_of_tree_mixer(tmp_path):
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""An out-of-tree package."""\n')
    (package / "my_mixer.py").write_text(MODULE.format(imports="\n".join(guide_imports())))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([*guide_contract_command(), "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    assert run.returncode == 0, f"the guide's contract command failed:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}"
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    every_check = len(SIMPLE) + 2 * len(BY_DTYPE) + len(contract.DEGENERATE)
    assert passed > every_check, f"the command ran {passed} tests on the mixer, fewer than the contract's checks"


class StepReturnsAnotherLayout(CumulativeMean):
    name = "step_returns_another_layout"

    def step(self, x_t, state):
        y, new = super().step(x_t, state)
        return y, {"total": new["sum"], "count": new["count"]}


class PrefillReturnsAnotherLayout(CumulativeMean):
    name = "prefill_returns_another_layout"

    def prefill(self, x, mask=None):
        y, new = super().prefill(x, mask)
        return y, {"total": new["sum"], "count": new["count"]}


def _quoted(pattern: str) -> re.Match:
    quoted = re.search(pattern, GUIDE)
    assert quoted, f"CONTRIBUTING.md no longer quotes the error {pattern!r}"
    return quoted


def test_a_wrong_state_layout_reads_as_the_guide_says(registered):
    from_step = _quoted(r'"`my_mixer\.(step returned a state with the keys) \[\.\.\.\], (but init_state lays it out '
                        r'with) \[\.\.\.\]`"')
    from_prefill = _quoted(r'"`my_mixer\.step: (state must have the keys) \[\.\.\.\] (\(as init_state returns\))`"')
    x_t = torch.randn(2, contract.D_MODEL)
    mixer = contract.make(registered(StepReturnsAnotherLayout))
    with pytest.raises(ValueError) as err:           # named at the step that made it
        mixer.step(x_t, mixer.init_state(2))
    assert str(err.value).startswith(f"{mixer.name}.{from_step.group(1)} ['count', 'total'], "
                                     f"{from_step.group(2)} ['count', 'sum']"), str(err.value)
    mixer = contract.make(registered(PrefillReturnsAnotherLayout))
    _, state = mixer.prefill(torch.randn(2, 3, contract.D_MODEL))
    with pytest.raises(ValueError) as err:           # named by the step that reads it
        mixer.step(x_t, state)
    assert str(err.value).startswith(f"{mixer.name}.step: {from_prefill.group(1)} ['count', 'sum'] "
                                     f"{from_prefill.group(2)}"), str(err.value)
