"""The input boundary of :mod:`mixers.boundary` beyond the per-mixer probes of the contract suite: the
dtype rule under autocast, step's autocast switch, a mixer class defined outside the package, and the
option ranges that keep RoPE and the delta family's norm finite."""
import pytest
import torch

from mixers import build_mixer
from mixers.options import OptionError

from .contract import D_MODEL, make, rel
from .example_mixer import CumulativeMean


def test_autocast_dtype_is_accepted_inside_autocast_only():
    m = make("gla")
    x = torch.randn(2, 6, D_MODEL, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="gla.forward: x is torch.bfloat16 but the mixer's parameters are torch.float32"):
        m(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.shape == x.shape and torch.isfinite(y.float()).all()


def test_a_float64_module_refuses_float32():
    m = make("mamba2", torch.float64)
    with pytest.raises(TypeError, match=r"x\.to\(torch\.float64\)"):
        m(torch.randn(1, 3, D_MODEL))


@pytest.mark.parametrize("name", ["gka", "ska", "mamba2"])
def test_step_under_autocast_is_the_fp32_step(name):
    """step switches autocast off: under autocast it returns exactly what it returns without."""
    m = make(name)
    x = torch.randn(2, 7, D_MODEL)
    with torch.no_grad():
        _, state = m.prefill(x[:, :5])
        y32, s32 = m.step(x[:, 5], {k: v.clone() for k, v in state.items()})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ac, s_ac = m.step(x[:, 5], {k: v.clone() for k, v in state.items()})
    assert torch.equal(y32, y_ac) and all(torch.equal(s32[k], s_ac[k]) for k in s32)


@pytest.mark.parametrize("name", ["gated_deltanet", "attention"])
def test_step_under_autocast_takes_an_input_in_the_autocast_dtype(name):
    """An ``x_t`` in the autocast dtype (accepted by the check) is stepped in fp32: exactly the step of the same
    values given in fp32."""
    m = make(name)
    x = torch.randn(2, 7, D_MODEL)
    x_t = x[:, 5].bfloat16()
    with torch.no_grad():
        _, state = m.prefill(x[:, :5])
        y32, s32 = m.step(x_t.float(), {k: v.clone() for k, v in state.items()})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ac, s_ac = m.step(x_t, {k: v.clone() for k, v in state.items()})
    assert torch.equal(y32, y_ac) and all(torch.equal(s32[k], s_ac[k]) for k in s32)


def test_a_mixer_defined_outside_the_package_is_checked_too():
    """The checks come with subclassing Mixer, not with registering."""
    m = CumulativeMean(8, CumulativeMean.Options(d_inner=4))
    with pytest.raises(ValueError, match=r"cumulative_mean.step: x_t must have shape \(batch, d_model=8\), got \(2, 3, 8\)"):
        m.step(torch.randn(2, 3, 8), m.init_state(2))
    with pytest.raises(ValueError, match=r"state\['sum'\] must have shape \(2, 4\) .*got \(3, 4\)"):
        m.step(torch.randn(2, 8), m.init_state(3))
    y, state = m.prefill(torch.randn(2, 0, 8))
    assert y.shape == (2, 0, 8) and state["count"].eq(0).all()


def test_a_kv_cache_of_any_length_is_a_valid_state():
    """init_state's cache has length 0; a prefilled cache of length 6 passes the layout check."""
    m = make("attention")
    x = torch.randn(2, 9, D_MODEL)
    with torch.no_grad():
        y = m(x)
        _, state = m.prefill(x[:, :6])
        y_t, _ = m.step(x[:, 6], state)
    assert state["k"].shape[1] == 6 and rel(y_t, y[:, 6]) < 1e-5


@pytest.mark.parametrize("name,option,value", [("attention", "rope_base", 0.0), ("attention", "rope_base", -10.0),
                                               ("deltanet", "norm_eps", -1e-5), ("gated_deltanet", "norm_eps", 0.0),
                                               ("deltaproduct", "norm_eps", -1.0)])
def test_options_that_train_to_nan_are_refused(name, option, value):
    with pytest.raises(OptionError, match=f"{option}: .* out of range: must be > 0"):
        build_mixer(name, D_MODEL, {option: value}, path=f"model.mixer_options.{name}")


@pytest.mark.parametrize("method", ["state_size", "active_state_size", "init_state"])
def test_counts_must_be_non_negative_ints(method):
    """A batch size or sequence length that is negative, fractional, a string or a bool is refused by name (a
    negative length gave a negative state size; ``init_state(-1)`` failed inside ``torch.zeros``); any
    non-negative int gives what the mixer's own formula gives."""
    m = make("attention")
    arg = "batch_size" if method == "init_state" else "seq_len"
    n = int(torch.randint(0, 50, ()))
    for bad, error in ((-1 - n, ValueError), (n + 0.5, TypeError), (str(n), TypeError), (True, TypeError)):
        with pytest.raises(error, match=rf"attention\.{method}: {arg} must be a non-negative int"):
            getattr(m, method)(bad)
    if method == "init_state":
        assert all(t.shape[0] == n for t in m.init_state(n).values())
        with pytest.raises(TypeError, match=r"attention\.init_state: dtype must be a floating torch.dtype"):
            m.init_state(2, dtype=torch.int64)
    else:   # two KV caches of T rows of d_model, the attention formula
        assert getattr(m, method)(n) == 2 * n * D_MODEL


def test_an_unknown_name_points_to_the_decorator_or_the_import():
    """A mixer class of that name that was never registered is named with the decorator to add; a name close to a
    registered one gets the nearest name and, in case it is the user's own, ``imports:``; any other name, the decorator
    and ``imports:``."""
    from mixers import MIXERS

    name = f"unregistered_{int(torch.randint(10**6, ()))}"
    with pytest.raises(OptionError, match=r"a mixer of your own: decorate its class with @register_mixer and name its "
                                          r"module in the recipe's imports:"):
        MIXERS.get(name)
    undecorated = type("Undecorated", (CumulativeMean,), {"name": name})
    with pytest.raises(OptionError, match=rf"Undecorated is named '{name}' but was never registered: decorate it "
                                          rf"with @register_mixer"):
        MIXERS.get(name)
    with pytest.raises(OptionError) as err:
        MIXERS.get("atention")
    assert "did you mean 'attention'?" in str(err.value) and "register_mixer" not in str(err.value)
    assert "if 'atention' is a mixer of your own, name its module in the recipe's imports:" in str(err.value)
    assert undecorated.name == name
