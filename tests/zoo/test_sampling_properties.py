"""``zoo.generate.generate_ids`` against draws computed here: each sampled token is the draw of a generator
seeded by ``seed`` from the softmax of a full forward's last logits over the temperature, restricted to the
``top_k`` most likely tokens or the smallest set reaching ``top_p``; decoding ends at the first EOS."""
from __future__ import annotations

import pytest
import torch

from mixers import MIXERS
from mixers.options import build_options
from tests.zoo.untrained import wake_zero_initialised
from zoo.config import Spec
from zoo.generate import generate_ids
from zoo.model import HybridLM

VOCAB = 40


def tiny_lm(name: str = "gla") -> HybridLM:
    cls = MIXERS.get(name)
    model = HybridLM([Spec(name, build_options(cls.Options, dict(cls.contract_options), ""))], VOCAB, 16)
    return wake_zero_initialised(model.double().eval())


def kept_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The probabilities a draw is made from, written out token by token."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    if top_p < 1.0:
        mass = probs[kept] / probs[kept].sum()
        total, nucleus = 0.0, []
        for token, p in zip(kept, mass.tolist()):
            nucleus.append(token)
            total += p
            if total >= top_p:
                break
        kept = nucleus
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@torch.no_grad()
def drawn_by_hand(model, prompt, n, temperature, top_k, top_p, seed):
    generator = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1]
        probs = kept_probabilities(logits, temperature, top_k, top_p)
        seq.append(int(torch.multinomial(probs, 1, generator=generator)))
    return seq[len(prompt):]


@torch.no_grad()
def greedy_by_hand(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("restriction", ["none", "top_k", "top_p"])
def test_each_token_is_the_seeded_draw_from_the_full_forwards_distribution(restriction):
    model = tiny_lm()
    temperature = float(torch.empty(()).uniform_(0.2, 0.5)) * (8 if bool(torch.rand(()) < 0.5) else 1)
    top_k = int(torch.randint(2, 8, ())) if restriction == "top_k" else 0
    top_p = 0.3 + 0.6 * float(torch.rand(())) if restriction == "top_p" else 1.0
    for seed in torch.randint(0, 2**31 - 1, (2,)).tolist():
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 7, ())),)).tolist()
        n = int(torch.randint(10, 16, ()))
        got, _, _ = generate_ids(model, prompt, n, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        assert got == drawn_by_hand(model, prompt, n, temperature, top_k, top_p, seed), (seed, temperature)


def test_decoding_ends_at_the_first_eos_and_keeps_it():
    model = tiny_lm()
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 7, ())),)).tolist()
    n = 10
    greedy = greedy_by_hand(model, prompt, n)
    eos = greedy[int(torch.randint(0, n - 1, ()))]
    expected = greedy[:greedy.index(eos) + 1]
    got, _, _ = generate_ids(model, prompt, n, eos_id=eos)
    assert got == expected, (eos, greedy)
    absent = next(t for t in range(VOCAB) if t not in greedy)
    assert generate_ids(model, prompt, n, eos_id=absent)[0] == greedy
