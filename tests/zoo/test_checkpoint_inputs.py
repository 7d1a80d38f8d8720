"""Checkpoints that no longer fit what the current code builds from them, evaluation lengths the prepared data
cannot hold, and the smallest generation budget: each is refused in one line naming the problem before any work
(or answered exactly), never a traceback after the work is done."""
from __future__ import annotations

import copy

import pytest
import torch

import zoo
from tests.zoo.local_tokenizer import bpe_tokenizer
from tests.zoo.test_lm import random_corpus
from tests.zoo.untrained import wake_zero_initialised
from zoo.cli import main as zoo_main
from zoo.errors import UserError
from zoo.generate import generate_ids
from zoo.training import checkpoint as ckpt
from zoo.training import loop


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def one_line_error(capsys, *argv) -> str:
    assert zoo_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo: error: ") and "Traceback" not in err, err
    return err


def lm_recipe(tmp_path, tokenizer="bytes", steps=2, seq_lens=(32,)):
    corpus = tmp_path / "corpus" if (tmp_path / "corpus").exists() else random_corpus(tmp_path / "corpus")
    return zoo.load({"model": {"d_model": 16, "layers": ["gla"], "mixer_options": {"gla": {"n_heads": 2, "head_dim": 8}}},
                     "task": {"name": "lm", "source": "files", "path": str(corpus / "*.txt"), "doc_separator": "\n\n",
                              "val_fraction": 0.2, "seq_len": 16, "num_test": 4, "tokenizer": tokenizer,
                              "data_dir": str(tmp_path / "data")},
                     "train": {"steps": steps, "batch_size": 4, "warmup_steps": 0, "threads": 1, "checkpoint_every": 1},
                     "eval": {"batch_size": 8, "seq_lens": list(seq_lens)}})


def test_a_tokenizer_whose_vocabulary_changed_since_training_is_named_by_eval_and_by_a_resumed_run(tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer.json"
    bpe_tokenizer(tokenizer)
    recipe = lm_recipe(tmp_path, str(tokenizer), steps=3)
    run = tmp_path / "run"
    zoo.train(recipe, progress=False, checkpoint_dir=run)
    trained_rows = ckpt.load(run / ckpt.FILENAME)["model"]["embed.weight"].shape[0]
    # the same file name now holds a tokenizer with another vocabulary (fewer distinct merges to learn)
    letters = "".join(chr(97 + int(i)) for i in torch.randperm(26)[:3])
    now = bpe_tokenizer(tokenizer, text=f"{letters} {letters[::-1]} " * 10).vocab_size
    assert now != trained_rows
    for argv in (["eval", run], ["generate", run, "--prompt", "ab"], ["export", run, "--to", tmp_path / "hf"]):
        err = one_line_error(capsys, *argv)
        assert f"vocabulary of {trained_rows} tokens" in err and f"now has {now}" in err, err
    assert not (tmp_path / "hf").exists()
    before = ckpt.load(run / ckpt.FILENAME)
    with pytest.raises(UserError, match=f"vocabulary of {trained_rows} tokens .* now has {now}.*another folder"):
        zoo.train(recipe, progress=False, checkpoint_dir=run)  # the same recipe, resumed in its folder
    after = ckpt.load(run / ckpt.FILENAME)  # refused, not moved aside or overwritten
    assert after["step"] == before["step"] and torch.equal(after["model"]["embed.weight"], before["model"]["embed.weight"])


def test_a_checkpoint_whose_recipe_no_longer_resolves_is_named_as_the_culprit(tmp_path, capsys):
    recipe = lm_recipe(tmp_path)
    model = wake_zero_initialised(zoo.build_model(recipe))
    plain = copy.deepcopy(recipe.plain)
    option = f"retired_option_{int(torch.randint(1000, ()))}"
    plain["model"]["mixer_options"] = {"gla": {option: 3}}  # as an option since removed from the mixer
    run = tmp_path / "run"
    ckpt.save(run / ckpt.FILENAME, {"recipe": plain, "recipe_key": recipe.key, "imports": [], "step": 2,
                                    "model": model.state_dict(), "finished": True})
    for argv in (["eval", run], ["generate", run], ["export", run, "--to", tmp_path / "hf"]):
        err = one_line_error(capsys, *argv)
        assert str(run / ckpt.FILENAME) in err and option in err and "another mixer-zoo version" in err, err


def test_an_evaluation_length_the_prepared_validation_split_cannot_hold_is_refused_before_any_step(tmp_path, monkeypatch):
    """Validation cannot check eval.seq_lens against a text task's data until training has prepared it; the run
    must refuse then, not train to its end and fail at its evaluation with its last steps never saved."""
    steps = []
    real_step = loop._step
    monkeypatch.setattr(loop, "_step", lambda *args: steps.append(1) or real_step(*args))
    too_long = 200_000 + int(torch.randint(1000, ()))
    recipe = lm_recipe(tmp_path, steps=4, seq_lens=(32, too_long))
    with pytest.raises(UserError, match=f"eval.seq_lens: .*{too_long} \\+ 1"):
        zoo.train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    assert steps == [] and not (tmp_path / "run" / ckpt.FILENAME).exists()
    # the lengths the split holds still train and evaluate
    result = zoo.train(lm_recipe(tmp_path, steps=2, seq_lens=(32,)), progress=False)
    assert result.metrics["val_bpb@32"] > 0


def test_generation_takes_at_most_max_new_tokens_greedy_as_argmax_of_full_forwards():
    from mixers import MIXERS
    from mixers.options import build_options
    from zoo.config import Spec
    from zoo.model import HybridLM
    cls = MIXERS.get("gla")
    model = HybridLM([Spec("gla", build_options(cls.Options, dict(cls.contract_options), ""))], 40, 16)
    model = wake_zero_initialised(model.double().eval())
    prompt = torch.randint(0, 40, (int(torch.randint(1, 8, ())),)).tolist()
    assert generate_ids(model, prompt, 0)[0] == []
    budget = int(torch.randint(1, 6, ()))
    out, _, _ = generate_ids(model, prompt, budget)  # no EOS: exactly the budget
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(budget):  # the argmax of a full forward over everything so far, token by token
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_an_exported_ablation_cell_carries_its_rows_metrics_in_its_readme(tmp_path):
    """A cell's checkpoint lives in ``<out>/checkpoints/<key>/``, its row in ``<out>/results.jsonl``."""
    import yaml
    base = lm_recipe(tmp_path)
    plain = {k: base.plain[k] for k in ("model", "task", "train", "eval")}
    plain["model"] = {"d_model": 16, "layers": ["gla"], "mixer_options": {"gla": {"n_heads": 2, "head_dim": 8}}}
    plain["grid"] = [{"label": "gla", "model.d_model": 16}]
    (tmp_path / "ablation.yaml").write_text(yaml.safe_dump(plain))
    out = tmp_path / "out"
    assert zoo_main(["ablate", str(tmp_path / "ablation.yaml"), "--out", str(out), "--no-plot"]) == 0
    from zoo.rows import read_rows
    (row,) = read_rows(out / "results.jsonl")
    cell = out / "checkpoints" / row["recipe_key"]
    assert (cell / ckpt.FILENAME).exists()
    assert zoo_main(["export", str(cell), "--to", str(tmp_path / "hf")]) == 0
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert f"val_bpb {row['metrics']['val_bpb']:.4g}" in readme and "no `results.jsonl` row" not in readme
