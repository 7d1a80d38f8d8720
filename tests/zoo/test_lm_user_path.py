"""The README's path for a language model on your own text, run as written: its ``my_lm.yaml`` recipe (a glob of
local files cut into documents, byte tokenizer) checked, trained and evaluated through the command line, then
decoded (greedy equal to an argmax loop over the forward pass, sampling fixed by its seed), exported and loaded
with transformers (the same logits, the same greedy tokens). Also the README's notes on that path: ``zoo check``
tokenises a local source into ``task.data_dir``, and the checkpoint reads its tokenizer file again, refusing
one whose vocabulary changed. Tiny models on a corpus written here; nothing downloads."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

import zoo
from zoo.cli import main as zoo_main
from zoo.errors import UserError
from zoo.generate import generate_text, load_lm
from zoo.training import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
#: overrides that make the README's recipe a model of a few thousand parameters trained for a few steps
TINY = ["model.d_model=16", "task.seq_len=16", "task.num_test=4", "train.steps=3", "train.warmup_steps=0",
        "train.batch_size=2", "train.threads=1", "eval.batch_size=4", "eval.seq_lens=[32]"]
#: two greedy decodes of one model may part where its two most likely tokens are this close (rounding)
GREEDY_TIE = 1e-5
WORDS = "the state of a mixer keeps keys and values while the gate decays and the query reads".split()


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "default-data"))


def readme_recipe(tmp_path: Path) -> Path:
    """The README's ``my_lm.yaml``, its placeholders pointed at this checkout and a corpus written here: 150
    documents of random words in three files, separated as the recipe separates them."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```yaml\n(# my_lm\.yaml\n.*?)```", text, re.S)
    assert found, "the README's language-model section shows the my_lm.yaml recipe"
    corpus = tmp_path / "notes"
    corpus.mkdir()
    for f in range(3):
        docs = [" ".join(random.choice(WORDS) for _ in range(random.randint(20, 60))) for _ in range(50)]
        (corpus / f"part{f}.txt").write_text("\n\n\n".join(docs))
    recipe = found.group(1).replace("/path/to/mixer-zoo", str(ROOT)).replace("/data/notes/**/*.txt",
                                                                              f"{corpus}/**/*.txt")
    assert str(corpus) in recipe and str(ROOT) in recipe, "the recipe's placeholders are as the test expects"
    path = tmp_path / "my_lm.yaml"
    path.write_text(recipe)
    return path


def trained_run(tmp_path: Path) -> tuple[Path, Path]:
    recipe = readme_recipe(tmp_path)
    data = tmp_path / "data"
    run = tmp_path / "runs" / "notes"
    assert zoo_main(["data", "prepare", str(recipe), *TINY, f"task.data_dir={data}", "--workers", "1",
                     "--no-progress"]) == 0
    assert zoo_main(["train", str(recipe), *TINY, f"task.data_dir={data}", "--out", str(run), "--no-progress"]) == 0
    return run, data


