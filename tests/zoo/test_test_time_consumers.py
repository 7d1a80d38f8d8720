"""A recipe's ``eval.test_time`` reaches every consumer of a trained language model, as it reaches the tables'
numbers (``zoo.training.evaluation``, ``zoo eval``): ``zoo generate`` (:func:`zoo.generate.load_lm`), the
lm-evaluation-harness adapter (:class:`zoo.lm_harness.ZooScorer` and the registered ``zoo`` model) and
``zoo export`` (the knobs stored in ``config.json``, so ``from_pretrained`` gives the zoo model's logits under
``model.test_time(recipe.eval.test_time)``). Each consumer's override (``--test-time KNOB=VALUE``,
``test_time.KNOB=VALUE`` in ``--model_args``) moves it, and a knob no layer declares, or a value the option
refuses, is refused in one line naming the knob and the layers that declare knobs.

The checkpoint is a tiny model with two knob-declaring layers (GKA's ``num_iter``, trained at 4; SKA's
``power``, trained at its default 2) and a GLA layer, every weight random and nonzero; its recipe evaluates
with ``num_iter: 1, power: 0``, which the tests first check changes the logits measurably. Nothing downloads."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import zoo
from mixers import MIXERS
from tests.zoo.untrained import wake_zero_initialised
from zoo.cli import main as zoo_main
from zoo.generate import generate_ids, load_lm
from zoo.lm_harness import ZooScorer
from zoo.tasks import Task
from zoo.training import checkpoint as ckpt

EOS = 256
#: the recipe's eval.test_time: both away from the options the model trained with (num_iter 4, power 2)
KNOBS = {"num_iter": 1, "power": 0}
#: GKA trains with 4 Chebyshev iterations (few, so that the tests run fast), SKA with its default power 2
GKA = {**MIXERS.get("gka").contract_options, "num_iter": 4}
LAYERS = [{"gka": GKA}, {"ska": dict(MIXERS.get("ska").contract_options)}, "gla"]
PAIRS = [("the key", " decays"), ("", "state"), ("a gate", " opens and the scan reads it")]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def lm_recipe(test_time=None, layers=None, **extra):
    return zoo.load({"model": {"d_model": 16, "layers": layers or LAYERS},
                     "task": {"name": "lm", "seq_len": 16},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0},
                     "eval": {"test_time": dict(KNOBS if test_time is None else test_time)}, **extra})


def write_run(folder, recipe, name="run"):
    """``(run folder, the zoo model it holds, in eval mode)``: a checkpoint as ``zoo train --out`` writes it."""
    model = wake_zero_initialised(zoo.build_model(recipe))
    run = folder / name
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                    "model": model.state_dict(), "step": 1, "finished": True})
    return str(run), model.eval()


@torch.no_grad()
def logits(model, ids, values=None):
    """``model``'s logits of ``ids``, under the test-time ``values`` where given."""
    if values is None:
        return model(ids)
    with model.test_time(values):
        return model(ids)


def greedy(model, prompt, values, n=6):
    with model.test_time(values):
        return generate_ids(model, prompt, max_new_tokens=n, eos_id=EOS)[0]


def far(a, b) -> float:
    return float((a - b).abs().max())


@pytest.fixture
def run(tmp_path):
    recipe = lm_recipe()
    folder, model = write_run(tmp_path, recipe)
    ids = torch.randint(0, 257, (2, 24))
    trained_as = logits(model, ids)
    for knob, value in KNOBS.items():  # each knob alone changes the logits: a consumer that drops one is seen
        assert far(logits(model, ids, {knob: value}), trained_as) > 1e-3, knob
    return folder, model, recipe, ids


def one_line_error(capsys, *argv) -> str:
    assert zoo_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo: error: ") and "Traceback" not in err
    return err


def assert_names_the_knobs(message: str, knob: str) -> None:
    assert repr(knob) in message or f"{knob}=" in message, message
    assert "num_iter (gka)" in message and "power (ska)" in message, message


