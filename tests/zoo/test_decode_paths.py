"""Decoding a hybrid stack that holds every registered mixer, each with an option that changes its decode state
(grouped KV heads, n_h = 3, a short convolution off, a per-step state norm, a shifted write address, ...):

- the model's ``prefill`` then ``step`` equals its ``forward`` in fp64 and fp32 for a batch of three, at lengths
  no chunk size divides, split at 0, 1, the middle, one short of the end and the end;
- ``zoo.generate.generate_ids`` greedy is the argmax of the full forward, token after token; sampling draws the
  same tokens however many other prompts were decoded before (no state leaks from one call into the next);
- the transformers model of the same stack continues a filled ``ZooCache`` to the forward's logits, and its
  greedy ``generate`` on a batch equals each prompt's own."""
from __future__ import annotations

import pytest
import torch

import zoo
from tests.zoo.untrained import wake_zero_initialised
from zoo.generate import generate_ids

VOCAB = 257  # the byte tokenizer's (256 bytes + EOS)

LAYERS = [
    {"attention": {"n_heads": 4, "n_kv_heads": 2}},
    {"mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 5}},
    {"deltaproduct": {"n_heads": 2, "head_dim": 8, "num_householder": 3, "chunk_size": 4}},
    {"gated_deltanet": {"n_heads": 2, "head_dim": 8, "use_short_conv": False, "chunk_size": 8}},
    {"deltanet": {"n_heads": 2, "head_dim": 8, "conv_size": 2, "chunk_size": 8}},
    {"gka": {"n_heads": 2, "head_dim": 8, "chunk_size": 8, "num_iter": 5}},
    {"gla": {"n_heads": 2, "head_dim": 8, "conv_size": 1, "chunk_size": 8}},
    {"ska": {"n_heads": 2, "rank": 4, "chunk_size": 1, "normalisation": "running_max", "ridge": 0.1}},
    {"bdlru": {"n_blocks": 4, "block_size": 4, "chunk_size": 8}},
    {"jordan": {"block_size": 4, "n_blocks": 4, "state_norm": "step", "chunk_size": 8}},
    {"kronecker_slots": {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "shift_write_address": True,
                         "chunk_size": 8}},
]


def stack_recipe(layers=None):
    return zoo.load({"model": {"d_model": 32, "layers": layers or LAYERS, "state_mixer": "swiglu"},
                     "task": {"name": "lm", "seq_len": 16},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})


def test_the_stack_holds_every_registered_mixer():
    from mixers import MIXERS
    assert {next(iter(layer)) for layer in LAYERS} == set(MIXERS.names())


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return wake_zero_initialised(zoo.build_model(stack_recipe())).eval()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_prefill_then_step_equals_forward_at_the_edge_splits(stack, dtype, tol):
    model = stack.to(dtype)
    try:
        for T in (1, 9, 19):
            ids = torch.randint(0, VOCAB, (3, T))
            with torch.no_grad():
                full = model(ids)
                for split in sorted({0, 1, T // 2, T - 1, T}):
                    logits, states = model.prefill(ids[:, :split])
                    parts = [logits]
                    for t in range(split, T):
                        out, states = model.step(ids[:, t], states)
                        parts.append(out[:, None])
                    err = (torch.cat(parts, 1) - full).abs().max() / full.abs().max()
                    assert err < tol, f"{dtype}, T={T}: prefill of {split} then steps vs forward: {err:.2e}"
    finally:
        stack.float()


def test_greedy_generation_is_the_argmax_of_the_full_forward_token_after_token(stack):
    model = stack.double()
    try:
        for length in (1, 6, 13):
            prompt = torch.randint(0, 256, (length,)).tolist()
            new, _, _ = generate_ids(model, prompt, max_new_tokens=9, temperature=0)
            seq = list(prompt)
            with torch.no_grad():
                for token in new:
                    assert token == int(model(torch.tensor([seq]))[0, -1].argmax()), (prompt, new)
                    seq.append(token)
            assert len(new) == 9  # no EOS given: never stops early
    finally:
        stack.float()


def test_a_sampled_continuation_does_not_depend_on_the_calls_before_it(stack):
    prompt = torch.randint(0, 256, (5,)).tolist()
    kwargs = dict(max_new_tokens=7, temperature=1.3, top_k=40, top_p=0.9, seed=11)
    first, _, _ = generate_ids(stack, prompt, **kwargs)
    generate_ids(stack, torch.randint(0, 256, (17,)).tolist(), **{**kwargs, "seed": 3})
    generate_ids(stack, [1], max_new_tokens=4)
    assert generate_ids(stack, prompt, **kwargs)[0] == first


def test_the_transformers_model_continues_its_cache_to_the_forwards_logits(stack, tmp_path):
    pytest.importorskip("transformers")
    from zoo.hf import ZooCache, ZooConfig, ZooForCausalLM

    recipe = stack_recipe()
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=VOCAB, test_time={},
                       eos_token_id=256, pad_token_id=256, bos_token_id=256)
    model = ZooForCausalLM(config, hybrid=stack).eval().double()
    try:
        ids = torch.randint(0, VOCAB, (3, 11))
        with torch.no_grad():
            full = model(ids).logits
            cache = ZooCache()
            parts = [model(ids[:, :4], cache=cache, use_cache=True).logits]
            parts += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(4, 9)]
            parts.append(model(ids[:, 9:], cache=cache, use_cache=True).logits)  # two tokens through the states
        assert (torch.cat(parts, 1) - full).abs().max() <= 1e-10 * full.abs().max()
        assert cache.get_seq_length() == 11
        prompts = torch.randint(0, 256, (3, 6))
        batch = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False,
                               suppress_tokens=[256])
        for i in range(3):
            alone = model.generate(prompts[i:i + 1], max_new_tokens=6, do_sample=False, suppress_tokens=[256])
            assert torch.equal(batch[i], alone[0]), i
    finally:
        stack.float()
