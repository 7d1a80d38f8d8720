"""``zoo eval`` and ``zoo.evaluate`` of language-model runs: the evaluation without overrides repeats the run's own
numbers; a test-time change that would read the trained weights with other token ids (another tokenizer of the same
size) is refused in one line, with no row written; and a checkpoint whose recipe names its files by relative paths,
read from another folder, is refused saying so and where to run it, not blamed on another mixer-zoo version."""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from tests.zoo.local_tokenizer import bpe_tokenizer
from tests.zoo.test_checkpoint_inputs import lm_recipe, one_line_error
from zoo.cli import main as zoo_main
from zoo.errors import UserError


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _random_text() -> str:
    """Sentences of fresh random words, enough distinct pairs for a BPE tokenizer to reach its full size."""
    letters = torch.randint(0, 26, (600, 3)).tolist()
    return " ".join("".join(chr(97 + c) for c in word) for word in letters)


@pytest.fixture
def lm_run(tmp_path):
    """``(result, run folder, path of another tokenizer of the trained one's size)`` of a two-step language model."""
    trained_with = bpe_tokenizer(tmp_path / "trained.json", text=_random_text())
    other = bpe_tokenizer(tmp_path / "other.json", text=_random_text())
    assert other.vocab_size == trained_with.vocab_size and other.fingerprint() != trained_with.fingerprint()
    run = tmp_path / "run"
    result = zoo.train(lm_recipe(tmp_path, str(tmp_path / "trained.json"), steps=2), progress=False,
                       checkpoint_dir=run)
    return result, run, tmp_path / "other.json"


def test_zoo_eval_refuses_another_tokenizer_of_the_same_size_naming_the_override(lm_run, capsys):
    result, run, other = lm_run
    assert zoo_main(["eval", str(run), "--json"]) == 0  # the same tokenizer: the run's own number again
    assert json.loads(capsys.readouterr().out)["metrics"]["val_bpb"] == result.metrics["val_bpb"]
    rows = (run / "results.jsonl").read_text()
    err = one_line_error(capsys, "eval", run, f"task.tokenizer={other}")
    assert "task.tokenizer" in err and repr(str(run.parent / "trained.json")) in err, err
    assert "replaced under the same name" not in err, err  # the file at the trained path is unchanged
    assert (run / "results.jsonl").read_text() == rows


def test_evaluate_of_a_train_result_refuses_another_tokenizer_instead_of_reading_its_ids(lm_run):
    result, _run, other = lm_run
    assert zoo.evaluate(result)["val_bpb"] == result.metrics["val_bpb"]
    with pytest.raises(UserError, match="task.tokenizer"):
        zoo.evaluate(result, [f"task.tokenizer={other}"])


def test_a_checkpoint_naming_its_corpus_by_a_relative_path_read_from_another_folder_says_where_to_run(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recipe = zoo.load(lm_recipe(tmp_path), ["task.path=corpus/*.txt", "task.data_dir=data"])
    result = zoo.train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    err = one_line_error(capsys, "eval", tmp_path / "run")
    assert "task.path=corpus/*.txt" in err and str(elsewhere) in err and "run it from the folder" in err, err
    assert "another mixer-zoo version" not in err, err  # the code is the same: only the folder differs
    assert not (tmp_path / "run" / "results.jsonl").exists()
    monkeypatch.chdir(tmp_path)  # from where it was trained: the run's own number again
    assert zoo.evaluate(tmp_path / "run")["val_bpb"] == result.metrics["val_bpb"]
