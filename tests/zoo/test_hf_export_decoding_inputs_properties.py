"""Inputs of the transformers model of a zoo language model against its own full forward: ``logits_to_keep``
keeps exactly the positions it names, beam search follows its beams' states, a prompt repeated for several
returned sequences decodes as that prompt alone, and padding that would enter a decode state is refused (right
padding too, where a cache is filled). Tiny untrained models built here; nothing is written or downloaded."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.zoo.untrained import wake_zero_initialised
from zoo.hf import ZooCache, ZooConfig, ZooForCausalLM
from zoo.hf.model import CACHE_FIELD

EOS = 256


def tiny_model() -> ZooForCausalLM:
    """In float64: an untrained model's next-token distributions are nearly uniform, so beams and greedy choices
    lie within about 1e-4 of each other, and in float32 a cached decode and a full forward (rounded in different
    orders, about 1e-7 apart) swapped two such beams about once in 6,000 draws. transformers rounds the logits of a
    decoding step to float32, which both decodes then share."""
    recipe = zoo.load({"model": {"d_model": 16, "layers": ["gla", "attention"]},
                       "task": {"name": "lm", "seq_len": 16}, "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=257, eos_token_id=EOS,
                       pad_token_id=EOS, bos_token_id=EOS)
    model = ZooForCausalLM(config).eval()
    wake_zero_initialised(model.zoo)
    return model.double()


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards over the whole sequence, without any cache, never choosing EOS (as
    ``min_new_tokens`` makes ``generate`` do)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits[EOS] = -float("inf")
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_logits_to_keep_returns_exactly_the_named_positions_of_the_full_logits():
    model = tiny_model()
    T = int(torch.randint(4, 12, ()))
    ids = torch.randint(0, 257, (2, T))
    keep = int(torch.randint(1, T, ()))
    positions = torch.randperm(T)[:3].sort().values
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=keep).logits
        picked = model(ids, logits_to_keep=positions).logits
    assert last.shape == (2, keep, 257) and picked.shape == (2, 3, 257)
    torch.testing.assert_close(last, full[:, T - keep:], rtol=0, atol=1e-6)
    torch.testing.assert_close(picked, full[:, positions], rtol=0, atol=1e-6)


def test_each_returned_sequence_continues_its_own_prompt():
    """Two prompts, two sequences each (the cache's rows repeated per prompt): top-1 sampling is greedy, so each
    sequence is its prompt's greedy continuation computed without a cache (EOS barred by ``min_new_tokens``)."""
    model = tiny_model()
    prompts = torch.randint(0, 256, (2, int(torch.randint(2, 6, ()))))
    while torch.equal(prompts[0], prompts[1]):
        prompts = torch.randint(0, 256, prompts.shape)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=1,
                         num_return_sequences=2, max_new_tokens=4, min_new_tokens=4, **{CACHE_FIELD: ZooCache()})
    assert out.shape == (4, prompts.shape[1] + 4)
    for row, prompt in zip(out, prompts.repeat_interleave(2, dim=0)):
        assert row[:len(prompt)].tolist() == prompt.tolist()
        assert row[len(prompt):].tolist() == _greedy(model, prompt.tolist(), 4)


def test_beam_search_on_the_states_finds_the_beams_full_forwards_find():
    """Beam search reorders the cache's rows to follow the surviving beams at every step: its sequences and scores
    equal those of beam search that recomputes every beam from its tokens (no cache)."""
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, int(torch.randint(2, 6, ()))))
    runs = [model.generate(prompt, attention_mask=torch.ones_like(prompt), num_beams=4, num_return_sequences=4,
                           max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=use_cache,
                           return_dict_in_generate=True, output_scores=True) for use_cache in (True, False)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(runs[0].sequences_scores, runs[1].sequences_scores, rtol=0, atol=1e-5)


def test_repeating_the_cache_rows_repeats_each_row_in_place():
    cache = ZooCache()
    rows = torch.randn(3, 2, 5)
    cache.states = [{"s": rows.clone()}]
    cache.batch_repeat_interleave(2)
    for i in range(6):
        assert torch.equal(cache.states[0]["s"][i], rows[i // 2])


def test_right_padding_is_refused_where_the_prompt_fills_a_cache():
    """A padded position would be read into the decode state and every token generated after it: with a cache,
    any zero in the mask is refused, right padding too; without one, right padding scores as the shorter rows."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 6))
    right = torch.ones(2, 6, dtype=torch.long)
    right[1, 4:] = 0
    with pytest.raises(ValueError, match="recurrent state"):
        model(ids, attention_mask=right, use_cache=True)
    with pytest.raises(ValueError, match="recurrent state"):
        model.generate(ids, attention_mask=right, max_new_tokens=1)
    with torch.no_grad():
        scored = model(ids, attention_mask=right).logits[1, :4]
        torch.testing.assert_close(scored, model(ids[1:, :4]).logits[0], rtol=0, atol=1e-5)
