"""The hybrid stack (``zoo.model.HybridLM``) is its documented composition written out by hand: embedding, then
per block ``x + mixer(RMSNorm(x))`` and ``x + state_mixer(RMSNorm(x))`` with the recipe's ``norm_eps`` and each
norm's own gain, a final RMSNorm, and a head tied to the embedding; the embedding starts at N(0, 0.02)."""
from __future__ import annotations

import pytest
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve

VOCAB, D = 50, 32


def build(norm_eps, **model):
    recipe = resolve({"model": {"d_model": D, "norm_eps": norm_eps, **model}, "task": {"name": "mqar"}})
    return HybridLM.from_recipe(recipe, vocab_size=VOCAB)


def rms_norm(x, gain, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def by_hand(model, ids, eps):
    x = model.embed.weight[ids]
    for block in model.blocks:
        x = x + block.mixer(rms_norm(x, block.mixer_norm.weight, eps))
        if block.state_mixer is not None:
            x = x + block.state_mixer(rms_norm(x, block.state_norm.weight, eps))
    return rms_norm(x, model.norm.weight, eps) @ model.embed.weight.T


@pytest.mark.parametrize("norm_eps", [1e-5, 0.5])
@pytest.mark.parametrize("state_mixer", ["swiglu", "none"])
def test_forward_is_the_documented_composition(norm_eps, state_mixer):
    model = build(norm_eps, layers=["mamba2", "attention"], state_mixer=state_mixer,
                  mixer_options={"mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 4},
                                 "attention": {"n_heads": 2}}).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand_like(p))       # gains away from 1, so a skipped gain shows
        model.embed.weight.mul_(30.0)                    # activations of order one, so the eps shows
        ids = torch.randint(VOCAB, (2, 9))
        torch.testing.assert_close(model(ids), by_hand(model, ids, norm_eps), rtol=1e-9, atol=1e-9)


def test_the_embedding_starts_at_the_documented_scale():
    """N(0, 0.02): over 50 x 32 draws the sample std lies within 15 % of 0.02 (the std error of a sample std is
    1 / sqrt(2 n) = 1.8 %, so 15 % is eight of them), the mean within six standard errors of 0 (a false alarm
    of 2e-9), and the head is the same tensor."""
    model = build(1e-5, layers=["mamba2"], mixer_options={"mamba2": {"headdim": 16}})
    std = model.embed.weight.std().item()
    assert abs(std - 0.02) < 0.15 * 0.02, std
    assert abs(model.embed.weight.mean().item()) < 6 * 0.02 / (VOCAB * D) ** 0.5
    assert model.head.weight is model.embed.weight
