"""Decoding as a user meets it, against outcomes computed here: ``zoo generate``'s text is what the new tokens add
after the prompt when the whole sequence is decoded (a sentencepiece-style token decoded alone drops its space),
its peak memory is read in the unit the platform reports, and the transformers model refuses an empty prompt
and assisted decoding in one line, before any decoding, naming what to do instead. Tiny models and a tokenizer
trained here; nothing is written outside ``tmp_path`` or downloaded."""
from __future__ import annotations

import random
import resource
import sys
from types import SimpleNamespace

import pytest
import torch

from zoo.data.tokenize import ByteTokenizer, HFTokenizer
from zoo.generate import generate_text, peak_memory_mb

WORDS = ["state", "mixer", "scan", "key", "gate", "decays", "opens", "the", "of", "and"]


class ScriptedLM(torch.nn.Module):
    """A model over ``vocab`` tokens whose every next token is the next entry of ``script``."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.script, self.vocab = script, vocab

    def _logits(self, position: int) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[self.script[position]] = 5.0
        return out

    def prefill(self, ids):
        return self._logits(0).expand(1, ids.shape[1], self.vocab), 1

    def step(self, token, position):
        return self._logits(position)[None], position + 1


def sentencepiece_style(path, rng: random.Random) -> HFTokenizer:
    """A Metaspace BPE tokenizer (``▁word`` tokens, as Llama's and T5's) trained on random sentences of WORDS."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Metaspace()])
    tok.train_from_iterator([" ".join(rng.choice(WORDS) for _ in range(80))], tokenizers.trainers.BpeTrainer(
        vocab_size=330, special_tokens=["</s>"] + [f"<0x{b:02X}>" for b in range(256)]))
    tok.save(str(path))
    return HFTokenizer(str(path))


