"""The language-model task: data preparation, windows, tokenizers, bits per byte, generation, the
lm-evaluation-harness adapter, the training options it brought (token budget, gradient accumulation)
and the one-line refusals of bad input."""
from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

import zoo
from mixers import MIXERS
from mixers.options import build_options
from tests.zoo.local_tokenizer import TEXT, bpe_tokenizer
from tests.zoo.preparation import EOS, check_deterministic_and_resumable, split_documents
from tests.zoo.untrained import wake_zero_initialised
from zoo.benchmark import loader
from zoo.cli import main as zoo_main
from zoo.config import Spec
from zoo.data import prepare as prep
from zoo.data import sources
from zoo.data.tokenize import ByteTokenizer, HFTokenizer
from zoo.data.windows import fixed_starts
from zoo.errors import UserError
from zoo.experiments.results import table_columns
from zoo.generate import generate_ids
from zoo.lm_harness import ZooScorer
from zoo.model import HybridLM
from zoo.recipes.plain import recipe_mapping
from zoo.tasks import TaskData
from zoo.tasks.lm import LanguageModeling
from zoo.training import loop
from zoo.training.evaluation import text_metrics


def random_corpus(folder, n_files=6, seed=None):
    """Text files of random words (some paragraphs repeated across files), one document per paragraph."""
    rng = np.random.default_rng(seed if seed is not None else int(torch.randint(1 << 30, ())))
    words = ["state", "mixer", "token", "decay", "gate", "key", "value", "query", "chunk", "scan", "π", "é"]
    shared = " ".join(rng.choice(words, 30))
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        paragraphs = [" ".join(rng.choice(words, int(rng.integers(20, 80)))) for _ in range(int(rng.integers(8, 16)))]
        paragraphs.insert(int(rng.integers(len(paragraphs))), shared)
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))
    (folder / "binary.txt").write_bytes(b"bytes that are not UTF-8: \xff\xfe\xc3 " * 40)  # never a crash
    return folder


def options(tmp_path, corpus=None, **extra):
    if corpus is None:  # one corpus per test
        corpus = tmp_path / "corpus" if (tmp_path / "corpus").exists() else random_corpus(tmp_path / "corpus")
    values = {"source": "files", "path": str(corpus / "*.txt"),
              "doc_separator": "\n\n", "val_fraction": 0.2, "seq_len": 16, "num_test": 8,
              "data_dir": str(tmp_path / "data"), **extra}
    return build_options(LanguageModeling.Options, values, "")


# ------------------------------------------------------------------------------------------ windows and splits
def test_the_same_seed_draws_the_same_windows_and_each_is_a_slice_of_the_training_tokens(tmp_path):
    task = LanguageModeling(options(tmp_path))
    stream = task.train_data(0)
    seed = int(torch.randint(1 << 30, ()))
    a = stream.draw(6, torch.Generator().manual_seed(seed))
    b = task.train_data(1).draw(6, torch.Generator().manual_seed(seed))
    c = stream.draw(6, torch.Generator().manual_seed(seed + 1))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, c.inputs)
    assert torch.equal(a.inputs[:, 1:], a.labels[:, :-1])  # labels are the next tokens
    flat = np.fromfile(task.folder / "train.bin", dtype=np.uint16).astype(np.int64)
    text = flat.tobytes()
    for row in torch.cat([a.inputs, a.labels[:, -1:]], 1):
        assert row.numpy().astype(np.int64).tobytes() in text