# --------------------------------------------------------------------------------------- zoo generate
def test_generate_loads_the_model_under_the_recipes_test_time(run, tmp_path, capsys):
    folder, model, _recipe, ids = run
    ours, _task = load_lm(folder)
    expected = logits(model, ids, KNOBS)
    assert far(expected, logits(model, ids)) > 1e-3
    assert far(logits(ours, ids), expected) <= 1e-6
    prompt = [5, 80, 33]
    assert generate_ids(ours, prompt, max_new_tokens=6, eos_id=EOS)[0] == greedy(model, prompt, KNOBS)
    capsys.readouterr()
    assert zoo_main(["generate", folder, "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "test-time knobs num_iter=1, power=0 (the recipe's eval.test_time" in captured.err
    tok = Task.from_spec(_recipe.task).tokenizer
    new = greedy(model, tok.encode("ab"), KNOBS, n=4)
    text = tok.decode([i for i in new if i != EOS]).decode("utf-8", errors="replace")
    assert captured.out.startswith("ab" + text + "\n")


def test_generate_test_time_overrides_one_knob_over_the_recipes(run, capsys):
    folder, model, _recipe, ids = run
    ours, _ = load_lm(folder, test_time=["num_iter=2"])
    assert far(logits(ours, ids), logits(model, ids, {"num_iter": 2, "power": 0})) <= 1e-6
    assert far(logits(ours, ids), logits(model, ids, KNOBS)) > 1e-4
    ours, _ = load_lm(folder, test_time={"power": 1})
    assert far(logits(ours, ids), logits(model, ids, {"num_iter": 1, "power": 1})) <= 1e-6
    capsys.readouterr()
    assert zoo_main(["generate", folder, "--prompt", "ab", "--max-new-tokens", "2", "--temperature", "0",
                     "--test-time", "num_iter=2", "--test-time", "power=2"]) == 0
    assert "test-time knobs num_iter=2, power=2 (the recipe's eval.test_time and --test-time)" in capsys.readouterr().err


def test_generate_refuses_a_knob_no_layer_declares_and_a_value_the_option_refuses(run, tmp_path, capsys):
    folder = run[0]
    err = one_line_error(capsys, "generate", folder, "--test-time", "num_iters=2")
    assert "zoo generate: --test-time num_iters=2: no layer of this model declares a test-time knob" in err
    assert_names_the_knobs(err, "num_iters")
    assert "did you mean 'num_iter'" in err
    err = one_line_error(capsys, "generate", folder, "--test-time", "num_iter=-1")
    assert "--test-time num_iter=-1: -1 is not a valid num_iter for gka" in err and ">= 0" in err
    err = one_line_error(capsys, "generate", folder, "--test-time", "power=two")
    assert "'two' is not a valid power for ska" in err
    err = one_line_error(capsys, "generate", folder, "--test-time", "num_iter")
    assert "--test-time num_iter: expected KNOB=VALUE" in err
    with pytest.raises(zoo.UserError, match="no layer of this model declares a test-time knob 'rank'"):
        load_lm(folder, test_time={"rank": 2})  # an option, but not a test-time knob
    plain, _ = write_run(tmp_path, lm_recipe({}, layers=["gla"]), "plain")
    err = one_line_error(capsys, "generate", plain, "--test-time", "num_iter=1")
    assert "'num_iter'" in err and "none of its layers (gla) declares a test-time knob" in err


# --------------------------------------------------------------------------------------- the harness adapter
def expected_scores(model, task, values):
    """The adapter's log-likelihoods computed on the zoo model under ``values`` (None: as it trained)."""
    scorer = ZooScorer(model, task)
    if values is None:
        return [scorer.loglikelihood(*pair) for pair in PAIRS]
    with model.test_time(values):
        return [scorer.loglikelihood(*pair) for pair in PAIRS]


def assert_scores(got, want):
    for (ll, greedy_ok), (want_ll, want_greedy) in zip(got, want, strict=True):
        assert ll == pytest.approx(want_ll, rel=1e-6, abs=1e-6) and greedy_ok == want_greedy


def test_the_harness_adapter_scores_under_the_recipes_test_time(run):
    folder, model, recipe, _ids = run
    task = Task.from_spec(recipe.task)
    want, trained_as = expected_scores(model, task, KNOBS), expected_scores(model, task, None)
    assert max(abs(a[0] - b[0]) for a, b in zip(want, trained_as)) > 1e-3
    scorer = ZooScorer.from_checkpoint(folder)
    assert_scores([scorer.loglikelihood(*pair) for pair in PAIRS], want)
    rolled = scorer.loglikelihood_rolling("the scan")
    with model.test_time(KNOBS):
        assert rolled == pytest.approx(ZooScorer(model, task).loglikelihood_rolling("the scan"), rel=1e-6, abs=1e-6)
    over = ZooScorer.from_checkpoint(folder, test_time={"num_iter": 2})
    assert_scores([over.loglikelihood(*pair) for pair in PAIRS], expected_scores(model, task, {**KNOBS, "num_iter": 2}))
    with pytest.raises(zoo.UserError, match="test_time power=-1: -1 is not a valid power for ska"):
        ZooScorer.from_checkpoint(folder, test_time={"power": -1})


def test_the_registered_harness_model_takes_test_time_from_its_model_args(run):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from zoo.lm_harness import register

    folder, model, recipe, _ids = run
    task = Task.from_spec(recipe.task)
    register()
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    harness = get_model("zoo").create_from_arg_string(f"checkpoint={folder}", {"device": "cpu"})
    assert_scores(harness.loglikelihood(requests), expected_scores(model, task, KNOBS))
    harness = get_model("zoo").create_from_arg_string(f"checkpoint={folder},test_time.num_iter=2,test_time.power=1",
                                                      {"device": "cpu", "batch_size": 1})
    assert_scores(harness.loglikelihood(requests), expected_scores(model, task, {"num_iter": 2, "power": 1}))
    with pytest.raises(zoo.UserError, match="model_args test_time.solver=.*no layer of this model declares") as err:
        get_model("zoo").create_from_arg_string(f"checkpoint={folder},test_time.solver=3")
    assert_names_the_knobs(str(err.value), "solver")
    with pytest.raises(zoo.UserError, match="write each knob as test_time.KNOB=VALUE"):
        get_model("zoo").create_from_arg_string(f"checkpoint={folder},test_time=3")


# --------------------------------------------------------------------------------------- zoo export
def test_the_export_stores_the_recipes_test_time_and_loads_back_to_the_same_logits(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    import zoo.hf  # noqa: F401  (registers the model type with the Auto classes)

    folder, model, recipe, ids = run
    assert zoo_main(["export", folder, "--to", str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expected = logits(model, ids, KNOBS)
    with torch.no_grad():
        got = theirs(ids).logits
    assert far(got, expected) <= 1e-5 and far(got, logits(model, ids)) > 1e-3
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["test_time"] == KNOBS and config["recipe"] == recipe.plain  # the recipe as it trained, its key
    assert "`num_iter=1`, `power=0`" in (tmp_path / "hf" / "README.md").read_text()
    assert "test-time knobs num_iter=1, power=0" in said
    prompt = [5, 80, 33]
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)  # prefill, then step
    assert out[0, len(prompt):].tolist() == greedy(model, prompt, KNOBS)
    theirs.train()  # training computes with the options, as the zoo's training does
    with torch.no_grad():
        assert far(theirs(ids).logits, logits(model.train(), ids)) <= 1e-5
    model.eval()

    # an export written before config.test_time existed computes with the recipe's eval.test_time
    del config["test_time"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert far(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits, expected) <= 1e-5
    # a hand-edited knob is checked as the recipe's are
    config["test_time"] = {"num_iter": -2}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.test_time.num_iter=-2: -2 is not a valid num_iter for gka"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    config["test_time"] = {"iterations": 5}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no layer of this model declares a test-time knob 'iterations'") as err:
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_names_the_knobs(str(err.value), "iterations")


def test_the_harness_hf_model_on_the_export_scores_as_the_adapter_does(run, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import zoo.hf  # noqa: F401

    folder, model, recipe, _ids = run
    assert zoo_main(["export", folder, "--to", str(tmp_path / "hf")]) == 0
    harness = get_model("hf").create_from_arg_string(f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu,"
                                                     f"batch_size=1")
    got = harness.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)],
                                disable_tqdm=True)
    want = expected_scores(model, Task.from_spec(recipe.task), KNOBS)
    for (ll, greedy_ok), (want_ll, want_greedy) in zip(got, want, strict=True):
        assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-5) and greedy_ok == want_greedy


def test_export_test_time_overrides_a_knob_and_refuses_a_bad_one_writing_nothing(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    import zoo.hf  # noqa: F401

    folder, model, _recipe, ids = run
    assert zoo_main(["export", folder, "--to", str(tmp_path / "hf"), "--test-time", "power=1"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.test_time == {"num_iter": 1, "power": 1}
    with torch.no_grad():
        got = loaded(ids).logits
    assert far(got, logits(model, ids, {"num_iter": 1, "power": 1})) <= 1e-5 and far(got, logits(model, ids, KNOBS)) > 1e-4
    assert "set at export" in (tmp_path / "hf" / "README.md").read_text()
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()
    err = one_line_error(capsys, "export", folder, "--to", tmp_path / "bad", "--test-time", "powers=1")
    assert "zoo export: --test-time powers=1: no layer of this model declares a test-time knob" in err
    assert_names_the_knobs(err, "powers")
    err = one_line_error(capsys, "export", folder, "--to", tmp_path / "bad", "--test-time", "num_iter=2.5")
    assert "2.5 is not a valid num_iter for gka" in err
    assert sorted(os.listdir(tmp_path)) == before


def test_a_grid_knob_that_reaches_a_cell_without_it_changes_nothing_anywhere(tmp_path):
    """A grid's ``eval.test_time`` reaches every cell; a cell whose layers do not declare the knob is evaluated as
    it trained, and so are its generation, scoring and export."""
    from transformers import AutoModelForCausalLM

    import zoo.hf  # noqa: F401

    grid = lm_recipe(layers=[{"gka": GKA}], test_time={"num_iter": 1},
                     grid=[{"label": "gka"}, {"label": "gla", "model.layers": ["gla"]}])
    cell = next(c.recipe for c in grid.cells if c.label == "gla")
    assert cell.eval.test_time == {"num_iter": 1}
    folder, model = write_run(tmp_path, cell)
    ids = torch.randint(0, 257, (1, 12))
    ours, _ = load_lm(folder)
    assert far(logits(ours, ids), logits(model, ids)) <= 1e-6
    assert zoo_main(["export", folder, "--to", str(tmp_path / "hf")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.test_time == {}
    with torch.no_grad():
        assert far(loaded(ids).logits, logits(model, ids)) <= 1e-5
    assert F.log_softmax(loaded(ids).logits, -1).isfinite().all()
