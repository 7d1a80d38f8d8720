"""The hybrid builder: layer lists, tied head, parameter and state counts, decode == forward."""
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve


def build(**model):
    return HybridLM.from_recipe(resolve({"model": model, "task": {"name": "mqar"}}), vocab_size=50)


def test_layers_and_tied_head():
    m = build(d_model=32, layers=["attention", "mamba2", "attention"],
              mixer_options={"mamba2": {"d_state": 8, "headdim": 16}, "attention": {"n_heads": 2}})
    assert [type(b.mixer).name for b in m.blocks] == ["attention", "mamba2", "attention"]
    assert m.head.weight is m.embed.weight
    assert m.num_params() == sum(p.numel() for p in m.parameters())
    assert m.state_size(100) == sum(b.mixer.state_size(100) for b in m.blocks)
    assert m.state_size(200) - m.state_size(100) == 2 * 2 * 100 * 32  # two attention layers' KV caches


def test_state_mixer_none_has_no_parameters_beyond_mixers():
    a = build(d_model=32, layers=["mamba2"], state_mixer="none", mixer_options={"mamba2": {"headdim": 16}})
    b = build(d_model=32, layers=["mamba2"], state_mixer="swiglu", mixer_options={"mamba2": {"headdim": 16}})
    assert b.num_params() > a.num_params()
    assert a.blocks[0].state_mixer is None


def test_prefill_then_step_equals_forward():
    m = build(d_model=32, layers=["mamba2", "attention"], state_mixer="koopman_mlp",
              mixer_options={"mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 4},
                             "attention": {"n_heads": 2}}).double().eval()
    ids = torch.randint(50, (2, 13))
    full = m(ids)
    logits, states = m.prefill(ids[:, :8])
    steps = [logits]
    for t in range(8, 13):
        out, states = m.step(ids[:, t], states)
        steps.append(out[:, None])
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)


