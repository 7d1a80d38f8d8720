"""The decode cache of the transformers model of a zoo language model, against full forwards without a cache:
selecting rows of a filled cache continues exactly the selected prompts, the cache reports the tokens it has
consumed as a KV cache would, a rollback by any number of tokens is refused in one line (a recurrent state keeps
no past), and a mask with padding before a token is refused even without a cache. Tiny untrained models built
here; nothing is written or downloaded."""
from __future__ import annotations

import pytest
import torch

from zoo.hf import ZooCache, ZooForCausalLM
from zoo.hf.model import CACHE_FIELD

from .test_hf_export_decoding_inputs_properties import tiny_model


def filled_cache(model: ZooForCausalLM, ids: torch.Tensor) -> ZooCache:
    with torch.no_grad():
        return getattr(model(ids, use_cache=True), CACHE_FIELD)


def test_selected_cache_rows_continue_exactly_the_selected_prompts():
    model = tiny_model()
    prompts = torch.randint(0, 256, (4, int(torch.randint(2, 7, ()))))
    rows = torch.randperm(4)[:2]
    nxt = torch.randint(0, 256, (2, 2))
    cache = filled_cache(model, prompts)
    cache.batch_select_indices(rows)
    assert cache.batch_size == 2
    with torch.no_grad():
        stepped = model(nxt, use_cache=True, **{CACHE_FIELD: cache}).logits
        full = model(torch.cat([prompts[rows], nxt], dim=1), use_cache=False).logits[:, -2:]
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-5)


def test_the_cache_counts_every_token_it_has_consumed():
    """Prompt and stepped tokens add up: ``get_seq_length`` is the tokens so far and the mask of ``q`` new tokens
    spans them plus the past, from position 0, as a KV cache of the same tokens reports."""
    model = tiny_model()
    T, steps = int(torch.randint(2, 7, ())), int(torch.randint(1, 4, ()))
    cache = filled_cache(model, torch.randint(0, 256, (1, T)))
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randint(0, 256, (1, 1)), use_cache=True, **{CACHE_FIELD: cache})
    q = int(torch.randint(1, 5, ()))
    assert cache.get_seq_length() == T + steps
    assert cache.get_mask_sizes(q) == (q + T + steps, 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and len(cache) == 0


@pytest.mark.parametrize("sign", [1, -1])
def test_a_rollback_by_any_number_of_tokens_is_refused_and_changes_nothing(sign):
    model = tiny_model()
    T = int(torch.randint(3, 7, ()))
    cache = filled_cache(model, torch.randint(0, 256, (2, T)))
    before = [{k: v.clone() for k, v in state.items()} for state in cache.states]
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(sign * int(torch.randint(1, T, ())))
    cache.crop(0)  # nothing to remove: nothing refused
    assert cache.get_seq_length() == T
    for kept, saved in zip(cache.states, before):
        assert kept.keys() == saved.keys() and all(torch.equal(kept[k], saved[k]) for k in kept)


@pytest.mark.parametrize("hole", ["left", "inside"])
def test_padding_before_a_token_is_refused_without_a_cache(hole):
    """The padded position would enter every later position's state: left padding, or a hole inside a row, is
    refused when scoring, not only when decoding."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    row, col = int(torch.randint(0, 2, ())), int(torch.randint(0, 3, ()))
    if hole == "left":
        mask[row, :col + 1] = 0
    else:
        mask[row, col + 1] = 0
    with pytest.raises(ValueError, match="recurrent state"):
        model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="recurrent state"):
        model(ids, attention_mask=mask, use_cache=False)


def test_a_consumed_cache_is_continued_with_use_cache_false():
    """``use_cache=False`` beside a cache that has consumed a prompt still continues that prompt (the logits of the
    whole text's last positions, as transformers' own models read their past) and advances the cache; it only
    leaves the cache out of the output."""
    model = tiny_model()
    T, n = int(torch.randint(2, 7, ())), int(torch.randint(1, 4, ()))
    prompt, nxt = torch.randint(0, 256, (2, T)), torch.randint(0, 256, (2, n))
    cache = filled_cache(model, prompt)
    with torch.no_grad():
        out = model(nxt, use_cache=False, **{CACHE_FIELD: cache})
        full = model(torch.cat([prompt, nxt], dim=1), use_cache=False).logits[:, -n:]
    torch.testing.assert_close(out.logits, full, rtol=0, atol=1e-5)
    assert getattr(out, CACHE_FIELD) is None and cache.get_seq_length() == T + n
