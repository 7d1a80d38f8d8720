"""The contract suite passes the worked example of CONTRIBUTING.md and fails deliberately broken mixers:
one without a parallel prefill, one whose prefill is the token loop, one whose state grows with T
without declaring it, and one that reads nothing at short lengths without saying so in dead_at."""
from pathlib import Path

import pytest
import torch

from mixers.base import Mixer

from . import contract
from .example_mixer import CumulativeMean


class NoPrefill(CumulativeMean):
    name = "broken_no_prefill"
    prefill = Mixer.prefill  # inherits no parallel form


class LoopPrefill(CumulativeMean):
    name = "broken_loop_prefill"

    def prefill(self, x, mask=None):
        return self.forward_recurrent(x)


class UndeclaredGrowth(CumulativeMean):
    """Keeps every past value (a cache) but does not declare state_grows_with_seq_len."""
    name = "broken_undeclared_growth"
    state_formula = "T * d_inner"

    def prefill(self, x, mask=None):
        y, _ = super().prefill(x)
        return y, {"values": self.v_proj(x)}

    def init_state(self, batch_size, device=None, dtype=None):
        return {"values": torch.zeros(batch_size, 0, self.options.d_inner, device=device, dtype=dtype)}

    def step(self, x_t, state):
        values = torch.cat([state["values"], self.v_proj(x_t)[:, None]], dim=1)
        return self.o_proj(values.mean(dim=1)), {"values": values}

    def state_size(self, seq_len):
        return seq_len * self.options.d_inner


class UndeclaredDeadness(CumulativeMean):
    """Outputs 0 at the first 8 positions (as a chunk-causal mixer reading only finished chunks of 8 would)
    without saying so in dead_at."""
    name = "broken_undeclared_deadness"

    def prefill(self, x, mask=None):
        y, state = super().prefill(x)
        return y * (torch.arange(x.shape[1]) >= 8)[None, :, None], state


class DeclaredDeadness(UndeclaredDeadness):
    name = "declared_deadness"

    def dead_at(self, seq_len):
        return None if seq_len > 8 else f"first_read=8: no position < 8 reads anything at seq_len={seq_len}"


CHECKS = [(check, ()) for check in ("declarations", "prefill_is_parallel", "causal", "state_size", "chunk_size",
                                    "mask_declaration", "batch_independence", "test_time_knobs", "boundary",
                                    "empty_time", "large_finite_input", "autocast_decode",
                                    "gradients_reach_every_parameter")]
CHECKS += [(check, (dtype,)) for check in ("parallel_equals_recurrent", "prefill_then_decode", "dtype_round_trip")
           for dtype in (torch.float32, torch.float64)]
CHECKS += [("finite", (case,)) for case in contract.DEGENERATE]


def test_the_contributing_example_passes_every_check(registered):
    name = registered(CumulativeMean)
    for check, args in CHECKS:
        getattr(contract, f"check_{check}")(name, *args)


@pytest.mark.parametrize("cls,failing", [(NoPrefill, "declarations"), (LoopPrefill, "prefill_is_parallel"),
                                         (UndeclaredGrowth, "state_size"),
                                         (UndeclaredDeadness, "gradients_reach_every_parameter")])
def test_a_broken_mixer_fails_the_contract(registered, cls, failing):
    name = registered(cls)
    with pytest.raises((AssertionError, NotImplementedError)):
        getattr(contract, f"check_{failing}")(name)


def test_declaring_the_growth_makes_the_same_mixer_pass(registered):
    declared = type("DeclaredGrowth", (UndeclaredGrowth,), {"name": "declared_growth", "state_grows_with_seq_len": True})
    contract.check_state_size(registered(declared))


def test_declaring_the_deadness_makes_the_same_mixer_pass(registered):
    contract.check_gradients_reach_every_parameter(registered(DeclaredDeadness))


def test_the_contributing_guide_shows_the_tested_example():
    """Every concrete line of the guide's code block stands in the example the suite checks."""
    root = Path(__file__).parents[2]
    guide = (root / "CONTRIBUTING.md").read_text()
    block = guide.split("## Adding a mixer", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    example = {line.split("#")[0].strip() for line in (Path(__file__).parent / "example_mixer.py").read_text().splitlines()}
    shown = [line.split("  #")[0].strip() for line in block.splitlines()]
    # the example is registered by the tests' fixture rather than at import, so the decorator is the one
    # line of the guide the file does not carry
    concrete = [line for line in shown if line and "..." not in line and not line.startswith("#")
                and line != "@register_mixer"]
    assert len(concrete) > 15
    missing = [line for line in concrete if line not in example]
    assert not missing, f"CONTRIBUTING.md shows lines the tested example does not have: {missing}"
