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
