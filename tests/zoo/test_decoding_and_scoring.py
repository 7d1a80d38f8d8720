"""Scores of the lm-evaluation-harness adapter (:class:`zoo.lm_harness.ZooScorer`) against sums of log-softmax
over a full forward, computed here: which tokens a (context, continuation) pair scores."""
from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from mixers import MIXERS
from mixers.options import build_options
from tests.zoo.local_tokenizer import bpe_tokenizer
from tests.zoo.untrained import wake_zero_initialised
from zoo.config import Spec
from zoo.data.tokenize import ByteTokenizer
from zoo.lm_harness import ZooScorer
from zoo.model import HybridLM

WORDS = ["state", "mixer", "scan", "key", "gate", "decays", "opens", "the", "of", "and"]


def tiny_lm(vocab_size: int, name: str = "gla") -> HybridLM:
    cls = MIXERS.get(name)
    model = HybridLM([Spec(name, build_options(cls.Options, dict(cls.contract_options), ""))], vocab_size, 16)
    return wake_zero_initialised(model.double().eval())


def summed_logp(model, ids: list[int], scored: int) -> float:
    """The log-probability of the last ``scored`` tokens of ``ids`` after the others, from one full forward."""
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    targets = torch.tensor(ids[1:])
    return logp.gather(1, targets[:, None])[-scored:].sum().item()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_whitespace_ending_the_context_is_scored_with_the_continuation():
    """The harness's convention (and its hf model's): whitespace that ends the context opens the continuation,
    so ``("... key ", "decays")`` scores ``" decays"``, as ``("... key", " decays")`` does."""
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    tok = ByteTokenizer()
    model = tiny_lm(tok.vocab_size)
    scorer = ZooScorer(model, types.SimpleNamespace(tokenizer=tok))
    for space in (" ", "\n\n", " \t "):
        context, continuation = words(rng, rng.randint(1, 6)), words(rng, rng.randint(1, 3))
        ids = tok.encode(context + space + continuation)
        expected = summed_logp(model, ids, len((space + continuation).encode()))
        ll, greedy = scorer.loglikelihood(context + space, continuation)
        assert ll == pytest.approx(expected, rel=1e-9), repr(space)
        assert (ll, greedy) == scorer.loglikelihood(context, space + continuation)
    # a context of whitespace only: the continuation, opened by it, is scored after EOS
    continuation = words(rng, 2)
    ids = [tok.eos_id] + tok.encode("  " + continuation)
    assert scorer.loglikelihood("  ", continuation)[0] == pytest.approx(
        summed_logp(model, ids, len(ids) - 1), rel=1e-9)


def test_a_bpe_continuation_is_scored_as_the_whole_text_tokenises_it(tmp_path):
    """With merges across the boundary (``" decays"`` is one token of the text, ``"decays"`` after a lone space
    two others), the scored tokens are the whole text's after the context's, as the harness takes them."""
    tok = bpe_tokenizer(tmp_path / "tokenizer.json")
    model = tiny_lm(tok.vocab_size)
    scorer = ZooScorer(model, types.SimpleNamespace(tokenizer=tok))
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    for _ in range(4):
        context, continuation = words(rng, rng.randint(1, 5)), words(rng, rng.randint(1, 3))
        whole, ctx = tok.encode(context + " " + continuation), tok.encode(context)
        assert whole[:len(ctx)] == ctx and whole[len(ctx):] != tok.encode(continuation)  # the case at stake
        expected = summed_logp(model, whole, len(whole) - len(ctx))
        assert scorer.loglikelihood(context + " ", continuation)[0] == pytest.approx(expected, rel=1e-9)
        assert scorer.loglikelihood(context, " " + continuation)[0] == pytest.approx(expected, rel=1e-9)
    # a boundary inside a token the whole text merges: every continuation token is still scored, after the
    # context's own tokens
    ctx, cont = tok.encode("the ga"), tok.encode("te opens")
    assert tok.encode("the gate opens")[:len(ctx)] != ctx
    assert scorer.loglikelihood("the ga", "te opens")[0] == pytest.approx(
        summed_logp(model, ctx + cont, len(cont)), rel=1e-9)


def test_the_harness_hf_model_scores_a_context_ending_in_whitespace_as_the_adapter_does(tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    import lm_eval.models  # noqa: F401  (registers "hf" even where another test registered a model first)
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from tests.zoo.test_hf import export, lm_recipe, write_run
    run = write_run(tmp_path, lm_recipe([{"gla": {"n_heads": 2, "head_dim": 8}}]))
    harness = get_model("hf").create_from_arg_string(f"pretrained={export(run, tmp_path / 'hf')},dtype=float32,"
                                                     f"device=cpu,batch_size=1")
    scorer = ZooScorer.from_checkpoint(run)
    pairs = [("the key ", "decays"), ("a gate\n\n", "opens π"), ("x", " y")]
    got = harness.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                                disable_tqdm=True)
    for (ll, greedy), pair in zip(got, pairs):
        zoo_ll, zoo_greedy = scorer.loglikelihood(*pair)
        assert ll == pytest.approx(zoo_ll, rel=1e-5, abs=1e-5) and greedy == zoo_greedy, pair