def test_language_model_on_the_gpu_path_launches_a_fixed_number_of_kernels():
    """A training step's forward+backward on the GPU path (counted without a GPU, kernels not run) launches
    as many kernels at T as at 4T; every attention layer rotates its queries and keys in one kernel each way
    and every SwiGLU block gates in one kernel each way, with none of the formulas' element-wise operators
    left."""
    from kernels.device import gpu_path_on_cpu
    from tests.mixers.launches import count_launches

    m = build(d_model=32, layers=["attention", "gated_deltanet", "attention"],
              mixer_options={"attention": {"n_heads": 2}, "gated_deltanet": {"n_heads": 2}})

    def launches(T):
        m.zero_grad(set_to_none=True)                 # no accumulation into the last call's gradients
        ids = torch.randint(50, (2, T + 1))

        def step():
            logits = m(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

        with gpu_path_on_cpu():
            return count_launches(step, execute=False)

    (short, by_name), (long, _) = launches(64), launches(256)
    assert short == long, f"{short} launches at T 64, {long} at T 256"
    assert by_name["triton:rope._rotate"] == 2 * 2
    assert by_name["triton:swiglu._swiglu_fwd"] == by_name["triton:swiglu._swiglu_bwd"] == 3
    assert not {"aten::cos", "aten::sin", "aten::silu", "aten::silu_backward"} & set(by_name), by_name


def test_pre_norms_of_linear_layers_hand_over_the_autocast_dtype_with_the_same_loss_and_gradients():
    """Under autocast (fp16 through the interpreter, on the GPU path) the pre-norms of the layers that read their
    input only through linear layers (the SwiGLU blocks, the head, the mixers that declare it) return the
    autocast dtype, and the step's loss and every gradient are exactly those of norms that return fp32 for the
    linear layers to cast; each such norm saves one cast forward and one backward (BD-LRU's and Jordan's two
    projections are one matmul on the GPU path). The Kronecker slots, which do not declare it, keep their fp32
    input (their key path projects it in fp32)."""
    from kernels.device import gpu_path_on_cpu
    from mixers.layers import RMSNorm
    from tests.mixers.launches import count_launches

    layers = ["attention", "gated_deltanet", "deltaproduct", "gla", "gka", "mamba2", "bdlru", "jordan", "ska",
              "kronecker_slots"]
    m = build(d_model=32, layers=layers, mixer_options={
        "attention": {"n_heads": 2}, "gated_deltanet": {"n_heads": 2}, "deltaproduct": {"n_heads": 2},
        "gla": {"n_heads": 2}, "gka": {"n_heads": 2}, "mamba2": {"d_state": 8, "headdim": 16},
        "bdlru": {"n_blocks": 4}, "jordan": {"n_blocks": 4}, "ska": {"n_heads": 2, "rank": 8},
        "kronecker_slots": {"n_heads": 2}})
    declared = [n for n in m.modules() if isinstance(n, RMSNorm) and n.to_linear]
    fp32_input = {"kronecker_slots"}
    assert declared == [n for b in m.blocks for n in ([b.mixer_norm] if b.mixer.name not in fp32_input else [])
                        + [b.state_norm]] + [m.norm]
    ids = torch.randint(50, (2, 17))

    def step():
        m.zero_grad(set_to_none=True)
        with gpu_path_on_cpu():
            with torch.autocast("cpu", dtype=torch.float16):
                logits = m(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]

    results, casts = {}, {}
    for to_linear in (True, False):
        for n in declared:
            n.to_linear = to_linear
        _, ops = count_launches(lambda: results.__setitem__(to_linear, step()))
        casts[to_linear] = ops["aten::_to_copy"]
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    assert casts[False] - casts[True] == 2 * len(declared)


def test_decode_under_autocast_steps_the_mixers_on_their_fp32_input():
    """A decode step under autocast hands each mixer's fp32 ``step`` the norm's fp32 output (not the autocast
    dtype its pre-norm gives ``forward``): the logits and states are exactly those of norms that never round."""
    from mixers.layers import RMSNorm

    m = build(d_model=32, layers=["gated_deltanet", "attention"],
              mixer_options={"gated_deltanet": {"n_heads": 2}, "attention": {"n_heads": 2}}).eval()
    ids = torch.randint(50, (2, 9))
    norms = [n for n in m.modules() if isinstance(n, RMSNorm) and n.to_linear]
    results = {}
    for to_linear in (True, False):
        for n in norms:
            n.to_linear = to_linear
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, states = m.prefill(ids[:, :8])
            logits, states = m.step(ids[:, 8], states)
        results[to_linear] = [logits] + [t for s in states for t in s.values()]
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)


def test_gradient_slots_change_no_gradient_and_drop_the_projections_concatenation(monkeypatch):
    """On the GPU path the fused projections and the convolved ``q|k|v`` are cut by
    :func:`kernels.grad_slots.split_in_place`, and the short convolutions, the q/k normalisation and the output
    norm's gate, the delta rule's, GLA's and SKA's kernels and the beta gate write their input gradients in place:
    the step's loss and every gradient are exactly those of plain splits, with one concatenation fewer per
    projection that feeds a short convolution, an output gate or SKA's statistics and readout (the slots' value
    and gate projection too: the gate is written in place, the value copied in), per convolved
    ``q|k|v`` cut for its normalisation, per normalised ``q|k`` and per convolved ``x|B|C`` (Mamba-2's, whose ``x``
    the SSD kernels read and write in place); their backwards copy in only the parts whose consumers did not
    write in place."""
    from kernels import grad_slots
    from kernels.device import gpu_path_on_cpu
    from tests.mixers.launches import count_launches

    layers = ["gated_deltanet", "deltaproduct", "gla", "gka", "mamba2", "ska", "kronecker_slots"]
    m = build(d_model=32, layers=layers, mixer_options={
        "gated_deltanet": {"n_heads": 2}, "deltaproduct": {"n_heads": 2}, "gla": {"n_heads": 2}, "gka": {"n_heads": 2},
        "mamba2": {"d_state": 8, "headdim": 16}, "ska": {"n_heads": 2, "rank": 8}, "kronecker_slots": {"n_heads": 2}})
    ids = torch.randint(50, (2, 17))

    def step():
        m.zero_grad(set_to_none=True)
        with gpu_path_on_cpu():
            logits = m(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters()]

    results = []
    _, slotted = count_launches(lambda: results.append(step()))
    monkeypatch.setattr(grad_slots, "ENABLED", False)
    _, plain = count_launches(lambda: results.append(step()))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    # projections: the delta rules', GLA's, GKA's, Mamba-2's, SKA's and the slots' value and gate; convolved q|k|v
    # and normalised q|k: the delta rules', GLA's and GKA's; convolved x|B|C: Mamba-2's
    assert plain["aten::cat"] - slotted["aten::cat"] == 7 + 4 + 4 + 1


