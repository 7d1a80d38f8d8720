"""A mixer whose ``__init__`` forgets ``super().__init__(d_model, options)``: the mistake is named in one line, at
construction, and a recipe using the mixer is refused naming its layer (not a traceback from inside torch, nor a
model that fails at its first call). A constructor that calls it, and one whose own AttributeError is unrelated,
keep working and failing as they would without the check."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mixers import build_mixer
from mixers.boundary import MixerContractError
from zoo.errors import UserError
from zoo.recipes import resolve

from .example_mixer import CumulativeMean


class NoBaseInit(CumulativeMean):
    """Creates its layers without any base ``__init__``: torch refuses the first ``nn.Linear``."""
    name = "test_no_base_init"

    def __init__(self, d_model, options):
        self.v_proj = nn.Linear(d_model, options.d_inner, bias=False)


class ModuleInitOnly(CumulativeMean):
    """Calls ``nn.Module.__init__`` but not the mixer's: no ``d_model``, no ``options``."""
    name = "test_module_init_only"

    def __init__(self, d_model, options):
        nn.Module.__init__(self)
        self.v_proj = nn.Linear(d_model, options.d_inner, bias=False)
        self.o_proj = nn.Linear(options.d_inner, d_model, bias=False)


class ReadsDModelFirst(CumulativeMean):
    """Calls ``nn.Module.__init__``, then reads ``self.d_model`` that only the mixer's ``__init__`` sets."""
    name = "test_reads_d_model_first"

    def __init__(self, d_model, options):
        nn.Module.__init__(self)
        self.v_proj = nn.Linear(self.d_model, options.d_inner, bias=False)


class OptionTypo(CumulativeMean):
    """Reads an option that does not exist before calling the base ``__init__``: its own AttributeError."""
    name = "test_option_typo"

    def __init__(self, d_model, options):
        width = options.d_iner
        super().__init__(d_model, options)
        self.v_proj = nn.Linear(d_model, width, bias=False)


class Subclassed(CumulativeMean):
    """A subclass of a working mixer that calls ``super().__init__`` and adds a layer."""
    name = "test_subclassed_mixer"

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.extra = nn.Linear(d_model, d_model, bias=False)

    def prefill(self, x, mask=None):
        return super().prefill(self.extra(x), mask)

    def step(self, x_t, state):
        return super().step(self.extra(x_t), state)


@pytest.mark.parametrize("cls", [NoBaseInit, ModuleInitOnly, ReadsDModelFirst])
def test_a_constructor_without_the_base_init_is_named(cls):
    with pytest.raises(MixerContractError) as refused:
        cls(int(torch.randint(4, 33, ())), cls.Options())
    message = str(refused.value)
    assert "\n" not in message
    assert f"{cls.__module__}.{cls.__qualname__}.__init__ does not call super().__init__(d_model, options)" in message


@pytest.mark.parametrize("cls", [NoBaseInit, ModuleInitOnly])
def test_a_recipe_using_it_is_refused_naming_the_layer(registered, cls):
    name = registered(cls)
    recipe = {"model": {"d_model": 16, "layers": ["attention", name]},
              "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2},
              "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0}}
    with pytest.raises(UserError) as refused:
        resolve(recipe)
    assert f"model.layers.1 ({name})" in str(refused.value)
    assert "does not call super().__init__(d_model, options)" in str(refused.value)


def test_an_unrelated_attribute_error_is_left_as_it_is():
    with pytest.raises(AttributeError, match="d_iner") as raised:
        OptionTypo(16, OptionTypo.Options())
    assert not isinstance(raised.value, MixerContractError)


def test_a_subclass_that_calls_the_base_init_still_works(registered):
    name = registered(Subclassed)
    d_model, d_inner = 12, int(torch.randint(2, 9, ()))
    mixer = build_mixer(name, d_model, {"d_inner": d_inner}).double()
    x = torch.randn(2, 7, d_model, dtype=torch.float64)
    v = mixer.v_proj(mixer.extra(x))
    mean = v.cumsum(1) / torch.arange(1, 8, dtype=torch.float64)[None, :, None]
    torch.testing.assert_close(mixer(x), mixer.o_proj(mean))
    assert mixer.d_model == d_model and mixer.options.d_inner == d_inner
