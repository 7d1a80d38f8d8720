"""The hybrid stack and its decoding against computations written out here: a task's mask reaches the layers that
read it through ``forward`` and ``prefill`` (and ``use_mask: false`` drops it), the state counts are the elements
of the decode states a prefill returns, every block owns its state mixer, the test-time context sets and restores
every layer's knobs, decoding stops where ``stop`` says, the transformers export's cache reports its batch, its
past and its size, and the shared building blocks (the decay gate's equation and step-size cap, the short
convolution's decode state, the weight-decay split) are what their docstrings say. Tiny models made
here; nothing downloads."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import zoo
from kernels.device import gpu_path_on_cpu
from mixers import MIXERS, STATE_MIXERS
from mixers.layers import DecayGate, RMSNorm, ShortConv, no_weight_decay, split_weight_decay
from mixers.options import OptionError
from tests.zoo.test_sampling_properties import greedy_by_hand, tiny_lm
from tests.zoo.untrained import wake_zero_initialised
from zoo.errors import UserError
from zoo.generate import Generation, check_arguments, check_test_time, generate_ids, resolve_test_time
from zoo.model import HybridLM
from zoo.recipes import resolve

VOCAB, D = 30, 16
SMALL = {"attention": {"n_heads": 2}, "mamba2": {"d_state": 4, "headdim": 8, "chunk_size": 4},
         "ska": {"n_heads": 2, "rank": 4, "chunk_size": 1, "ridge": 0.1}, "gka": {"n_heads": 2},
         "gla": {"n_heads": 2}, "kronecker_slots": {"n_heads": 2}}


def build(layers, **model) -> HybridLM:
    recipe = resolve({"model": {"d_model": D, "layers": layers, "mixer_options": SMALL, **model},
                      "task": {"name": "mqar"}})
    return wake_zero_initialised(HybridLM.from_recipe(recipe, vocab_size=VOCAB).double().eval())


def composed_by_hand(model: HybridLM, ids, mask):
    """Embedding, then per block ``x + mixer(norm(x), mask)`` and ``x + state_mixer(norm(x))``, final norm, head."""
    x = model.embed.weight[ids]
    for block in model.blocks:
        x = x + block.mixer(block.mixer_norm(x), mask=mask)
        x = x + block.state_mixer(block.state_norm(x))
    return model.norm(x) @ model.embed.weight.T


@pytest.mark.parametrize("use_mask", [True, False])
def test_the_mask_reaches_the_layers_through_forward_and_prefill_unless_use_mask_is_off(use_mask):
    model = build(["ska", "attention"], use_mask=use_mask)
    ids = torch.randint(VOCAB, (2, 7))
    mask = (torch.rand(2, 7) < 0.5).double()
    mask[:, 0] = 1.0
    with torch.no_grad():
        masked, unmasked = composed_by_hand(model, ids, mask), composed_by_hand(model, ids, None)
        assert (masked - unmasked).abs().max() > 1e-4          # the mask changes what SKA reads
        want = masked if use_mask else unmasked
        torch.testing.assert_close(model(ids, mask=mask), want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(model.prefill(ids, mask=mask)[0], want, rtol=1e-9, atol=1e-9)


def test_state_sizes_count_the_elements_of_the_decode_states_of_every_layer():
    """``state_size(T)`` is the number of elements per sequence of the states that a prefill of T tokens returns
    (then one step: T + 1), over every layer; ``active_state_size`` sums each layer's own count, below the
    state size where a layer touches only part of its memory."""
    model = build(["kronecker_slots", "attention", "gla", "attention"])
    T, batch = int(torch.randint(2, 6, ())), 2
    ids = torch.randint(VOCAB, (batch, T + 1))
    _, states = model.prefill(ids[:, :T])
    assert model.state_size(T) == sum(t.numel() for s in states for t in s.values()) // batch
    _, states = model.step(ids[:, T], states)
    assert model.state_size(T + 1) == sum(t.numel() for s in states for t in s.values()) // batch
    each = [MIXERS.get(spec.name)(D, spec.options) for spec in model.layer_specs]
    assert model.active_state_size(T) == sum(m.active_state_size(T) for m in each) < model.state_size(T)


def test_every_block_owns_its_state_mixer():
    """The parameters are the embedding, the final norm's gain and, per block, its mixer, its state mixer (one
    SwiGLU of its own) and two norm gains: no block shares its state mixer with another."""
    model = build(["gla", "gla", "attention"])
    swiglu = STATE_MIXERS.get("swiglu")(D, STATE_MIXERS.get("swiglu").Options())
    own = sum(p.numel() for p in swiglu.parameters())
    mixers = sum(p.numel() for b in model.blocks for p in b.mixer.parameters())
    assert model.num_params() == VOCAB * D + D + mixers + len(model.blocks) * (own + 2 * D)
    ids = [{id(p) for p in b.state_mixer.parameters()} for b in model.blocks]
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])


def test_the_tied_embedding_and_the_norm_gains_are_not_decayed():
    """The embedding (the head's weight too, listed once) and every norm's gain are in the undecayed group."""
    model = build(["gla", "attention"])
    decayed, undecayed = split_weight_decay(model)
    assert "embed.weight" in undecayed and "head.weight" not in decayed
    norms = {"norm.weight"} | {f"blocks.{i}.{n}_norm.weight" for i in range(2) for n in ("mixer", "state")}
    assert norms <= set(undecayed)


def test_a_refused_layer_is_named_by_its_own_recipe_key():
    """A layer whose options its constructor refuses is named by that layer's key, not another layer's."""
    recipe = resolve({"model": {"d_model": D, "layers": ["attention", {"attention": {"n_heads": 2}}, "gla"]},
                      "task": {"name": "mqar"}})
    for i, key in ((0, "model.layers.0"), (1, "model.layers.1.attention")):
        specs = list(recipe.layers)
        specs[i] = dataclasses.replace(specs[i], options=dataclasses.replace(specs[i].options, n_heads=3))
        with pytest.raises(OptionError) as err:
            HybridLM(specs, VOCAB, D, option_keys=recipe.model.layer_option_keys())
        assert str(err.value).startswith(f"{key}: attention"), str(err.value)


def test_a_pattern_repeats_to_n_layers_and_each_layer_is_blamed_on_its_pattern_entry():
    n = int(torch.randint(3, 7, ()))
    recipe = resolve({"model": {"d_model": D, "pattern": ["gla", {"attention": {"n_heads": 2}}], "n_layers": n},
                      "task": {"name": "mqar"}})
    keys = [("model.pattern.0", ""), ("model.pattern.1.attention", "")]
    assert [spec.name for spec in recipe.layers] == [("gla", "attention")[i % 2] for i in range(n)]
    assert recipe.model.layer_option_keys() == [keys[i % 2] for i in range(n)]


def test_a_decode_step_under_autocast_on_the_gpu_path_hands_the_mixers_the_fp32_norm():
    """On the GPU path under fp16 autocast, a step's logits and states are exactly those of pre-norms that never
    round to the autocast dtype: the mixers step on the fp32 norm of their input."""
    model = HybridLM.from_recipe(resolve({"model": {"d_model": D, "layers": ["attention"], "mixer_options": SMALL},
                                          "task": {"name": "mqar"}}), VOCAB).eval()
    wake_zero_initialised(model)
    ids = torch.randint(VOCAB, (1, 4))
    norms = [n for n in model.modules() if isinstance(n, RMSNorm) and n.to_linear]
    results = {}
    for to_linear in (True, False):
        for n in norms:
            n.to_linear = to_linear
        with torch.no_grad(), gpu_path_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
            _, states = model.prefill(ids[:, :3])
            logits, states = model.step(ids[:, 3], states)
        results[to_linear] = [logits] + [t for s in states for t in s.values()]
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)


def twin_with(model: HybridLM, layers) -> HybridLM:
    twin = build(layers)
    twin.load_state_dict(model.state_dict())
    return twin


def test_the_test_time_context_sets_every_layers_knobs_and_restores_them():
    """Inside ``test_time`` the logits are those of the same weights built with the knobs as options; after it (and
    after a value one layer refuses, the layers set before it included) they are the options' again."""
    model = build(["gka", "ska"])
    assert model.test_time_knobs() == {"num_iter", "power"}
    ids = torch.randint(VOCAB, (2, 6))
    with torch.no_grad():
        before = model(ids)
        twin = twin_with(model, [{"gka": {"num_iter": 2}}, {"ska": {"power": 0}}])
        with model.test_time({"num_iter": 2, "power": 0}):
            torch.testing.assert_close(model(ids), twin(ids), rtol=1e-9, atol=1e-9)
        assert (twin(ids) - before).abs().max() > 1e-6
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
        with pytest.raises(Exception, match="power"):
            model.set_test_time({"num_iter": 2, "power": -1})
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def test_decoding_stops_at_the_first_token_stop_accepts():
    model = tiny_lm()
    prompt = torch.randint(0, 40, (int(torch.randint(1, 6, ())),)).tolist()
    n = 8
    greedy = greedy_by_hand(model, prompt, n)
    cut = int(torch.randint(1, n, ()))
    assert generate_ids(model, prompt, n, stop=lambda ids: len(ids) >= cut)[0] == greedy[:cut]
    target = greedy[cut - 1]
    assert generate_ids(model, prompt, n, stop=lambda ids: ids[-1] == target)[0] == greedy[:greedy.index(target) + 1]


def test_zero_new_tokens_decode_nothing():
    model = tiny_lm()
    prompt = torch.randint(0, 40, (int(torch.randint(1, 6, ())),)).tolist()
    assert generate_ids(model, prompt, 0) == ([], 0.0, 0.0)


def generate_flags(**changed) -> SimpleNamespace:
    flags = {"max_new_tokens": 5, "temperature": 0.8, "top_k": 0, "top_p": 1.0, "threads": 1, "seed": 0,
             "device": "cpu", "test_time": None}
    return SimpleNamespace(**{**flags, **changed})


@pytest.mark.parametrize("flag,value", [("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0), ("top_k", -1),
                                        ("temperature", -0.5)])
def test_a_generate_flag_out_of_its_range_is_refused_by_name(flag, value):
    check_arguments(generate_flags())
    with pytest.raises(UserError, match=f"--{flag.replace('_', '-')} {value:g}: must"):
        check_arguments(generate_flags(**{flag: value}))


def test_a_test_time_value_a_layer_refuses_is_refused_naming_the_layer():
    recipe = zoo.load({"model": {"d_model": D, "layers": ["gka", "attention"]}, "task": {"name": "mqar"}})
    assert check_test_time(recipe, [("num_iter", 3, "num_iter=3")]) == {"num_iter": 3}
    with pytest.raises(UserError, match="num_iter=-1: -1 is not a valid num_iter for gka"):
        check_test_time(recipe, [("num_iter", -1, "num_iter=-1")])


def test_time_per_token_is_over_the_decoded_steps():
    """The first new token comes from the prefill, so ``n`` new ids took ``n - 1`` decode steps."""
    n = int(torch.randint(2, 9, ()))
    seconds = float(torch.rand(())) + 0.5
    g = Generation(prompt_tokens=3, ids=list(range(n)), text="", prefill_seconds=1.0, decode_seconds=seconds)
    assert g.seconds_per_token == pytest.approx(seconds / (n - 1))


def test_given_test_time_values_win_over_the_recipes_and_undeclared_knobs_are_left_out():
    recorded, given = int(torch.randint(1, 5, ())), int(torch.randint(5, 9, ()))
    recipe = zoo.load({"model": {"d_model": D, "layers": ["gka", "attention"]}, "task": {"name": "mqar"},
                       "eval": {"test_time": {"num_iter": recorded, "power": 1}}})
    assert resolve_test_time(recipe) == {"num_iter": recorded}
    assert resolve_test_time(recipe, [f"num_iter={given}"]) == {"num_iter": given}
    assert resolve_test_time(recipe, {"num_iter": given}) == {"num_iter": given}


def test_the_decay_gate_is_minus_a_times_the_step_size_and_caps_that_step_size():
    """``g = -A softplus(raw + dt_bias)``, and the step size is that ``softplus`` capped at ``dt_max`` (the gate's
    initial ranges are checked in tests/mixers/test_mixers_catch_wrong_equations.py)."""
    gate = DecayGate(D, 512).double()
    A = gate.A_log.exp()
    raw = 3 * torch.randn(4, 512, dtype=torch.float64)
    with torch.no_grad():
        g, _ = gate.from_projection(raw)
        want = F.softplus(raw + gate.dt_bias)
        torch.testing.assert_close(g, -A * want, rtol=1e-12, atol=0)
        dt_max = float(want.median())
        torch.testing.assert_close(gate.step_size(raw, dt_max, torch.float64), want.clamp(max=dt_max), rtol=0, atol=0)


def test_the_decay_gate_floors_a_tiny_step_size():
    """A ``dt`` range below the floor starts every head at the floor."""
    dt = F.softplus(DecayGate(D, 64, dt_range=(1e-6, 1e-5), dt_floor=1e-4).double().dt_bias)
    torch.testing.assert_close(dt, torch.full_like(dt, 1e-4), rtol=1e-6, atol=0)


def test_rms_norm_uses_its_eps_and_starts_at_the_identity_gain():
    eps = float(torch.rand(())) + 0.1
    norm = RMSNorm(D, eps).double()
    x = torch.randn(3, D, dtype=torch.float64)
    normalised = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(norm(x), normalised, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    torch.testing.assert_close(norm(x), normalised * norm.weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", [True, False])
def test_a_short_convolutions_decode_state_after_a_short_input_is_the_stepped_one(activation):
    """After fewer inputs than the kernel's length minus one, the state is the steps' own (zeros first, then the
    inputs); stepping on from it gives the convolution of the whole input, with or without the SiLU."""
    conv = ShortConv(5, 4, activation=activation).double()
    with torch.no_grad():
        conv.conv.bias.normal_()
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    T = int(torch.randint(1, 3, ()))
    state = conv.init_state(2, dtype=torch.float64)
    for t in range(T):
        _, state = conv.step(x[:, t], state)
    torch.testing.assert_close(conv.final_state(x[:, :T]), state, rtol=0, atol=0)
    ys, state = [], conv.final_state(x[:, :T])
    for t in range(T, 6):
        y, state = conv.step(x[:, t], state)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), conv(x)[:, T:], rtol=1e-12, atol=1e-12)


def test_the_weight_decay_split_follows_every_declaration_and_skips_frozen_parameters():
    """Names declared in two calls are both undecayed, a bare ``_no_weight_decay`` mark counts, a frozen parameter
    is in neither group, and a name the module does not have is refused."""
    module = torch.nn.Module()
    for name in ("a", "b", "c", "d", "frozen"):
        module.register_parameter(name, torch.nn.Parameter(torch.randn(2)))
    module.frozen.requires_grad_(False)
    no_weight_decay(module, "a")
    no_weight_decay(module, "b")
    for name in ("a", "b"):  # a rebuilt parameter (as load_state_dict(assign=True) makes) loses its mark
        setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().clone()))
    module.c._no_weight_decay = True
    decayed, undecayed = split_weight_decay(module)
    assert sorted(decayed) == ["d"] and sorted(undecayed) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="no parameter 'e'"):
        no_weight_decay(module, "e")


def test_the_export_cache_reports_its_batch_its_past_and_the_elements_of_every_layers_state():
    """A cache filled by a prompt of T tokens holds ``batch * state_size(T)`` elements over its layers (then
    ``T + 1`` after a step), names its batch, and says it has a past only once it has consumed tokens."""
    pytest.importorskip("transformers")
    from tests.zoo.test_hf_export_decoding_inputs_properties import tiny_model
    from zoo.hf import ZooCache
    from zoo.hf.model import CACHE_FIELD

    model = tiny_model()
    batch, T = int(torch.randint(1, 4, ())), int(torch.randint(2, 6, ()))
    cache = ZooCache()
    assert not cache.has_previous_state() and cache.state_elements() == 0
    with torch.no_grad():
        cache = getattr(model(torch.randint(0, 256, (batch, T)), use_cache=True, **{CACHE_FIELD: cache}), CACHE_FIELD)
        assert cache.has_previous_state() and cache.batch_size == batch and len(cache) == len(model.zoo.blocks)
        assert cache.state_elements() == batch * model.zoo.state_size(T)
        model(torch.randint(0, 256, (batch, 1)), use_cache=True, **{CACHE_FIELD: cache})
    assert cache.state_elements() == batch * model.zoo.state_size(T + 1)