def test_step_takes_one_state_per_layer_and_the_model_takes_specs():
    """A state list of the wrong length (a layer's state dropped) is refused instead of skipping layers; a layer
    list of names instead of Specs is pointed to zoo.build_model."""
    import pytest

    m = build(d_model=32, layers=["mamba2", "attention", "mamba2"],
              mixer_options={"mamba2": {"d_state": 8, "headdim": 16}, "attention": {"n_heads": 2}})
    ids = torch.randint(50, (2, int(torch.randint(2, 9, ()))))
    _, states = m.prefill(ids)
    logits, _ = m.step(ids[:, -1], states)
    assert logits.shape == (2, 50)
    for bad, got in ((states[:-1], "got 2 states"), (states + states[:1], "got 4 states"), (states[0], "got dict")):
        with pytest.raises(ValueError, match=f"states must be the list of 3 per-layer states .*{got}"):
            m.step(ids[:, -1], bad)
    with pytest.raises(TypeError, match=r"layers and state_mixer are Specs .* zoo.build_model"):
        HybridLM(["mamba2"], 50, 32)


def test_a_constructor_assertion_is_a_one_line_recipe_error():
    """A mixer whose constructor checks its options with ``assert`` (as research code does) is refused in one line
    naming the layer's recipe key and the assertion's message, not a traceback."""
    import pytest

    from mixers import MIXERS
    from mixers.options import OptionError
    from tests.mixers.example_mixer import CumulativeMean
    from zoo.config import Spec
    from zoo.errors import UserError

    class Asserting(CumulativeMean):
        name = f"asserting_{int(torch.randint(10**6, ()))}"

        def __init__(self, d_model, options):
            assert d_model % options.d_inner == 0, f"d_model {d_model} must be a multiple of d_inner {options.d_inner}"
            super().__init__(d_model, options)

    MIXERS.add(Asserting)
    try:
        assert build(d_model=32, layers=["mamba2", {Asserting.name: {"d_inner": 8}}],
                     mixer_options={"mamba2": {"headdim": 16}}).blocks[1].mixer.options.d_inner == 8
        said = "an assertion of its constructor failed (d_model 32 must be a multiple of d_inner 5); check the " \
               "options it asserts on"
        with pytest.raises(UserError) as err:    # the recipe's validation
            build(d_model=32, layers=["mamba2", {Asserting.name: {"d_inner": 5}}], mixer_options={"mamba2": {"headdim": 16}})
        assert str(err.value) == f"model.layers.1 ({Asserting.name}): {said}", str(err.value)
        with pytest.raises(OptionError) as err:  # a model built from its layers' specs
            HybridLM([Spec(Asserting.name, Asserting.Options(d_inner=5))], 50, 32)
        assert str(err.value) == f"model.layers.0: {Asserting.name}: {said}", str(err.value)
    finally:
        MIXERS.entries.pop(Asserting.name, None)
