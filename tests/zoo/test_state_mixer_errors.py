"""A model whose layer or state mixer cannot be built with its options (sizes no option range catches, e.g. a hidden
width of 10^17) is refused naming the recipe key that holds those options: ``model.state_mixer_options`` for the
state mixer (it named ``model.state_mixer``, the key that only chooses it), the layer's own options or its type's
``model.mixer_options.<name>`` for a layer (it named ``model.layers.<i>`` even where the layers are written as
``model.pattern`` and the options came from ``model.mixer_options``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from mixers.options import OptionError
from zoo import resolve
from zoo.cli import main
from zoo.model import HybridLM

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers [attention, mamba2], mamba2 defaults set
HUGE = 10 ** 17


def build_error(*overrides: str) -> str:
    with pytest.raises(OptionError) as info:
        HybridLM.from_recipe(resolve(TINY, list(overrides)), 32)
    return str(info.value)


@pytest.mark.parametrize("state_mixer, option", [("swiglu", "mult=1e17"), ("swiglu", f"multiple_of={HUGE}"),
                                                 ("koopman_mlp", "mult=1e17")])
def test_a_state_mixer_that_cannot_be_built_names_its_options(state_mixer, option):
    err = build_error(f"model.state_mixer={state_mixer}", f"model.state_mixer_options.{option}")
    assert err.startswith(f"model.state_mixer_options: {state_mixer}: cannot be built with these options"), err


def test_zoo_check_names_the_state_mixer_options(capsys):
    assert main(["check", str(TINY), "model.state_mixer_options.mult=1e17"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("zoo: error: model.state_mixer_options: swiglu: cannot be built"), err


def test_a_layer_that_cannot_be_built_names_the_key_that_holds_its_options():
    # the type's defaults (model.mixer_options.mamba2) set the size: they are named, with the layer
    err = build_error(f"model.mixer_options.mamba2.d_state={HUGE}")
    assert err.startswith("model.mixer_options.mamba2: mamba2 (model.layers.1): cannot be built"), err
    # the layer's own options over its type's defaults: the layer's options are named, the defaults noted
    err = build_error(f"model.layers.1.mamba2.d_state={HUGE}")
    assert err.startswith("model.layers.1.mamba2: mamba2 (over the defaults of model.mixer_options.mamba2): "
                          "cannot be built"), err
    # a layer of a type without defaults, with options of its own
    err = build_error(f"model.layers=[attention, {{gla: {{n_heads: 2, head_dim: {HUGE}}}}}]")
    assert err.startswith("model.layers.1.gla: gla: cannot be built"), err


def test_layers_written_as_a_pattern_are_named_in_the_pattern():
    err = build_error("model.layers=null", "model.pattern=[attention, mamba2]", "model.n_layers=4",
                      f"model.mixer_options.mamba2.d_state={HUGE}")
    assert err.startswith("model.mixer_options.mamba2: mamba2 (model.pattern.1): cannot be built"), err
    err = build_error("model.layers=null", f"model.pattern=[attention, {{mamba2: {{d_state: {HUGE}}}}}]",
                      "model.n_layers=3")
    assert err.startswith("model.pattern.1.mamba2: mamba2 (over the defaults of model.mixer_options.mamba2)"), err
