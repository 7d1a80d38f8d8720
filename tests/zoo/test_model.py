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