def test_the_generated_text_is_what_the_new_tokens_add_to_the_whole_decoded_text(tmp_path):
    """``prompt + text`` (what ``zoo generate`` prints) is the prompt and its continuation decoded as one sequence:
    a sentencepiece ``▁opens`` after the prompt ``the key`` adds `` opens``, not ``opens``."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    for tok in (sentencepiece_style(tmp_path / "tokenizer.json", rng), ByteTokenizer()):
        for _ in range(3):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
            more = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
            whole = tok.encode(prompt + " " + more)
            head = tok.encode(prompt)
            assert whole[:len(head)] == head and tok.decode(whole).decode() == prompt + " " + more
            script = whole[len(head):] + [tok.eos_id]
            task = SimpleNamespace(tokenizer=tok)
            g = generate_text(ScriptedLM(script, tok.vocab_size), task, prompt, max_new_tokens=len(script))
            assert g.ids == script
            assert prompt + g.text == prompt + " " + more, (type(tok).__name__, prompt, g.text)
        # the empty prompt starts from EOS, and its text is the continuation decoded from the start of a text
        script = tok.encode(more) + [tok.eos_id]
        g = generate_text(ScriptedLM(script, tok.vocab_size), SimpleNamespace(tokenizer=tok), "", len(script))
        assert g.text == more


@pytest.mark.parametrize("platform, unit", [("darwin", 1), ("linux", 1024)])
def test_the_peak_memory_reads_the_resident_set_size_in_the_unit_the_platform_reports(monkeypatch, platform, unit):
    """``ru_maxrss`` is in bytes on macOS and in KiB on Linux; the printed peak is in MiB on both."""
    mib = float(torch.randint(50, 5000, ()))
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=int(mib * 2**20 / unit)))
    assert peak_memory_mb(torch.device("cpu")) == pytest.approx(mib)


def exported_model_and_tokenizer():
    pytest.importorskip("transformers")
    from tests.zoo.test_hf_export_decoding_inputs_properties import tiny_model
    from zoo.hf.tokenizer import transformers_tokenizer
    return tiny_model(), transformers_tokenizer(ByteTokenizer())


def forward_calls(model) -> list[int]:
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(1), with_kwargs=True)
    return calls


def test_an_empty_tokenised_prompt_is_refused_naming_eos_and_eos_continues_as_generate_without_a_prompt():
    """``tok("")`` gives no token, so no logits for the first new one (transformers then failed with an IndexError
    deep in its sampling loop): refused in one line naming EOS; the prompt it names decodes as ``generate()``
    without a prompt does, and as greedy full forwards from EOS."""
    from tests.zoo.test_hf_export_decoding_inputs_properties import EOS, _greedy
    model, tok = exported_model_and_tokenizer()
    calls = forward_calls(model)
    with pytest.raises(ValueError, match=r"empty prompt.*eos_token_id") as err:
        model.generate(**tok("", return_tensors="pt"), max_new_tokens=3)
    assert "\n" not in str(err.value) and len(calls) == 1
    n = int(torch.randint(2, 6, ()))
    from_eos = model.generate(torch.tensor([[tok.eos_token_id]]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    without = model.generate(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert torch.equal(from_eos, without)
    assert from_eos[0, 1:].tolist() == _greedy(model, [EOS], n)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant_model"])
def test_assisted_decoding_is_refused_before_any_decoding_because_the_state_cannot_roll_back(how):
    """transformers answered 'Assisted decoding requires a cache', which the model has: the refusal names the
    recurrent state instead, before any forward."""
    model, tok = exported_model_and_tokenizer()
    prompt = torch.randint(0, 256, (1, int(torch.randint(2, 8, ()))))
    kwargs = {"prompt_lookup_num_tokens": 2} if how == "prompt_lookup" else {"assistant_model": model}
    calls = forward_calls(model)
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(prompt, max_new_tokens=4, do_sample=False, **kwargs)
    assert calls == []


def gka_model(num_iter: int):
    pytest.importorskip("transformers")
    import zoo
    from tests.zoo.untrained import wake_zero_initialised
    from zoo.hf import ZooConfig, ZooForCausalLM
    recipe = zoo.load({"model": {"d_model": 16, "layers": [{"gka": {"n_heads": 2, "head_dim": 8}}, "attention"]},
                       "task": {"name": "lm", "seq_len": 16}, "eval": {"test_time": {"num_iter": num_iter}}})
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=257, test_time={"num_iter": num_iter})
    model = ZooForCausalLM(config).eval()
    wake_zero_initialised(model.zoo)
    return model.double()


def test_an_edited_config_test_time_is_what_the_model_computes_with_and_what_its_saved_copy_loads_with(tmp_path):
    """``config.test_time`` is the knob values the model computes with (and what ``save_pretrained`` writes): after
    an edit, the logits, with or without a cache, are the zoo model's under the new values, as the reloaded copy's
    are; an edit the option refuses is refused at the next forward in one line, and the model keeps computing
    with the values it had."""
    from zoo.hf import ZooCache, ZooForCausalLM
    before, after = int(torch.randint(0, 3, ())), int(torch.randint(6, 20, ()))
    model = gka_model(before)
    ids = torch.randint(0, 257, (2, int(torch.randint(6, 14, ()))))
    with torch.no_grad():
        with model.zoo.test_time({"num_iter": before}):
            old = model.zoo(ids)
        with model.zoo.test_time({"num_iter": after}):
            new = model.zoo(ids)
        assert (new - old).abs().max() > 1e-3  # the knob matters for these weights
        torch.testing.assert_close(model(ids).logits, old, rtol=0, atol=1e-10)
        model.config.test_time = {"num_iter": after}
        torch.testing.assert_close(model(ids).logits, new, rtol=0, atol=1e-10)
        cache, split = ZooCache(), int(torch.randint(1, ids.shape[1], ()))
        stepped = torch.cat([model(ids[:, :split], cache=cache).logits, model(ids[:, split:], cache=cache).logits], 1)
        torch.testing.assert_close(stepped, new, rtol=0, atol=1e-8)
        model.save_pretrained(tmp_path / "saved")
        again = ZooForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64).eval()
        assert again.config.test_time == {"num_iter": after}
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=1e-10)
        model.config.test_time = {"num_iter": -1}
        with pytest.raises(ValueError, match=r"config\.test_time\.num_iter.*-1") as err:
            model(ids)
        assert "\n" not in str(err.value)
        model.config.test_time = {"num_iter": after}
        torch.testing.assert_close(model(ids).logits, new, rtol=0, atol=1e-10)
        model.config.test_time = {}  # no knob: every layer computes with its option again, as a reload does
        with model.zoo.test_time({"num_iter": model.zoo.blocks[0].mixer.options.num_iter}):
            plain = model.zoo(ids)
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=1e-10)
