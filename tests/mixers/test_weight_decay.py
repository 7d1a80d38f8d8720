"""Weight decay is declared where each parameter is created (:func:`mixers.layers.no_weight_decay`).

For every registered mixer and state mixer, built at its contract options and at the options that add
parameters (Jordan's LayerNorm and HiPPO block, BD-LRU's constant logits, ...), the decayed set is
listed here by name, and three rules hold whatever a new mixer adds: no parameter with fewer than two
dimensions is decayed, no parameter whose name ends in ``bias`` is, and no parameter of a norm module
is. The declaration survives what rebuilds ``Parameter`` objects (deepcopy, ``assign=True`` loads).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixers import MIXERS, STATE_MIXERS
from mixers.layers import no_weight_decay, split_weight_decay

D_MODEL = 16
_CONV = {"conv.conv.weight"}
_DELTA = {"b_proj.weight", "k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight", "z_proj.weight",
          "q_conv.conv.weight", "k_conv.conv.weight", "v_conv.conv.weight"}
_GLA = {"beta_proj.weight", "gate.proj.weight", "in_proj.weight", "out_proj.weight", "z_proj.weight"} | _CONV

# (registry, name, options beyond the contract options, the decayed parameters)
CASES = [
    (MIXERS, "attention", {}, {"qkv.weight", "out.weight"}),
    (MIXERS, "bdlru", {}, {"a_proj.weight", "v_proj.weight", "out_proj.weight"}),
    (MIXERS, "bdlru", {"selective": False}, {"v_proj.weight", "out_proj.weight"}),
    (MIXERS, "deltanet", {}, _DELTA),
    (MIXERS, "deltanet", {"use_short_conv": False}, _DELTA - {"q_conv.conv.weight", "k_conv.conv.weight",
                                                              "v_conv.conv.weight"}),
    (MIXERS, "deltaproduct", {}, _DELTA | {"gate.proj.weight"}),
    (MIXERS, "gated_deltanet", {}, _DELTA | {"gate.proj.weight"}),
    (MIXERS, "gla", {}, _GLA),
    (MIXERS, "gka", {}, _GLA | {"alpha_proj.weight"}),
    (MIXERS, "jordan", {}, {"gate.proj.weight", "in_proj.weight", "out_proj.weight"}),
    (MIXERS, "jordan", {"state_norm": "step"}, {"gate.proj.weight", "in_proj.weight", "out_proj.weight"}),
    (MIXERS, "jordan", {"state_norm": "readout", "decay": "fixed"}, {"in_proj.weight", "out_proj.weight"}),
    (MIXERS, "jordan", {"init": "hippo", "decay": "fixed"}, {"in_proj.weight", "out_proj.weight"}),
    (MIXERS, "jordan", {"init": "hippo", "decay": "fixed", "learn_transition": False},
     {"in_proj.weight", "out_proj.weight"}),
    (MIXERS, "kronecker_slots", {}, {"k_proj.weight", "q_proj.weight", "v_proj.weight", "g_proj.weight",
                                     "out_proj.weight"} | _CONV),
    (MIXERS, "kronecker_slots", {"pos_address": True, "tie_addresses": True, "conv_size": 1},
     {"k_proj.weight", "v_proj.weight", "g_proj.weight", "out_proj.weight", "pos_proj.weight"}),
    (MIXERS, "mamba2", {}, {"in_proj.weight", "gate.proj.weight", "out_proj.weight"} | _CONV),
    (MIXERS, "ska", {}, {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}),
    (STATE_MIXERS, "swiglu", {}, {"w_in.weight", "w_out.weight"}),
    (STATE_MIXERS, "koopman_mlp", {}, {"lift.weight", "readout.weight"}),
    (STATE_MIXERS, "koopman_mlp", {"layer_norm": False}, {"lift.weight", "readout.weight"}),
    (STATE_MIXERS, "none", {}, set()),
]


def _build(registry, name, extra):
    cls = registry.get(name)
    return registry.build(name, D_MODEL, {**getattr(cls, "contract_options", {}), **extra})


def _ids(case):
    return f"{case[1]}-{'-'.join(f'{k}={v}' for k, v in case[2].items()) or 'contract'}"


def test_every_registered_mixer_is_listed():
    listed = {(reg.kind, name) for reg, name, _, _ in CASES}
    missing = [(reg.kind, n) for reg in (MIXERS, STATE_MIXERS) for n in reg.names() if (reg.kind, n) not in listed]
    assert not missing, f"add the decayed parameters of {missing} to CASES"


def _norm_params(module: nn.Module) -> set[str]:
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules() if type(sub).__name__.endswith("Norm")
            for name, _ in sub.named_parameters(recurse=False)}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decayed_parameters_are_the_declared_ones(case):
    registry, name, extra, expected = case
    module = _build(registry, name, extra)
    decayed, undecayed = split_weight_decay(module)
    assert set(decayed) == expected, f"{name}: decayed {sorted(decayed)}"
    assert set(decayed) | set(undecayed) == {n for n, p in module.named_parameters()}
    assert not set(decayed) & set(undecayed)
    # whatever a mixer adds: no gain, bias or norm parameter is decayed
    assert not [n for n, p in decayed.items() if p.ndim < 2], f"{name}: a decayed vector or scalar"
    assert not [n for n in decayed if n.endswith("bias")], f"{name}: a decayed bias"
    assert not set(decayed) & _norm_params(module), f"{name}: a decayed norm parameter"


@pytest.mark.parametrize("state_norm", ["step", "readout"])
def test_jordan_layer_norm_gains_and_biases_are_undecayed(state_norm):
    """Jordan's LayerNorm parameters are (N, m) matrices, which a rule on shapes would decay."""
    m = MIXERS.build("jordan", D_MODEL, {"block_size": 4, "n_blocks": 3, "state_norm": state_norm})
    decayed, undecayed = split_weight_decay(m)
    assert m.norm_weight.shape == m.norm_bias.shape == (3, 4)
    assert {"norm_weight", "norm_bias"} <= set(undecayed)
    assert not {"norm_weight", "norm_bias"} & set(decayed)