def argmax_loop(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` greedy tokens by running the whole forward pass again after each one, with each step's logits."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids]))[0, -1]
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt):], logits


def assert_greedy(got: list[int], expected: list[int], logits: list[torch.Tensor]) -> None:
    """``got`` is ``expected`` up to where they part, and they part only at a near-tie of the reference logits."""
    for t, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            assert float(logits[t].max() - logits[t][a]) <= GREEDY_TIE, (t, got, expected)
            return
    assert got == expected[:len(got)], (got, expected)


def test_the_readme_recipe_on_local_files_trains_evaluates_and_decodes(tmp_path):
    run, data = trained_run(tmp_path)
    meta = [json.loads(p.read_text()) for p in data.glob("*/meta.json")]
    assert len(meta) == 1 and meta[0]["tokenizer"] == "bytes" and meta[0]["documents"]["val"] >= 1
    row = json.loads((run / "results.jsonl").read_text().splitlines()[-1])
    metrics = row["metrics"]
    # byte tokens: bits per byte are the validation loss in nats over ln 2
    assert metrics["val_bpb"] == pytest.approx(metrics["test_loss"] / math.log(2), rel=1e-6)
    assert "val_bpb@32" in metrics
    assert zoo_main(["eval", str(run), "eval.seq_lens=[48]"]) == 0
    assert "val_bpb@48" in json.loads((run / "results.jsonl").read_text().splitlines()[-1])["metrics"]

    model, task = load_lm(run)
    prompt = "the gate"
    greedy = generate_text(model, task, prompt, max_new_tokens=12, temperature=0.0)
    expected, logits = argmax_loop(model, task.tokenizer.encode(prompt), len(greedy.ids))
    assert_greedy(greedy.ids, expected, logits)
    seed = random.randrange(2**31)
    first, again = (generate_text(model, task, prompt, 12, temperature=1.0, seed=seed) for _ in range(2))
    assert first.ids == again.ids


def test_the_readme_export_loads_in_transformers_with_the_zoo_logits(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo.hf  # noqa: F401  (the README's first line: registers the model type)

    run, _data = trained_run(tmp_path)
    exported = tmp_path / "exported" / "notes"
    assert zoo_main(["export", str(run), "--to", str(exported)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(exported), trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(str(exported))
    ours, task = load_lm(run)
    ids = torch.randint(0, task.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    prompt = "the query"
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == task.tokenizer.encode(prompt)
    out = hf.generate(**enc, max_new_tokens=10, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    expected, logits = argmax_loop(ours, task.tokenizer.encode(prompt), 10)
    assert_greedy(out, expected, logits)


def test_zoo_check_of_a_language_model_recipe_tokenises_its_local_source(tmp_path):
    recipe = readme_recipe(tmp_path)
    data = tmp_path / "checked"
    assert zoo_main(["check", str(recipe), *TINY, f"task.data_dir={data}"]) == 0
    assert [p.parent.name.split("-")[0] for p in data.glob("*/meta.json")] == ["files"]


def test_a_checkpoint_reads_its_tokenizer_file_again_and_refuses_a_new_vocabulary(tmp_path):
    pytest.importorskip("tokenizers")

    tok_file = tmp_path / "tok.json"
    _byte_level_bpe(tok_file, WORDS, 270)
    run = _untrained_run(tmp_path / "run", tok_file)
    model, task = load_lm(run)
    assert task.tokenizer.name == str(tok_file) and model.embed.weight.shape[0] == task.vocab_size
    vocab = task.vocab_size
    _byte_level_bpe(tok_file, WORDS, vocab + 20)
    with pytest.raises(UserError, match=f"vocabulary of {vocab} tokens"):
        load_lm(run)


def test_a_tokenizer_file_replaced_by_one_of_the_same_size_is_refused(tmp_path, capsys):
    """A checkpoint records its tokenizer's contents: a file replaced under the same path by another tokenizer of
    the same vocabulary size (which the weights would read without complaint, as other tokens) is refused by
    generation, export, evaluation and a resumed run alike, and the original file put back is taken again."""
    pytest.importorskip("tokenizers")

    tok_file, size = tmp_path / "tok.json", int(torch.randint(262, 275, ()))
    _byte_level_bpe(tok_file, WORDS, size)
    original = tok_file.read_bytes()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(random.choice(WORDS) for _ in range(60)) for _ in range(12)))
    recipe = zoo.load({"model": {"d_model": 16, "layers": ["attention"]},
                       "task": {"name": "lm", "seq_len": 16, "num_test": 2, "tokenizer": str(tok_file),
                                "source": "files", "path": str(corpus), "doc_separator": "\n\n",
                                "val_fraction": 0.3, "data_dir": str(tmp_path / "data")},
                       "train": {"steps": 2, "batch_size": 2, "warmup_steps": 0, "threads": 1},
                       "eval": {"batch_size": 2}})
    run = tmp_path / "run"
    zoo.train(recipe, progress=False, checkpoint_dir=run)
    assert ckpt.load(ckpt.path_in(run))["tokenizer_fingerprint"]
    _byte_level_bpe(tok_file, [w[::-1].upper() for w in WORDS], size)      # other merges, the same number of tokens
    assert tok_file.read_bytes() != original
    for use in (lambda: load_lm(run), lambda: zoo.evaluate(run)):
        with pytest.raises(UserError, match="has other contents than the one it was trained with"):
            use()
    assert zoo_main(["export", str(run), "--to", str(tmp_path / "hf")]) == 2 and not (tmp_path / "hf").exists()
    assert "has other contents than the one it was trained with" in capsys.readouterr().err
    with pytest.raises(UserError, match="has other contents than the one it was trained with"):   # nor resumed
        zoo.train(recipe, progress=False, checkpoint_dir=run)
    tok_file.write_bytes(original)
    model, task = load_lm(run)
    assert model.embed.weight.shape[0] == task.vocab_size == size


def test_a_missing_tokenizer_file_is_named_without_asking_the_hub(tmp_path, monkeypatch):
    """A tokenizer named by a path that is not there (a relative path run from another folder) is refused as a
    missing file, naming the folder it was read from; it was looked up on the Hub (retries, then a Hub error)."""
    tokenizers = pytest.importorskip("tokenizers")
    from zoo.data.tokenize import make_tokenizer

    def no_hub(*args, **kwargs):
        raise AssertionError("a path was looked up on the Hub")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    for name in (f"tok_{random.randrange(10**6)}.json", "./sub/tokenizer.json", str(tmp_path / "gone.json")):
        with pytest.raises(UserError, match=rf"no such file \(a relative path is read from the current folder, "
                                            rf"{re.escape(str(tmp_path))}\)"):
            make_tokenizer(name)


def test_generation_takes_the_checkpoints_tokenizer_file_under_another_spelling(tmp_path, monkeypatch):
    """``--tokenizer`` naming the checkpoint's own tokenizer file by another path (relative instead of absolute) is
    the same tokenizer; another file is refused."""
    pytest.importorskip("tokenizers")
    from zoo.generate import read_lm

    tok_file = tmp_path / "tok.json"
    bpe_like = tmp_path / "other.json"
    _byte_level_bpe(tok_file, WORDS)
    _byte_level_bpe(bpe_like, [w.upper() for w in WORDS])
    run = _untrained_run(tmp_path / "run", tok_file)
    monkeypatch.chdir(tmp_path)
    assert read_lm(run, tokenizer="tok.json")[3].tokenizer.name == str(tok_file)
    with pytest.raises(UserError, match="not 'other.json'; generate with the checkpoint's own tokenizer"):
        read_lm(run, tokenizer="other.json")


def _untrained_run(run: Path, tok_file: Path) -> Path:
    """A run folder holding the untrained checkpoint of a one-layer language model reading ``tok_file``."""
    recipe = zoo.load({"model": {"d_model": 16, "layers": ["attention"]},
                       "task": {"name": "lm", "seq_len": 16, "tokenizer": str(tok_file)},
                       "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                    "model": zoo.build_model(recipe).state_dict(), "step": 1, "finished": True})
    return run


def _byte_level_bpe(path: Path, words: list[str], size: int = 266) -> None:
    """A byte-level BPE tokenizer of ``size`` tokens trained on a text of ``words``, saved at ``path``."""
    import tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    text = " ".join(random.choice(words) for _ in range(400))
    model.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    model.save(str(path))