def test_validation_windows_are_disjoint_and_spread_over_the_whole_split():
    """``fixed_starts`` reads ``min(fit, limit)`` of the split's ``fit`` back-to-back windows, the first at the
    start and the rest evenly spread: the last one lies within ``fit / count`` windows of the end (a whole-number
    stride left the last half of the split unread when ``fit`` is just under twice ``limit``)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 32, ())))  # from the test's seed: replayable
    for _ in range(200):
        seq_len = int(torch.randint(1, 300, (), generator=g))
        num_tokens = int(torch.randint(seq_len + 1, 40 * (seq_len + 1), (), generator=g))
        limit = int(torch.randint(1, 40, (), generator=g))
        starts = fixed_starts(num_tokens, seq_len, limit).tolist()
        fit = num_tokens // (seq_len + 1)
        assert len(starts) == min(fit, limit)
        assert starts[0] == 0 and starts == sorted(set(starts))
        assert all(s % (seq_len + 1) == 0 for s in starts)                            # whole window slots
        assert all(b - a >= seq_len + 1 for a, b in zip(starts, starts[1:]))          # disjoint
        assert starts[-1] + seq_len + 1 <= num_tokens                                 # inside the split
        slots_after_last = fit - 1 - starts[-1] // (seq_len + 1)
        assert slots_after_last < fit / len(starts), (num_tokens, seq_len, limit, starts)
    # the case that showed it: 31 windows fit, 16 are read; all 31 when they fit
    assert fixed_starts(31 * 9, 8, 16).tolist()[-1] == 29 * 9
    assert fixed_starts(31 * 9, 8, 40).tolist() == [i * 9 for i in range(31)]


def test_train_and_validation_share_no_document_and_together_hold_every_document(tmp_path):
    o = options(tmp_path)
    task = LanguageModeling(o)
    train = split_documents(np.fromfile(task.folder / "train.bin", dtype=np.uint16))
    val = split_documents(np.fromfile(task.folder / "val.bin", dtype=np.uint16))
    assert train and val and not set(train) & set(val)
    expected = [p for f in sorted((tmp_path / "corpus").glob("*.txt")) for p in f.read_bytes().split(b"\n\n")]
    assert sorted(train + val) == sorted(expected)  # repeated paragraphs included, once per occurrence
    assert task.meta["documents"] == {"train": len(train), "val": len(val)}
    validation = task.make("test", seed=0)
    assert torch.equal(validation.inputs, task.make("test", seed=5).inputs)  # the same for every seed


def test_the_byte_tokenizer_round_trips_any_bytes():
    tok = ByteTokenizer()
    data = bytes(torch.randint(0, 256, (500,)).tolist()) + b"\xff\xfe\xc3"  # invalid UTF-8 on purpose
    assert tok.decode(tok.encode(data)) == data
    assert tok.encode("é") == [0xC3, 0xA9] and max(tok.encode(data)) < tok.eos_id == 256


# ------------------------------------------------------------------------------------------ zoo data prepare
def test_prepare_twice_is_byte_identical_and_an_interrupted_run_resumes_to_the_same_files(tmp_path, monkeypatch):
    corpus = random_corpus(tmp_path / "corpus")
    monkeypatch.setattr(prep, "PART_DOCUMENTS", 5)
    whole = check_deterministic_and_resumable(
        monkeypatch, lambda name: options(tmp_path, corpus, data_dir=str(tmp_path / name)), interrupt_at=3)
    assert json.loads((whole / "meta.json").read_text())["vocab_size"] == 257


# ------------------------------------------------------------------------------------------ bits per byte
class FixedLogits(torch.nn.Module):
    """A stand-in model whose logits ignore the input: a fixed (T, V) table."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids, mask=None):
        return self.table[: ids.shape[1]].expand(ids.shape[0], -1, -1)


def test_bits_per_byte_is_8_for_uniform_logits_over_the_256_bytes():
    logits = torch.zeros(32, 257)
    logits[:, EOS] = float("-inf")
    ids = torch.randint(0, 256, (5, 33))
    token_bytes = torch.from_numpy(ByteTokenizer().token_bytes())
    out = text_metrics(FixedLogits(logits), TaskData(ids[:, :-1], ids[:, 1:]), token_bytes, 2, torch.device("cpu"))
    assert out["bpb"] == pytest.approx(8.0, rel=1e-6)  # fp32 logits
    assert out["ppl"] == pytest.approx(256.0, rel=1e-6)
    out = text_metrics(FixedLogits(logits.double()), TaskData(ids[:, :-1], ids[:, 1:]), token_bytes, 3,
                       torch.device("cpu"))
    assert out["bpb"] == pytest.approx(8.0, rel=1e-12)