def _rebuilt(module: nn.Module) -> dict[str, nn.Module]:
    """``module`` after each operation that replaces its Parameter objects."""
    assigned = copy.deepcopy(module)
    fresh = {k: v.clone() for k, v in module.state_dict().items()}
    assigned.load_state_dict(fresh, assign=True)
    swapped = copy.deepcopy(module)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        swapped = swapped.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    return {"deepcopy": copy.deepcopy(module), "load assign": assigned, "swapped conversion": swapped}


@pytest.mark.parametrize("name", ["mamba2", "jordan", "ska"])
def test_declaration_survives_rebuilt_parameters(name):
    """deepcopy, ``load_state_dict(assign=True)`` and swapped conversion build new Parameter objects, which
    lose the bare ``_no_weight_decay`` attribute; the module-level declaration keeps the split."""
    extra = {"state_norm": "step"} if name == "jordan" else {}
    module = _build(MIXERS, name, extra)
    before = set(split_weight_decay(module)[0])
    for how, rebuilt in _rebuilt(module).items():
        undecayed = split_weight_decay(rebuilt)[1]
        assert set(split_weight_decay(rebuilt)[0]) == before, how
        assert any(not getattr(p, "_no_weight_decay", False) for p in undecayed.values()), \
            f"{how} kept the attribute: this test no longer exercises the module-level declaration"


def test_the_bare_mark_and_a_tied_parameter_are_honoured():
    """An outside module marking ``p._no_weight_decay = True`` (the mamba-ssm convention) is read, and a
    parameter shared by two modules is undecayed if one of them declares it."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    no_weight_decay(a, "weight")
    b.bias._no_weight_decay = True
    decayed, undecayed = split_weight_decay(nn.Sequential(a, b))
    assert set(decayed) == {"0.bias"}
    assert set(undecayed) == {"0.weight", "1.bias"}


def test_declaring_a_missing_parameter_is_refused():
    with pytest.raises(ValueError, match="no parameter 'gain'"):
        no_weight_decay(nn.Linear(2, 2), "gain")
    no_weight_decay(nn.Linear(2, 2, bias=False), "bias")  # an absent bias has nothing to declare
