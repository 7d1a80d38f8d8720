"""``zoo.generate`` against outcomes written out here: ``generate_text`` starts an empty prompt from EOS, keeps the
EOS it stops at among the new ids but not in the text; ``sample`` with ``top_k`` one short of the vocabulary never
draws the least likely token, and with ``top_k`` at the vocabulary size draws every token."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from zoo.generate import generate_text, sample

VOCAB = 12


class ScriptedLM(torch.nn.Module):
    """A model whose every next token is the next entry of ``script``; it records the prompts it is given."""

    def __init__(self, script: list[int]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.script, self.prompts = script, []

    def _logits(self, position: int) -> torch.Tensor:
        out = torch.zeros(VOCAB)
        out[self.script[position]] = 5.0
        return out

    def prefill(self, ids):
        self.prompts.append(ids[0].tolist())
        return self._logits(0).expand(1, ids.shape[1], VOCAB), 1

    def step(self, token, position):
        return self._logits(position)[None], position + 1


class LetterTokenizer:
    """Token ``i`` is the letter ``a + i``; ``eos_id`` is one of them."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids) -> bytes:
        return bytes(ord("a") + i for i in ids)


def test_an_empty_prompt_starts_from_eos_and_the_text_leaves_out_the_eos_it_stops_at():
    eos = int(torch.randint(1, VOCAB, ()))
    others = [t for t in range(VOCAB) if t != eos]
    before = [others[i] for i in torch.randint(0, len(others), (int(torch.randint(0, 6, ())),)).tolist()]
    script = before + [eos] + [others[0]] * 5
    task = SimpleNamespace(tokenizer=LetterTokenizer(eos))
    for prompt, tokens in (("", [eos]), ("bca", [1, 2, 0])):
        model = ScriptedLM(script)
        g = generate_text(model, task, prompt, max_new_tokens=len(script), temperature=0.0)
        assert model.prompts == [tokens]
        assert g.prompt_tokens == len(tokens)
        assert g.ids == before + [eos]
        assert g.text == "".join(chr(ord("a") + t) for t in before)


def test_top_k_one_short_of_the_vocabulary_leaves_out_only_the_least_likely_token():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    logits = torch.randn(VOCAB)
    least = int(logits.argmin())
    short = {sample(logits, 50.0, top_k=VOCAB - 1, generator=g) for _ in range(400)}
    assert short == set(range(VOCAB)) - {least}
    for top_k in (VOCAB, VOCAB + 3):
        assert {sample(logits, 50.0, top_k=top_k, generator=g) for _ in range(400)} == set(range(VOCAB))