def test_bits_per_byte_matches_a_hand_computation_for_a_bpe_tokenizer(tmp_path):
    text = TEXT
    bpe = bpe_tokenizer(tmp_path / "tokenizer.json", text)
    ids = bpe.encode(text)
    assert bpe.decode(ids).decode() == text and len(ids) < len(text) / 2  # merges happened
    V, T = bpe.vocab_size, len(ids) - 1
    table = torch.randn(T, V, dtype=torch.float64)
    data = TaskData(torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]))
    out = text_metrics(FixedLogits(table), data, torch.from_numpy(bpe.token_bytes()), 1, torch.device("cpu"))
    nats = sum(math.log(sum(math.exp(x) for x in table[t].tolist())) - table[t, ids[t + 1]].item() for t in range(T))
    target_bytes = len(text.encode()) - len(bpe.tok.decode([ids[0]]).encode())
    assert out["bpb"] == pytest.approx(nats / math.log(2) / target_bytes, rel=1e-9)


def test_token_bytes_of_a_sentencepiece_style_tokenizer_keep_the_spaces(tmp_path):
    """A Metaspace token (``▁the``) stands for its space too, which decoding it alone drops; a byte-fallback
    token is one byte. Only the phantom space such a tokenizer puts before a text's first word is extra."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["state", "mixer", "scan", "key", "gate", "decays", "opens", "the", "of", "and"]
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    text = " ".join(rng.choice(words) for _ in range(60))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Metaspace()])
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=330, special_tokens=["</s>"] + [f"<0x{b:02X}>" for b in range(256)]))
    tok.save(str(tmp_path / "tokenizer.json"))
    sp = HFTokenizer(str(tmp_path / "tokenizer.json"))
    counts = sp.token_bytes()
    ids = sp.encode(" " + text)
    assert sp.decode(ids).decode() == text and len(ids) < len(text) / 2  # merges happened
    assert counts[ids].sum() == len((" " + text).encode())
    assert counts[sp.encode(text)].sum() == len(text.encode()) + 1
    fallback = sp.encode("é")   # not in the vocabulary: its two UTF-8 bytes as byte-fallback tokens
    assert [sp.tok.id_to_token(i) for i in fallback][-2:] == ["<0xC3>", "<0xA9>"] and counts[fallback[-2:]].sum() == 2


# ------------------------------------------------------------------------------------------ generation
def tiny_lm(name: str, d_model: int = 16) -> HybridLM:
    cls = MIXERS.get(name)
    model = HybridLM([Spec(name, build_options(cls.Options, dict(cls.contract_options), ""))], 257, d_model)
    model = model.double().eval()
    return wake_zero_initialised(model)


@pytest.mark.parametrize("name", MIXERS.names())
def test_greedy_generation_equals_the_argmax_of_full_forwards(name):
    model = tiny_lm(name)
    prompt = torch.randint(0, 256, (int(torch.randint(3, 9, ())),)).tolist()
    new, _, _ = generate_ids(model, prompt, max_new_tokens=6)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert new == seq[len(prompt):]


# ------------------------------------------------------------------------------------------ training and the CLI
def lm_recipe(tmp_path, **train):
    return zoo.load({"model": {"d_model": 16, "layers": ["gla"], "mixer_options": {"gla": {"n_heads": 2, "head_dim": 8}}},
                     "task": {"name": "lm", **{k: v for k, v in vars(options(tmp_path)).items()}},
                     "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "threads": 1, **train},
                     "eval": {"batch_size": 8, "seq_lens": [32]}})


def test_training_reports_bits_per_byte_and_generate_prints_text(tmp_path, capsys):
    recipe = lm_recipe(tmp_path)
    result = zoo.train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    m = result.metrics
    assert 0 < m["val_bpb"] < 20 and m["val_bpb@32"] > 0 and m["train_tokens_per_second"] > 0
    assert m["val_ppl"] == pytest.approx(math.exp(m["test_loss"]), rel=1e-4)
    assert m["data_source_hash"] == json.loads((LanguageModeling(recipe.task.options).folder / "meta.json")
                                               .read_text())["source_hash"][:16]
    assert zoo_main(["generate", str(tmp_path / "run"), "--prompt", "state", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("state") and "tokens/s" in out and "peak memory" in out
    assert "note:" not in captured.err   # gla decodes as it trains
    texts = []  # prompts of different lengths, together and alone: the same continuations
    for prompts in (["the key", "a"], ["the key"], ["a"]):
        argv = ["generate", str(tmp_path / "run"), "--max-new-tokens", "6", "--temperature", "0"]
        assert zoo_main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
        texts.append([line for line in capsys.readouterr().out.splitlines() if not line.startswith("[")])
    assert texts[0] == texts[1] + texts[2]


def test_generate_says_when_a_layer_decodes_otherwise_than_it_trained(tmp_path, capsys):
    recipe = lm_recipe(tmp_path)
    plain = recipe_mapping(recipe.plain)
    plain["model"]["layers"] = [{"ska": {"n_heads": 2, "rank": 4, "chunk_size": 8, "normalisation": "running_max"}}, "gla"]
    zoo.train(zoo.load(plain), progress=False, checkpoint_dir=tmp_path / "run")
    capsys.readouterr()
    assert zoo_main(["generate", str(tmp_path / "run"), "--max-new-tokens", "2", "--temperature", "0"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "ska chunk_size=8" in notes[0] and "chunk_size=1 decodes as it trains" in notes[0]


def test_a_token_budget_sets_the_steps_and_gradient_accumulation_gives_the_same_step(tmp_path):
    assert lm_recipe(tmp_path, tokens=1000, steps=1).train.steps == math.ceil(1000 / (4 * 16))
    whole = zoo.train(lm_recipe(tmp_path, batch_size=8), progress=False)
    accumulated = zoo.train(lm_recipe(tmp_path, batch_size=8, grad_accum=4), progress=False)
    # Adam divides each gradient by its own running size, so where an element's gradient nearly cancels the
    # fp32 rounding of a different summation order shows in its update (2e-6 seen once); a wrong accumulation
    # (a micro-batch lost or counted twice) moves updates by the order of the learning rate, 1e-3 here
    for a, b in zip(whole.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    assert lm_recipe(tmp_path, batch_size=8).key == lm_recipe(tmp_path, batch_size=8, grad_accum=1).key


def test_the_harness_adapter_scores_the_models_summed_token_loss(tmp_path):
    model = tiny_lm("gla").float()
    scorer = ZooScorer(model, LanguageModeling(options(tmp_path)))
    context, continuation = "the key decays", " and the gate opens"
    ids = torch.tensor([list(context.encode()) + list(continuation.encode())])
    with torch.no_grad():
        losses = F.cross_entropy(model(ids[:, :-1])[0].double(), ids[0, 1:], reduction="none")
    ll, greedy = scorer.loglikelihood(context, continuation)
    assert ll == pytest.approx(-losses[-len(continuation):].sum().item(), rel=1e-6)
    with torch.no_grad():
        rolled = F.cross_entropy(model(torch.tensor([[EOS] + list(context.encode())[:-1]]))[0].double(),
                                 torch.tensor(list(context.encode())), reduction="sum")
    assert scorer.loglikelihood_rolling(context) == pytest.approx(-rolled.item(), rel=1e-6)
    assert isinstance(greedy, bool)
    new, _, _ = generate_ids(model, list(b"the"), 8, eos_id=EOS)
    full = bytes(i for i in new if i != EOS).decode("utf-8", errors="replace")
    assert scorer.generate_until("the", until=[], max_gen_toks=8) == full
    stop = full[-1:] or "\x00"  # a character of the continuation (decoded bytes may merge into fewer)
    assert scorer.generate_until("the", until=["\x00never", stop], max_gen_toks=8) == full[:full.find(stop)]
    # decoding ends at the token that completes a stop string: one prefill, then a step per further token
    for prompt in ("the", "and", "key", "gate"):  # one whose continuation holds an ASCII byte before any EOS
        new, _, _ = generate_ids(model, list(prompt.encode()), 24, eos_id=EOS)
        ascii_at = [t for t, i in enumerate(new) if 0 < i < 128]
        if ascii_at:
            break
    assert ascii_at, new
    stop_byte = new[ascii_at[int(torch.randint(len(ascii_at), ()))]]
    steps = []
    step = model.step
    model.step = lambda *args: steps.append(1) or step(*args)
    text = scorer.generate_until(prompt, until=[chr(stop_byte)], max_gen_toks=24)
    assert len(steps) == new.index(stop_byte) and chr(stop_byte) not in text


# ------------------------------------------------------------------------------------------ bad input: one line each
def one_line_error(capsys, *argv) -> str:
    assert zoo_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo: error: ") and "Traceback" not in err
    return err


def write_recipe(tmp_path, task: dict, layers=("gla",), name="r.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": {"d_model": 16, "layers": list(layers)},
                                    "task": {"name": "lm", "data_dir": str(tmp_path / "data"), **task},
                                    "train": {"steps": 2, "batch_size": 2, "warmup_steps": 0}}))
    return str(path)


def test_every_bad_input_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    corpus = random_corpus(tmp_path / "corpus")
    files = {"source": "files", "path": str(corpus / "*.txt"), "doc_separator": "\n\n", "val_fraction": 0.2}
    assert "no file matches" in one_line_error(capsys, "data", "prepare",
                                               write_recipe(tmp_path, {"source": "files", "path": "/nowhere/*.txt"}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"")
    assert "no training documents" in one_line_error(
        capsys, "data", "prepare", write_recipe(tmp_path, {"source": "files", "path": str(tmp_path / "empty/*.txt")}))
    assert "fewer than one window" in one_line_error(capsys, "check", write_recipe(tmp_path, {**files, "seq_len": 100000}))
    err = one_line_error(capsys, "check", write_recipe(tmp_path, files, layers=({"ska": {"normalisation": "seq_max"}},)))
    assert "model.layers.0" in err and "running_max" in err
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "meta.json").write_text(json.dumps({"vocab_size": 70000, "eos_id": 0, "dtype": "uint16",
                                                  "tokenizer": "bytes", "tokens": {"train": 0, "val": 0}}))
    assert "does not fit uint16" in one_line_error(capsys, "check",
                                                   write_recipe(tmp_path, {"source": "shards", "path": str(shards)}))
    monkeypatch.setitem(sys.modules, "datasets", None)  # the lm extra not installed
    assert "pip install 'mixer-zoo[lm]'" in one_line_error(
        capsys, "data", "prepare", write_recipe(tmp_path, {"source": "hf", "hf_dataset": "HuggingFaceFW/fineweb-edu"}))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert "pip install 'mixer-zoo[lm]'" in one_line_error(capsys, "check",
                                                           write_recipe(tmp_path, {**files, "tokenizer": "gpt2"}))
    run = tmp_path / "run"
    zoo.train(lm_recipe(tmp_path), progress=False, checkpoint_dir=run)
    assert "trained with tokenizer 'bytes'" in one_line_error(capsys, "generate", run, "--tokenizer", "gpt2")
    assert "--top-p" in one_line_error(capsys, "generate", run, "--top-p", "0")
    other = tmp_path / "mqar"
    zoo.train(zoo.load({"model": {"d_model": 16, "layers": ["gla"]},
                        "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2,
                                 "num_train": 8, "num_test": 4},
                        "train": {"steps": 1, "batch_size": 4, "warmup_steps": 0}}), progress=False, checkpoint_dir=other)
    assert "not a language model" in one_line_error(capsys, "generate", other)
    assert "only task: lm" in one_line_error(capsys, "data", "prepare", os.path.join(os.path.dirname(__file__),
                                                                                    "recipes", "tiny.yaml"))


def test_generate_names_the_flag_and_the_value_it_refuses(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    zoo.train(lm_recipe(tmp_path), progress=False, checkpoint_dir=run)
    threads = torch.get_num_threads()
    for argv, said in ((["--threads", "-1"], "--threads -1: must be a number of threads from 1 to 1024"),
                       (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
                       (["--top-p", "0"], "--top-p 0: must be in (0, 1]"),
                       (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
                       (["--top-k", "-2"], "--top-k -2: must be >= 0"),
                       (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0")):
        assert f"zoo generate: {said}" in one_line_error(capsys, "generate", run, "--prompt", "a", *argv)
    assert torch.get_num_threads() == threads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    err = one_line_error(capsys, "generate", run, "--prompt", "a", "--device", "cuda")
    assert "--device cuda: no CUDA device is available; use --device cpu" in err and "train.device" not in err


def test_a_folder_as_the_files_path_is_refused_with_a_glob_to_give_instead(tmp_path, capsys):
    corpus = random_corpus(tmp_path / "corpus")
    for given in (str(corpus), str(corpus) + "/", f"{corpus / 'doc0.txt'};{corpus}"):
        err = one_line_error(capsys, "data", "prepare", write_recipe(tmp_path, {"source": "files", "path": given}))
        assert f"is a folder; source 'files' reads files: give a file or a glob such as {corpus}/*.txt" in err, err
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------------------------------ the hf source
def test_the_hf_source_streams_a_text_field_and_bounds_the_documents(tmp_path, monkeypatch):
    records = [{"text": f"document {i} " * 3, "id": i} for i in range(7)]
    calls = []

    def load_dataset(name, config, split, streaming, **kwargs):
        calls.append((name, config, split, streaming, kwargs))
        return iter(records)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    o = options(tmp_path, source="hf", hf_dataset="org/set", hf_config="sample", max_documents=5)
    assert list(sources.documents(o)) == [r["text"].encode() for r in records[:5]]
    assert calls == [("org/set", "sample", "train", True, {})]
    bad = options(tmp_path, source="hf", hf_dataset="org/set", hf_text_field="body")
    with pytest.raises(UserError, match="no field 'body'"):
        list(sources.documents(bad))


def test_the_hf_source_reads_a_dataset_built_from_local_files(tmp_path):
    pytest.importorskip("datasets")  # the lm extra
    lines = [json.dumps({"text": f"paragraph {i}: " + "state mixer " * (i + 3)}) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    o = options(tmp_path, source="hf", hf_dataset="json", hf_data_files=str(tmp_path / "d.jsonl"), val_fraction=0.3)
    where, _ = prep.prepare(o)
    meta = prep.read_meta(where, o)
    assert meta["documents"]["train"] + meta["documents"]["val"] == 40
    assert meta["bytes"]["train"] + meta["bytes"]["val"] == sum(len(json.loads(x)["text"].encode()) for x in lines)


def test_the_harness_registers_the_model_and_answers_its_requests(tmp_path):
    pytest.importorskip("lm_eval")  # the lm extra (no network: the requests are built here)
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from zoo.lm_harness import register

    run = tmp_path / "run"
    zoo.train(lm_recipe(tmp_path), progress=False, checkpoint_dir=run)
    register()
    harness = get_model("zoo").create_from_arg_string(f"checkpoint={run}")
    scorer = ZooScorer.from_checkpoint(str(run))
    pairs = [("the key", " decays"), ("", "state"), ("gate", "")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    assert harness.loglikelihood(requests) == [scorer.loglikelihood(*pair) for pair in pairs]
    rolling = harness.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("the scan",), 0)])
    assert rolling == [scorer.loglikelihood_rolling("the scan")]
    text = harness.generate_until([Instance("generate_until", {}, ("the", {"until": ["\n"], "max_gen_toks": 5}), 0)])
    assert text == [scorer.generate_until("the", ["\n"], 5)]


def test_an_interrupted_run_resumes_drawing_the_windows_an_uninterrupted_run_draws(tmp_path, monkeypatch):
    recipe = lm_recipe(tmp_path, steps=4, checkpoint_every=2)
    uninterrupted = zoo.train(recipe, progress=False)
    real, calls = loop._step, []

    def dies_at_the_third_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(loop, "_step", dies_at_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        zoo.train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    monkeypatch.setattr(loop, "_step", real)
    resumed = zoo.train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    for a, b in zip(uninterrupted.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.metrics["val_bpb"] == uninterrupted.metrics["val_bpb"]


def test_tables_of_language_models_show_bits_per_byte_by_length():
    rows = [{"metrics": {"val_bpb": 2.0, "val_bpb@512": 2.2, "val_bpb@256": 2.1, "test_accuracy": 0.4}}]
    columns = table_columns(rows)
    assert columns[2:5] == ["val_bpb", "val_bpb@256", "val_bpb@512"] and "test_accuracy" not in columns


def test_an_evaluation_length_longer_than_the_validation_split_is_refused_once_the_data_is_prepared(tmp_path, capsys):
    corpus = random_corpus(tmp_path / "corpus")
    task = {"source": "files", "path": str(corpus / "*.txt"), "doc_separator": "\n\n", "val_fraction": 0.2}
    recipe = write_recipe(tmp_path, task)
    assert zoo_main(["data", "prepare", recipe, "--no-progress"]) == 0
    err = one_line_error(capsys, "check", recipe, "eval.seq_lens=[1000000]")
    assert "eval.seq_lens" in err and "validation split" in err


def test_the_python_docs_source_reads_the_installations_own_help_text(tmp_path):
    import pydoc_data.topics

    docs = list(sources.documents(options(tmp_path, source="python-docs")))
    topics = pydoc_data.topics.topics  # documents are runs of a topic's paragraphs, in the order of the names
    assert b"\n\n".join(docs) == b"\n\n".join(topics[name].encode() for name in sorted(topics))
    assert len(docs) > len(topics)  # (the python-stdlib source: tests/zoo/test_stdlib_corpus.py)


def test_an_edited_file_corpus_is_prepared_again(tmp_path):
    corpus = random_corpus(tmp_path / "corpus")
    first, _ = prep.prepare(options(tmp_path, corpus))
    with open(corpus / "doc0.txt", "a") as fh:
        fh.write("\n\nan added paragraph about the gate")
    second, wrote = prep.prepare(options(tmp_path, corpus))
    assert wrote and second != first
    docs = split_documents(np.fromfile(second / "train.bin", dtype=np.uint16))
    docs += split_documents(np.fromfile(second / "val.bin", dtype=np.uint16))
    assert b"an added paragraph about the gate" in docs


def test_a_prepared_folder_reads_back_as_shards(tmp_path):
    files = LanguageModeling(options(tmp_path))
    shards = LanguageModeling(options(tmp_path, source="shards", path=str(files.folder)))
    assert shards.vocab_size == files.vocab_size == 257 and shards.folder == files.folder
    assert torch.equal(shards.make("test", 0).inputs, files.make("test", 0).inputs)
    seed = int(torch.randint(1 << 30, ()))
    a = shards.train_data(0).draw(3, torch.Generator().manual_seed(seed))
    b = files.train_data(0).draw(3, torch.Generator().manual_seed(seed))
    assert torch.equal(a.labels, b.labels) and torch.equal(shards.token_bytes(), files.token_bytes())
    wrong = LanguageModeling(options(tmp_path, source="shards", path=str(files.folder), tokenizer="gpt2"))
    with pytest.raises(UserError, match="set task.tokenizer: bytes"):
        wrong.make("test", 0)


def test_the_loader_benchmark_reports_both_rates_and_refuses_a_synthetic_task(tmp_path, capsys):
    recipe = write_recipe(tmp_path, {"source": "files", "path": str(random_corpus(tmp_path / "corpus") / "*.txt"),
                                     "doc_separator": "\n\n", "val_fraction": 0.2, "seq_len": 16})
    assert loader.main([recipe, "--seconds", "0.05", "--steps", "1"]) == 0
    rates = re.findall(r"([\d,]+) tokens/s", capsys.readouterr().out)
    assert len(rates) == 2 and all(int(r.replace(",", "")) > 0 for r in rates)
    with pytest.raises(SystemExit) as stop:
        loader.main([str(Path(__file__).parent / "recipes" / "tiny.yaml")])
    assert stop.value.code == 2 and "needs a text task" in capsys.readouterr().err
