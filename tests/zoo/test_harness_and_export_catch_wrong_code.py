"""What a trained model publishes outside the zoo, checked against computations made here: the lm-evaluation-harness
adapter (:mod:`zoo.lm_harness`: which tokens ``loglikelihood`` and ``loglikelihood_rolling`` sum, how
``generate_until`` ends and cuts, what the registered ``zoo`` model hands it), the ``zoo export`` model card, reload
check and tokenizer (:mod:`zoo.hf.export`, :mod:`zoo.hf.tokenizer`, :mod:`zoo.hf.config`) and the re-evaluation of
a trained model (:mod:`zoo.reevaluate`). Tiny models with random weights; nothing downloads."""
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

#: the characters of :class:`CharTokenizer`, one token each; the last id is EOS unless a test names another
ALPHABET = "abcdefghijklmnopqrstuvwxyz #"


class CharTokenizer:
    """One token per character of :data:`ALPHABET`. ``prefix_space`` opens every text that does not start with a
    space with a space token, as a sentencepiece tokenizer's dummy prefix does (so a text's tokens after a prefix
    differ from the tokens of that tail encoded alone); ``decoded`` gives some ids other bytes than their character."""
    vocab_size = len(ALPHABET)

    def __init__(self, eos_id: int = len(ALPHABET) - 1, prefix_space: bool = False, decoded=None):
        self.eos_id, self.prefix_space, self.decoded = eos_id, prefix_space, dict(decoded or {})

    def encode(self, text: str) -> list[int]:
        ids = [ALPHABET.index(c) for c in text]
        return [ALPHABET.index(" ")] + ids if self.prefix_space and text and not text.startswith(" ") else ids

    def decode(self, ids) -> bytes:
        return b"".join(self.decoded.get(i, ALPHABET[i].encode()) for i in ids)


def tiny_lm() -> HybridLM:
    cls = MIXERS.get("gla")
    model = HybridLM([Spec("gla", build_options(cls.Options, dict(cls.contract_options), ""))], len(ALPHABET), 16)
    return wake_zero_initialised(model.double().eval())


def scorer_of(model, tok) -> ZooScorer:
    return ZooScorer(model, types.SimpleNamespace(tokenizer=tok))


def letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET[:26]) for _ in range(n))


def seeded_rng() -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, ())))


@torch.no_grad()
def summed_logp(model, prefix: list[int], scored: list[int]) -> float:
    """log p(scored | prefix) summed token by token from one full forward of ``prefix + scored``."""
    ids = prefix + scored
    logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    return sum(float(logp[len(prefix) - 1 + i, t]) for i, t in enumerate(scored))


@torch.no_grad()
def greedy_ids(model, prompt: list[int], n: int, eos_id: int | None = None) -> list[int]:
    """Argmax of a full forward, token by token: ``n`` tokens, or up to and with ``eos_id``."""
    new = []
    for _ in range(n):
        new.append(int(model(torch.tensor([prompt + new]))[0, -1].argmax()))
        if new[-1] == eos_id:
            break
    return new


# --------------------------------------------------------------------------------------- the harness adapter
def test_the_continuation_scored_is_the_whole_texts_tokens_after_the_contexts():
    """With a tokenizer whose text opens with a dummy-prefix space, the continuation's tokens in the whole text
    carry no prefix (the continuation encoded alone would): the score is log p of the whole text's tokens after
    the context's, summed from a full forward."""
    rng, model = seeded_rng(), tiny_lm()
    tok = CharTokenizer(prefix_space=True)
    scorer = scorer_of(model, tok)
    for _ in range(3):
        context, continuation = letters(rng, rng.randint(1, 5)), letters(rng, rng.randint(1, 4))
        ctx, whole = tok.encode(context), tok.encode(context + continuation)
        assert whole[len(ctx):] != tok.encode(continuation)  # the case at stake
        assert scorer.loglikelihood(context, continuation)[0] == pytest.approx(
            summed_logp(model, ctx, whole[len(ctx):]), rel=1e-9)


def test_an_empty_continuation_has_probability_one_and_is_greedy():
    """The empty continuation: log-probability 0 and greedy (every one of its no tokens is the argmax), as the
    harness's own models answer; an empty text rolls to 0 too."""
    rng = seeded_rng()
    scorer = scorer_of(tiny_lm(), CharTokenizer())
    assert scorer.loglikelihood(letters(rng, rng.randint(0, 5)), "") == (0.0, True)
    assert scorer.loglikelihood_rolling("") == 0.0


