""":class:`zoo.lm_harness.ZooScorer` against computations made here from full forwards: the greedy flag of
``loglikelihood`` is whether every continuation token is the argmax after the tokens before it, and
``generate_until`` cuts the greedy continuation before the earliest stop string it holds."""
from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from mixers import MIXERS
from mixers.options import build_options
from tests.zoo.untrained import wake_zero_initialised
from zoo.config import Spec
from zoo.lm_harness import ZooScorer
from zoo.model import HybridLM


class LetterTokenizer:
    """One token per lowercase letter, EOS last: a text position is a token position."""
    vocab_size, eos_id = 27, 26

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids) -> bytes:
        return bytes(ord("a") + i for i in ids)


TOK = LetterTokenizer()


def scorer_and_model() -> tuple[ZooScorer, HybridLM]:
    cls = MIXERS.get("gla")
    model = HybridLM([Spec("gla", build_options(cls.Options, dict(cls.contract_options), ""))], TOK.vocab_size, 16)
    model = wake_zero_initialised(model.double().eval())
    return ZooScorer(model, types.SimpleNamespace(tokenizer=TOK)), model


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


@torch.no_grad()
def next_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]))[0, -1].double()


@torch.no_grad()
def greedy_text(model, context: str, n: int, stops=()) -> str:
    """Argmax of a full forward, token by token, ending at EOS or at the token that completes a stop string."""
    ids, new = TOK.encode(context), []
    for _ in range(n):
        token = int(next_logits(model, ids + new).argmax())
        new.append(token)
        if token == TOK.eos_id:
            break
        if any(s in TOK.decode(new).decode() for s in stops):
            break
    return TOK.decode([i for i in new if i != TOK.eos_id]).decode()


def test_the_greedy_flag_holds_exactly_when_every_continuation_token_is_the_argmax():
    scorer, model = scorer_and_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    for _ in range(4):
        context = letters(rng, rng.randint(1, 6))
        greedy = greedy_text(model, context, rng.randint(2, 6))
        if len(greedy) < 2:
            continue
        wrong_at = rng.randrange(len(greedy))
        other = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c != greedy[wrong_at])
        altered = greedy[:wrong_at] + other
        for continuation in (greedy, altered, letters(rng, rng.randint(1, 5))):
            ids = TOK.encode(context + continuation)
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)[-len(continuation):]
            target = torch.tensor(TOK.encode(continuation))
            expected_ll = sum(logp[i, t].item() for i, t in enumerate(target.tolist()))
            expected_greedy = all(int(logp[i].argmax()) == t for i, t in enumerate(target.tolist()))
            ll, is_greedy = scorer.loglikelihood(context, continuation)
            assert ll == pytest.approx(expected_ll, rel=1e-9)
            assert is_greedy == expected_greedy, (context, continuation, greedy)
        assert scorer.loglikelihood(context, greedy)[1] is True
        assert scorer.loglikelihood(context, altered)[1] is False


def test_generate_until_cuts_before_the_earliest_stop_string():
    scorer, model = scorer_and_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    checked = 0
    for _ in range(30):
        context = letters(rng, rng.randint(1, 6))
        full = greedy_text(model, context, 12)
        changes = [k for k in range(1, len(full)) if full[k] != full[0]]
        if not changes:
            continue
        k = changes[0]
        # both complete at token k: the longer one starts at 0, the single letter at k
        stops = [full[k], full[:k + 1]]
        rng.shuffle(stops)
        assert scorer.generate_until(context, stops, 12) == "", (context, full, stops)
        stops = [letters(rng, 1), full[rng.randrange(len(full)):][:2], "zzzzzzzz"]
        text = greedy_text(model, context, 12, stops)
        found = [text.find(s) for s in stops if s in text]
        assert scorer.generate_until(context, stops, 12) == (text[:min(found)] if found else text)
        checked += 1
        if checked == 3:
            break
    assert checked, "no greedy continuation with two different letters"
