"""The mistakes a mixer's author makes are refused at the earliest point, in one line naming the problem and the fix,
and a correct mixer is never refused.

Registration (``@register_mixer``, when the author's module is imported) refuses what the class alone shows: a class
that is not a Mixer, a class without a name or with a name another class holds, Options that are
not a dataclass, an annotation that does not resolve, defaults the options' own declarations refuse, test-time knobs
that name no option, and methods the zoo cannot call with its arguments. The boundary (:mod:`mixers.boundary`)
refuses what a call returns: a ``prefill`` without its state, an output of another shape, an ``init_state`` that is
not a dict of tensors or ignores its dtype, a state of another shape or dtype (at the ``step`` that reads it), a
``state_size`` that is not an int (it goes into every results row), a ``knob`` the class does not declare. Each is an
option error, which the command line reports in one line. The correct mixer here, an exponential moving average, is
checked against its token loop written out independently.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from mixers import MIXERS, Mixer, build_mixer
from mixers.options import OptionError, build_options, opt

ROOT = Path(__file__).parents[2]
D_MODEL = 8


class MovingAverage(Mixer):
    """s_t = a s_{t-1} + (1 - a) W_v x_t,  y_t = W_o s_t: a correct mixer written as an author would."""
    name = "author_moving_average"
    description = "exponential moving average of a value projection"
    state_formula = "d_inner"
    contract_options = {"d_inner": 4}
    test_time_knobs = ("decay",)

    @dataclass
    class Options:
        d_inner: int = opt(6, "width of the value projection", at_least=1)
        decay: float = opt(0.75, "EMA decay", above=0, below=1)
        scale: float = opt(1, "output scale (an int default for a float option is fine)", above=0)
        width_hint: int | None = opt(None, "unset: d_inner")

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.v_proj = nn.Linear(d_model, options.d_inner, bias=False)
        self.o_proj = nn.Linear(options.d_inner, d_model, bias=False)

    def prefill(self, x, mask=None, **unused):
        a = self.knob("decay")
        v = (1 - a) * self.v_proj(x)
        t = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        lag = t[:, None] - t[None, :]
        weights = torch.where(lag >= 0, a ** lag.clamp_min(0), torch.zeros_like(lag))
        s = torch.einsum("ts,bsd->btd", weights, v)
        return self.options.scale * self.o_proj(s), {"s": s[:, -1]}

    def init_state(self, batch_size, device=None, dtype=None):
        return {"s": torch.zeros(batch_size, self.options.d_inner, device=device, dtype=dtype)}

    def step(self, x_t, state):
        a = self.knob("decay")
        s = a * state["s"] + (1 - a) * self.v_proj(x_t)
        return self.options.scale * self.o_proj(s), {"s": s}

    def state_size(self, seq_len):
        return self.options.d_inner


def token_loop(mixer: MovingAverage, x: torch.Tensor) -> torch.Tensor:
    """The moving average one token at a time, from the weights alone (not through the mixer's methods)."""
    a, scale = mixer.options.decay, mixer.options.scale
    s = torch.zeros(x.shape[0], mixer.options.d_inner, dtype=x.dtype)
    ys = []
    for t in range(x.shape[1]):
        s = a * s + (1 - a) * x[:, t] @ mixer.v_proj.weight.T
        ys.append(scale * s @ mixer.o_proj.weight.T)
    return torch.stack(ys, dim=1)


def test_a_correct_mixer_registers_and_computes_its_equations(registered):
    name = registered(MovingAverage)
    mixer = build_mixer(name, D_MODEL, {"decay": float(torch.empty(()).uniform_(0.1, 0.9))}).double()
    x = torch.randn(3, 7, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        expected = token_loop(mixer, x)
        torch.testing.assert_close(mixer(x), expected, rtol=1e-12, atol=1e-12)
        y, state = mixer.prefill(x[:, :4])
        outputs = [y]
        for t in range(4, 7):   # prefill, then decode from its state (float64 kept: init_state honours dtype)
            y_t, state = mixer.step(x[:, t], state)
            outputs.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-12, atol=1e-12)


def variant(name: str, **body) -> type:
    """A subclass of the correct mixer with ``body`` over its class attributes."""
    return type(f"Author{name.title().replace('_', '')}", (MovingAverage,), {"name": name, **body})


def options(**fields) -> type:
    """An Options dataclass with ``fields`` as ``name: (annotation, default field)``."""
    namespace = {"__annotations__": {k: annotation for k, (annotation, _) in fields.items()}}
    namespace.update({k: default for k, (_, default) in fields.items()})
    return dataclass(type("Options", (), namespace))


class NotAMixer(nn.Module):
    name = "author_not_a_mixer"
    Options = MovingAverage.Options


class PostInitAgreement(MovingAverage.Options):
    def __post_init__(self):
        if self.d_inner % 2:
            raise ValueError(f"d_inner must be even, got {self.d_inner}; use {self.d_inner + 1}")


REFUSED = {
    "not a mixer": (NotAMixer, ["is not a Mixer subclass", "derive it from mixers.Mixer"]),
    "no name": (variant(""), ["has no registry name", "set name = "]),
    "a built-in's name": (variant("mamba2"), ["'mamba2' registered twice", "mixers.mamba2.Mamba2",
                                              "give one of them another name"]),
    "options not a dataclass": (variant("author_plain_options", Options=type("Options", (), {"d_inner": 4})),
                                ["Options must be a dataclass", "@dataclass"]),
    "unresolvable annotation": (variant("author_annotation", Options=options(pair=("Tuple[int, int]", (1, 2)))),
                                ["annotation cannot be resolved", "Tuple", "import the names"]),
    "default out of range": (variant("author_range", Options=options(decay=(float, opt(1.5, "d", above=0, below=1)))),
                             ["default of option 'decay'", "1.5 is out of range", "fix the default"]),
    "default of another type": (variant("author_type", Options=options(d_inner=(int, opt(16.0, "width")))),
                                ["default of option 'd_inner'", "expected an integer", "got 16.0"]),
    "default not a choice": (variant("author_choice", Options=options(mode=(str, opt("fast", "m", ("slow", "exact"))))),
                             ["default of option 'mode'", "'fast' is not one of 'slow', 'exact'"]),
    "None default for an int": (variant("author_none", Options=options(width=(int, opt(None, "w")))),
                                ["'width' defaults to None", "annotate it int | None"]),
    "defaults that disagree": (variant("author_disagree", Options=dataclass(type("Options", (PostInitAgreement,),
                                                                               {"__annotations__": {"d_inner": int},
                                                                                "d_inner": opt(5, "w")}))),
                               ["refuse their own defaults", "d_inner must be even"]),
    "knob that is no option": (variant("author_knob", test_time_knobs=("num_iter",)),
                               ["test-time knob 'num_iter' is not one of its options", "d_inner, decay"]),
    "knobs as one string": (variant("author_knob_text", test_time_knobs=("decay")),
                            ["test_time_knobs must be a tuple of option names", "got 'decay'"]),
    "prefill without mask": (variant("author_prefill", prefill=lambda self, x: MovingAverage.prefill(self, x)),
                             ["prefill(self, x) cannot be called as prefill(self, x, mask)",
                              "def prefill(self, x, mask=None)"]),
    "init_state without device and dtype": (
        variant("author_init_state", init_state=lambda self, batch_size: {"s": torch.zeros(batch_size, 6)}),
        ["init_state(self, batch_size) cannot be called", "def init_state(self, batch_size, device=None, dtype=None)"]),
    "step with another argument": (variant("author_step", step=lambda self, x_t, state, t: (x_t, state)),
                                   ["step(self, x_t, state, t) cannot be called", "def step(self, x_t, state)"]),
}


@pytest.mark.parametrize("mistake", list(REFUSED))
def test_a_class_mistake_is_refused_at_registration_in_one_line(registered, mistake):
    cls, said = REFUSED[mistake]
    before = dict(MIXERS.entries)
    with pytest.raises(ValueError) as err:
        registered(cls)
    message = str(err.value)
    assert "\n" not in message and all(part in message for part in said), message
    assert MIXERS.entries == before, f"{mistake}: the refused class was registered"


def test_the_same_class_defined_again_is_named_as_such(registered):
    registered(variant("author_twice"))
    with pytest.raises(ValueError, match=r"registered twice: .*AuthorAuthorTwice has that name already.*the same class "
                                         r"defined again"):
        registered(variant("author_twice"))


def test_an_assert_in_post_init_is_an_option_error():
    @dataclass
    class Options:
        d_inner: int = opt(4, "width", at_least=1)

        def __post_init__(self):
            assert self.d_inner % 2 == 0, "d_inner must be even"

    d_inner = 2 * int(torch.randint(1, 50, ())) + 1
    with pytest.raises(OptionError, match=r"^layer: an assertion of .*Options.__post_init__ failed \(d_inner must be "
                                          r"even\); check the options it asserts on$"):
        build_options(Options, {"d_inner": d_inner}, "layer")
    assert build_options(Options, {"d_inner": d_inner + 1}).d_inner == d_inner + 1


def _prefill_without_state(self, x, mask=None):
    return MovingAverage.prefill(self, x, mask)[0]


def _prefill_of_another_width(self, x, mask=None):
    y, state = MovingAverage.prefill(self, x, mask)
    return y[..., :1], state


def _step_with_a_time_axis(self, x_t, state):
    y, state = MovingAverage.step(self, x_t, state)
    return y[:, None], state


def _init_state_as_a_tensor(self, batch_size, device=None, dtype=None):
    return torch.zeros(batch_size, self.options.d_inner, device=device, dtype=dtype)


def _init_state_in_float32(self, batch_size, device=None, dtype=None):
    return {"s": torch.zeros(batch_size, self.options.d_inner, device=device)}


def _prefill_with_a_float64_state(self, x, mask=None):
    y, state = MovingAverage.prefill(self, x, mask)
    return y, {"s": state["s"].double()}


def _prefill_with_an_unbatched_state(self, x, mask=None):
    y, state = MovingAverage.prefill(self, x, mask)
    return y, {"s": state["s"][0]}


def _decode_two_tokens(mixer, x):
    _, state = mixer.prefill(x)
    for t in range(2):
        _, state = mixer.step(x[:, t], state)


RETURNED = {
    "prefill without its state": ({"prefill": _prefill_without_state}, lambda m, x: m(x),
                                  "author_bad_return.prefill must return (y, state)"),
    "an output of another width": ({"prefill": _prefill_of_another_width}, lambda m, x: m(x),
                                   "author_bad_return.prefill returned an output of shape (2, 5, 1) for an input of "
                                   "shape (2, 5, 8): a mixer maps (batch, T, d_model) to the same shape; project it "
                                   "back to d_model"),
    "a step output with a time axis": ({"step": _step_with_a_time_axis},
                                       lambda m, x: m.step(x[:, 0], m.init_state(2)),
                                       "author_bad_return.step returned an output of shape (2, 1, 8) for an input of "
                                       "shape (2, 8)"),
    "init_state as a tensor": ({"init_state": _init_state_as_a_tensor}, lambda m, x: m.init_state(2),
                               "author_bad_return.init_state must return the state as a non-empty dict of tensors"),
    "state_size as a tensor": ({"state_size": lambda self, seq_len: torch.tensor(self.options.d_inner)},
                               lambda m, x: m.state_size(x.shape[1]),
                               "author_bad_return.state_size(5) must return a non-negative int, the state's elements "
                               "per sequence, got Tensor tensor(6)"),
    "a knob read but not declared": ({"test_time_knobs": ()}, lambda m, x: m(x),
                                     "author_bad_return: 'decay' is not a declared test-time knob (test_time_knobs = ()):"
                                     " add it to the class's test_time_knobs, or read self.options.decay"),
    "a prefill state without its batch axis": ({"prefill": _prefill_with_an_unbatched_state}, _decode_two_tokens,
                                               "author_bad_return.step: state['s'] must have shape (2, 6) for x_t of "
                                               "batch 2, got (6,)"),
    "a prefill state in a wider dtype": ({"prefill": _prefill_with_a_float64_state}, _decode_two_tokens,
                                         "or a prefill or step of this mixer that returns it in another dtype than "
                                         "init_state's? Return each state tensor in init_state's dtype"),
    "init_state ignoring its dtype": ({"init_state": _init_state_in_float32},
                                      lambda m, x: _decode_two_tokens(m.double(), x.double()),
                                      "lays it out in torch.float32: init_state must create each floating state "
                                      "tensor in the dtype it is given"),
}


@pytest.mark.parametrize("mistake", list(RETURNED))
def test_what_a_method_returns_wrong_is_named_at_that_method(registered, mistake):
    body, call, said = RETURNED[mistake]
    mixer = build_mixer(registered(variant("author_bad_return", **body)), D_MODEL)
    with pytest.raises(OptionError) as err:   # an OptionError: the command line reports it in one line
        call(mixer, torch.randn(2, 5, D_MODEL))
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


OUT_OF_TREE = '''"""A moving average whose prefill returns the value projection, of another width than d_model."""
from mixers import register_mixer
from tests.mixers.test_author_path import MovingAverage


@register_mixer
class WrongWidth(MovingAverage):
    name = "author_wrong_width"

    def prefill(self, x, mask=None):
        return self.v_proj(x), {"s": self.v_proj(x)[:, -1]}
'''


def test_zoo_check_reports_a_wrong_output_in_one_line(tmp_path):
    (tmp_path / "wrong_width_mixer.py").write_text(OUT_OF_TREE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {ROOT / 'tests' / 'zoo' / 'recipes' / 'tiny.yaml'}\nimports: [wrong_width_mixer]\n"
                      "model: {layers: [author_wrong_width], mixer_options: {}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "zoo", "check", str(recipe)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip() == ("zoo: error: author_wrong_width.prefill returned an output of shape (1, 8, 6) for an "
                                  "input of shape (1, 8, 32): a mixer maps (batch, T, d_model) to the same shape; "
                                  "project it back to d_model"), run.stderr


WITHOUT_STATE_SIZE = '''
from dataclasses import dataclass
from torch import nn
from mixers import Mixer, register_mixer


@register_mixer
class NoStateSize(Mixer):
    """y = W x, with a state of nothing: everything but state_size."""
    name = "author_no_state_size"

    @dataclass
    class Options:
        pass

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.proj = nn.Linear(d_model, d_model)

    def prefill(self, x, mask=None):
        return self.proj(x), {"s": x[:, -1]}

    def init_state(self, batch_size, device=None, dtype=None):
        return {"s": self.proj.weight.new_zeros(batch_size, self.d_model, dtype=dtype)}

    def step(self, x_t, state):
        return self.proj(x_t), {"s": x_t}
'''


def test_a_mixer_without_state_size_is_one_line_at_check_and_before_training(tmp_path):
    """``zoo check`` ended its summary line in a NotImplementedError traceback, and ``zoo train`` trained the whole run
    before its evaluation asked for the state size: both now refuse in one line, before any step."""
    (tmp_path / "no_state_size_mixer.py").write_text(WITHOUT_STATE_SIZE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {ROOT / 'tests' / 'zoo' / 'recipes' / 'tiny.yaml'}\nimports: [no_state_size_mixer]\n"
                      "model: {layers: [author_no_state_size], mixer_options: {}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    for command in (["check", str(recipe)], ["train", str(recipe), "--out", str(tmp_path / "run"), "--no-progress",
                                              "train.threads=1"]):
        run = subprocess.run([sys.executable, "-m", "zoo", *command], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
        assert run.stderr.strip().splitlines()[-1] == ("zoo: error: NoStateSize must implement state_size(seq_len) "
                                                       "(every results row records the state size it returns)"), \
            run.stderr
    assert not list((tmp_path / "run").glob("*.pt")) and "step" not in run.stdout