def test_a_rolling_loglikelihood_sums_every_token_of_the_text_after_eos():
    rng, model = seeded_rng(), tiny_lm()
    tok = CharTokenizer()
    scorer = scorer_of(model, tok)
    for _ in range(3):
        text = letters(rng, rng.randint(1, 12))
        assert scorer.loglikelihood_rolling(text) == pytest.approx(
            summed_logp(model, [tok.eos_id], tok.encode(text)), rel=1e-9)


def test_generate_until_decodes_max_gen_toks_greedy_tokens_and_ignores_empty_stop_strings():
    """Without a stop string that the text completes, the answer is the greedy continuation of exactly
    ``max_gen_toks`` tokens; an empty stop string stops nothing (it is in every text)."""
    rng, model = seeded_rng(), tiny_lm()
    tok = CharTokenizer(eos_id=len(ALPHABET))  # an EOS the model never produces: the length bound ends decoding
    scorer = scorer_of(model, tok)
    for _ in range(3):
        context, n = letters(rng, rng.randint(1, 6)), rng.randint(1, 8)
        expected = tok.decode(greedy_ids(model, tok.encode(context), n)).decode()
        assert scorer.generate_until(context, [], n) == expected
        assert scorer.generate_until(context, ["", "\x00"], n) == expected
    # the text is kept as decoded, whitespace that ends it too
    ids = greedy_ids(model, tok.encode(context), n)
    spaced = CharTokenizer(eos_id=tok.eos_id, decoded={ids[-1]: b" \n"})
    assert scorer_of(model, spaced).generate_until(context, [], n) == spaced.decode(ids).decode()


def test_generate_until_ends_at_eos_and_leaves_it_out_of_the_text():
    """EOS ends the generation, and the text is that of the tokens before it (made here the tokenizer's EOS: the
    first token of the greedy continuation that did not come before)."""
    rng, model = seeded_rng(), tiny_lm()
    for _ in range(20):
        context = letters(rng, rng.randint(1, 6))
        free = greedy_ids(model, CharTokenizer().encode(context), 8, eos_id=None)
        firsts = [k for k in range(1, len(free)) if free[k] not in free[:k]]
        if firsts:
            break
    else:
        pytest.fail("no greedy continuation with a new token after its first")
    k = rng.choice(firsts)
    tok = CharTokenizer(eos_id=free[k])
    assert scorer_of(model, tok).generate_until(context, ["zzzzzzzz"], 8) == tok.decode(free[:k]).decode()


def test_a_stop_string_is_not_matched_by_a_character_whose_bytes_are_still_coming():
    """Tokens that decode to the two bytes of ``é`` one at a time: while only the first has come, a stop string
    ``\\ufffd`` (the replacement character) must not end the generation; the answer is the full greedy text cut
    before the first replacement character it holds once decoded whole."""
    rng, model = seeded_rng(), tiny_lm()
    for _ in range(20):
        context = letters(rng, rng.randint(1, 6))
        free = greedy_ids(model, CharTokenizer().encode(context), 6)
        if free[0] != free[1]:
            break
    else:
        pytest.fail("no greedy continuation whose first two tokens differ")
    tok = CharTokenizer(eos_id=len(ALPHABET), decoded={free[0]: b"\xc3", free[1]: b"\xa9"})
    text = tok.decode(free).decode("utf-8", errors="replace")
    assert text.startswith("é")
    cut = text.find("\ufffd")
    assert scorer_of(model, tok).generate_until(context, ["\ufffd"], 6) == (text if cut < 0 else text[:cut])


def test_the_registered_harness_model_hands_until_and_max_gen_toks_to_the_adapter(tmp_path):
    """``generate_until`` requests of the registered ``zoo`` model: a string ``until`` is one stop string (not a
    list of its characters) and ``max_gen_toks`` bounds the continuation, as the adapter called with them."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from tests.zoo.test_harness_command_line import write_run
    from zoo.lm_harness import register

    run = write_run(tmp_path / "run")
    register()
    harness = get_model("zoo").create_from_arg_string(f"checkpoint={run}", {"device": "cpu"})
    scorer = harness.scorer
    rng = seeded_rng()
    for _ in range(5):
        context, n = letters(rng, rng.randint(1, 6)), rng.randint(2, 6)
        free = scorer.generate_until(context, [], n)
        if free:
            break
    else:
        pytest.fail("no non-empty greedy continuation")
    until = "\x00\x00" + free[0]  # absent from the text, its last character not
    assert until not in free
    requests = [Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": n}), 0),
                Instance("generate_until", {}, (context, {"until": [free[0]], "max_gen_toks": n}), 1),
                Instance("generate_until", {}, (context, {"max_gen_toks": n}), 2)]
    assert harness.generate_until(requests) == [free, "", free]


# --------------------------------------------------------------------------------------- zoo export
def lm_recipe(test_time=None, **task):
    import zoo
    layers = [{"gka": {**MIXERS.get("gka").contract_options, "num_iter": 4}}, "gla"]
    return zoo.load({"model": {"d_model": 16, "layers": layers}, "task": {"name": "lm", "seq_len": 16, **task},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0},
                     "eval": {"test_time": dict(test_time or {})}})


def test_the_model_card_lists_the_cells_rows_and_the_data_it_recorded(tmp_path):
    """An ablation cell's checkpoint (``<out>/checkpoints/<key>/``): the card lists the rows of its key in the
    ablation's ``results.jsonl`` (training rows, and ``zoo eval`` rows of it by ``trained_recipe_key``), never
    another cell's; ``data_*`` metrics go to the data section (not ``data_source``), not to the metrics lines; the
    ``hf_*`` task options of a task not read from the Hub are left out."""
    import zoo
    from zoo.hf.export import readme
    from zoo.rows import append_row, make_row

    recipe, other = lm_recipe(), lm_recipe(seq_len=32)
    path = tmp_path / "out" / "checkpoints" / recipe.key / "checkpoint.pt"
    loss, tokens, evaluated = float(torch.rand(())) + 1, int(torch.randint(1000, 9999, ())), float(torch.rand(()))
    rows = tmp_path / "out" / "results.jsonl"
    rows.parent.mkdir()
    append_row(rows, make_row(recipe, "cell", {"val_loss": loss, "data_tokens": tokens, "data_source": "somewhere"}))
    append_row(rows, make_row(other, "other cell", {"val_loss": 7.5}))
    append_row(rows, make_row(other, "its eval", {"test_loss": evaluated}, trained_recipe_key=recipe.key))
    model = types.SimpleNamespace(config=types.SimpleNamespace(test_time={}), zoo=zoo.build_model(recipe))
    card = readme(path, {"step": 1, "finished": True}, recipe, model, "published")
    metrics = card.split("## Metrics")[1].split("##")[0]
    assert f"- `cell`: val_loss {loss:.4g}\n" in metrics and f"- `its eval`: test_loss {evaluated:.4g}\n" in metrics
    assert "other cell" not in metrics and "data_" not in metrics
    data = card.split("## Data")[1].split("##")[0]
    assert f"; tokens: {tokens}." in data and "somewhere" not in data and "hf_" not in data
    assert "source: python-docs" in data


def test_the_model_card_says_where_the_test_time_knobs_come_from(tmp_path):
    """Knobs equal to the recipe's ``eval.test_time`` are named as the values its metrics were measured under;
    knobs set at export say so and name the recipe's."""
    import zoo
    from zoo.hf.export import readme

    knobs = {"num_iter": int(torch.randint(1, 4, ()))}
    recipe = lm_recipe(knobs)
    hybrid = zoo.build_model(recipe)
    for values, said in ((knobs, "the recipe's `eval.test_time`, under which its metrics were measured"),
                         ({"num_iter": knobs["num_iter"] + 1}, f"set at export; the recipe's `eval.test_time`: {knobs}")):
        model = types.SimpleNamespace(config=types.SimpleNamespace(test_time=values), zoo=hybrid)
        card = readme(tmp_path / "run" / "checkpoint.pt", {"step": 1, "finished": True}, recipe, model, "x")
        assert f"`num_iter={values['num_iter']}`" in card and said in card, card


def hf_model(recipe, test_time: dict, hybrid=None):
    from zoo.hf import ZooConfig, ZooForCausalLM
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=257, test_time=test_time,
                       eos_token_id=256, pad_token_id=256, bos_token_id=256)
    return ZooForCausalLM(config, hybrid=hybrid).eval()


def test_an_export_whose_written_folder_loads_back_other_weights_or_knobs_is_refused(tmp_path):
    """The reload check compares the written folder with the model: one weight entry changed, or other test-time
    knobs in its config, is an error; the folder of the model itself passes."""
    import zoo
    from zoo.hf.export import _check_reloads

    recipe = lm_recipe({"num_iter": 1})
    model = hf_model(recipe, {"num_iter": 1}, wake_zero_initialised(zoo.build_model(recipe)))
    model.save_pretrained(tmp_path / "same")
    _check_reloads(model, tmp_path / "same")
    changed = hf_model(recipe, {"num_iter": 1}, zoo.build_model(recipe))
    changed.zoo.load_state_dict(model.zoo.state_dict())
    weights = [p for p in changed.parameters() if p.numel() > 1]
    with torch.no_grad():
        weights[int(torch.randint(len(weights), ()))].view(-1)[0] += 1.0
    changed.save_pretrained(tmp_path / "changed")
    with pytest.raises(RuntimeError, match="do not load back equal"):
        _check_reloads(model, tmp_path / "changed")
    other_knobs = hf_model(recipe, {"num_iter": 2}, model.zoo)
    other_knobs.save_pretrained(tmp_path / "knobs")
    with pytest.raises(RuntimeError, match="test-time knobs"):
        _check_reloads(model, tmp_path / "knobs")


def test_the_exported_byte_tokenizer_decodes_text_unchanged_spaces_before_punctuation_too():
    from zoo.data.tokenize import ByteTokenizer
    from zoo.hf.tokenizer import transformers_tokenizer

    rng = seeded_rng()
    pieces = [" ,", " .", " ?", " !", " 's", " n't", " 're", "é", "  ", "a", "<|endoftext|>"]
    text = "".join(rng.choice(pieces) for _ in range(20)) + " ."
    tok, zoo_tok = transformers_tokenizer(ByteTokenizer()), ByteTokenizer()
    ids = tok(text)["input_ids"]
    assert ids == zoo_tok.encode(text)
    assert tok.decode(ids) == text == zoo_tok.decode(ids).decode()


def test_a_config_with_no_test_time_knobs_computes_with_none_not_the_recipes():
    """``config.test_time == {}`` (knobs edited away, or a recipe with none its layers declare) means the training
    options; only a config without the field (``None``) falls back to the recipe's ``eval.test_time``."""
    from zoo.hf import ZooConfig

    knobs = {"num_iter": int(torch.randint(1, 4, ()))}
    recipe = lm_recipe(knobs)
    for stored, values in (({}, {}), (None, knobs), ({"num_iter": 9}, {"num_iter": 9})):
        config = ZooConfig.from_dict(ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, test_time=stored).to_dict())
        assert config.test_time == stored and config.test_time_values() == values


# --------------------------------------------------------------------------------------- re-evaluation
def test_evaluating_a_train_result_applies_the_overrides_and_keeps_its_steps():
    """``zoo.evaluate(TrainResult, overrides)``: the overrides (a mapping or ``KEY=VALUE`` texts) reach the
    evaluation, whose numbers are the model's on the test data made here, and are checked (one that changes the
    trained model is refused) in either form; the trained steps are carried over."""
    from pathlib import Path

    import zoo
    from zoo.training.evaluation import evaluate_data
    from zoo.training.loop import TrainResult

    recipe = zoo.load(Path(__file__).parent / "recipes" / "tiny.yaml", ["model.layers=[gla]", "task.num_test=16"])
    model = wake_zero_initialised(zoo.build_model(recipe)).eval()
    steps, seq_len = int(torch.randint(1, 50, ())), int(torch.randint(9, 13, ())) * 2
    result = TrainResult(metrics={"steps": steps}, model=model, recipe=recipe)
    data = zoo.build_task(recipe).make("test", recipe.seed, seq_len=seq_len)
    expected = evaluate_data(model, data, recipe.eval.batch_size, torch.device("cpu"))
    for overrides in ({"eval.seq_lens": [seq_len]}, [f"eval.seq_lens=[{seq_len}]"]):
        metrics = zoo.evaluate(result, overrides)
        assert metrics["steps"] == steps and metrics[f"test_accuracy@{seq_len}"] == expected["accuracy"]
    for refused in ({"model.d_model": 64}, ["train.lr=0.5"]):  # a change of the trained model, in either form
        with pytest.raises(zoo.UserError, match="would change the trained model"):
            zoo.evaluate(result, refused)


def test_a_module_named_in_imports_that_does_not_import_is_the_users_to_fix():
    """A bad ``imports=[...]`` of ``zoo eval`` is refused as the user's own (naming the module), not as a recipe
    that no longer resolves in this version."""
    import zoo
    from zoo.reevaluate import checkpoint_recipe

    name = f"no_such_module_{int(torch.randint(10**6, ()))}"
    with pytest.raises(zoo.UserError) as err:
        checkpoint_recipe("run/checkpoint.pt", lm_recipe().plain, [name])
    assert name in str(err.value) and "does not resolve here" not in str(err.value)
