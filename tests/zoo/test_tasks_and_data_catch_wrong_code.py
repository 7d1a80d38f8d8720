"""Task data and language-model data, checked against small hand-built cases and plain-Python rebuilds: the
generator keys of the data streams, the task contract's refusals, MQAR's key range, tool_trace's filler spans,
and the token files, tokenizers, splits, sources and prepared folders of the ``lm`` task."""
from __future__ import annotations

import collections
import hashlib
import json
import pydoc_data.topics
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mixers.options import build_options, opt
from tests.zoo.local_tokenizer import TEXT, bpe_tokenizer
from zoo.data import prepare as prep
from zoo.data import sources, stdlib
from zoo.data.tokenize import byte_level_table
from zoo.data.windows import TokenFile
from zoo.errors import UserError
from zoo.tasks import TASKS, Task, TaskData
from zoo.tasks.base import GENERATOR_KEY_BITS, LINEAR_SEED_LENGTHS, LONG_LENGTH_KEYS, REPEATED_DRAW_TOKENS, stream_seed
from zoo.tasks.lm import LanguageModeling

KEY = (1 << GENERATOR_KEY_BITS) - 1


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def seed():
    return int(torch.randint(1 << 30, ()))


# ------------------------------------------------------------------------------------- the task contract
def test_generator_keys_run_on_from_the_linear_range_into_one_block_per_split():
    """Below the switch a seed's keys are ``seed * 1_000_003 + split * 7919 + L``, ending at ``3 * 7919 - 1``;
    from the switch on, train's lengths take the keys right after that range and test's the block after train's,
    one key per length in order."""
    s = int(torch.randint(1 << 31, ()))
    base = s * 1_000_003

    def offset(split, length):
        return (stream_seed(s, split, length) - base) & KEY

    assert offset("test", LINEAR_SEED_LENGTHS - 1) == 3 * 7919 - 1
    assert offset("train", LINEAR_SEED_LENGTHS - 1) == 2 * 7919 - 1
    extra = int(torch.randint(1, 1 << 20, ()))
    for k in (0, 1, extra):
        assert offset("train", LINEAR_SEED_LENGTHS + k) == 3 * 7919 + k
        assert offset("test", LINEAR_SEED_LENGTHS + k) == 3 * 7919 + LONG_LENGTH_KEYS + k
    assert stream_seed(s, "test", LINEAR_SEED_LENGTHS) >> GENERATOR_KEY_BITS == s


def test_a_batch_of_task_data_takes_the_same_rows_of_inputs_labels_and_mask():
    n, T = int(torch.randint(3, 9, ())), int(torch.randint(2, 6, ()))
    data = TaskData(torch.randint(50, (n, T)), torch.randint(50, (n, T)), torch.rand(n, T))
    index = torch.randperm(n)[:n - 1]
    for rows in (index, slice(1, n)):
        part = data.batch(rows)
        assert torch.equal(part.inputs, data.inputs[rows]) and torch.equal(part.labels, data.labels[rows])
        assert torch.equal(part.mask, data.mask[rows])
    assert data.batch(index).mask.shape == (n - 1, T)


class _Drawn(Task):
    """A task that draws inputs with its generator and breaks one rule when ``breaks`` says so."""
    name = ""
    breaks = ""

    @dataclass
    class Options:
        seq_len: int = opt(8, "length")
        num_train: int = opt(4, "examples")
        num_test: int = opt(4, "examples")

    vocab_size = 16

    def generate(self, num_examples, seq_len, generator):
        inputs = torch.randint(16, (num_examples, seq_len), generator=None if self.breaks == "global" else generator)
        labels = inputs.clone()
        mask = torch.rand(num_examples, seq_len) if self.breaks == "mask" else torch.ones(num_examples, seq_len)
        if self.breaks == "input_at_vocab":
            inputs[:, -1] = 16
        return TaskData(inputs, labels, mask)


def _drawn(breaks):
    return type(f"Drawn_{breaks}", (_Drawn,), {"breaks": breaks})(_Drawn.Options())


@pytest.mark.parametrize("breaks,words", [("mask", "different data from the same generator state"),
                                          ("global", "different data from the same generator state"),
                                          ("input_at_vocab", "outside the vocabulary")])
def test_the_contract_refuses_a_draw_of_the_largest_checked_size(breaks, words):
    """A draw of exactly the tokens that are drawn twice is drawn twice: a mask or inputs that differ from the same
    generator state are refused, as is an input id equal to the vocabulary size."""
    seq_len = 1 << int(torch.randint(3, 7, ()))
    n = REPEATED_DRAW_TOKENS // seq_len
    task = _drawn(breaks)
    with pytest.raises(UserError, match=words):
        task.generate(n, seq_len, torch.Generator().manual_seed(seed()))
    data = _drawn("").generate(n, seq_len, torch.Generator().manual_seed(seed()))
    assert data.inputs.shape == (n, seq_len)


# ------------------------------------------------------------------------------------------ mqar
def test_mqar_takes_every_key_id_at_most_and_refuses_one_pair_more():
    """Keys are the ``V/2 - 1`` ids of ``[1, V/2)``: that many pairs use each key once per row, one more is refused
    with the vocabulary size it needs."""
    V = 2 * int(torch.randint(3, 7, ()))
    pairs = V // 2 - 1
    data = make("mqar", vocab_size=V, seq_len=4 * pairs, num_kv_pairs=pairs, random_fill=False).make(
        "train", seed(), num_examples=20)
    for x in data.inputs.tolist():
        assert sorted(x[0:2 * pairs:2]) == list(range(1, V // 2))
        assert all(V // 2 <= v < V for v in x[1:2 * pairs:2])
    with pytest.raises(ValueError, match=f"raise vocab_size to at least {2 * (pairs + 1) + 2}"):
        build_options(TASKS.get("mqar").Options, {"vocab_size": V, "seq_len": 4 * V, "num_kv_pairs": pairs + 1})


# ------------------------------------------------------------------------------------------ transfer tasks
def test_tool_trace_splits_its_filler_into_every_composition_of_the_gap_equally_often():
    """Two calls share a gap of ``g`` filler tokens: the output after the first takes ``0 .. g`` of them, each
    ``1 / (g + 1)`` of the time, so either call may be followed by no output at all."""
    gap, rows = int(torch.randint(2, 5, ())), 400
    T = 3 * 2 + gap + 4  # two calls, the gap, one query Q agent tool result
    data = make("tool_trace", vocab_size=64, seq_len=T, num_kv_pairs=2, num_queries=1).make(
        "train", seed(), num_examples=rows)
    firsts = collections.Counter()
    for m in data.mask.tolist():
        assert m[:3] == [1.0] * 3 and sum(m) == 6
        firsts[m.index(1.0, 3) - 3] += 1
    assert set(firsts) == set(range(gap + 1))
    p = 1 / (gap + 1)
    spread = (rows * p * (1 - p)) ** 0.5
    assert all(abs(c - rows * p) <= 6 * spread for c in firsts.values()), firsts


# ------------------------------------------------------------------------------------------ lm data
def _shards(folder, train_tokens: int, val_tokens: int, vocab: int = 50):
    """A prepared folder written by hand (``source: shards``): random ids below ``vocab``."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed())
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        rng.integers(0, vocab, count).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": 0, "dtype": "uint16",
                                                  "tokenizer": "bytes",
                                                  "tokens": {"train": train_tokens, "val": val_tokens}}))
    return folder


def _shards_task(folder, seq_len):
    return LanguageModeling(build_options(LanguageModeling.Options, {"source": "shards", "path": str(folder),
                                                                     "seq_len": seq_len, "num_test": 2}, ""))


def test_a_token_file_needs_one_window_of_seq_len_plus_one_tokens(tmp_path):
    seq_len = int(torch.randint(2, 20, ()))
    for count in (seq_len, seq_len + 1):
        path = tmp_path / f"{count}.bin"
        np.arange(count, dtype=np.uint16).tofile(path)
        tokens = TokenFile(path, "uint16", "train")
        assert len(tokens) == count
        if count == seq_len:
            with pytest.raises(UserError, match=rf"has {count} tokens, fewer than one window of seq_len \+ 1"):
                tokens.check_length(seq_len)
        else:
            tokens.check_length(seq_len)
            assert tokens.read(torch.tensor([0]), seq_len).tolist() == [list(range(count))]


def test_training_data_is_refused_when_the_validation_split_holds_no_window(tmp_path):
    seq_len = int(torch.randint(4, 16, ()))
    short = _shards_task(_shards(tmp_path / "short", 500, seq_len), seq_len)
    with pytest.raises(UserError, match="validation split has"):
        short.train_data(0)
    enough = _shards_task(_shards(tmp_path / "enough", 500, seq_len + 1), seq_len)
    data = enough.train_data(0).draw(3, torch.Generator().manual_seed(seed()))
    assert data.inputs.shape == (3, seq_len) and torch.equal(data.inputs[:, 1:], data.labels[:, :-1])


def test_the_byte_level_alphabet_is_gpt2s_one_character_per_byte():
    """Printable bytes stand for themselves; the others take ``chr(256 + i)`` in byte order (GPT-2's alphabet:
    space is ``Ġ``, newline ``Ċ``, the soft hyphen ``Ń``)."""
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    assert all(table[chr(b)] == b for b in printable)
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["Ń"] == 0xAD and table[chr(256)] == 0
    assert table["ÿ"] == 0xFF


def test_a_bpe_tokenizers_end_of_text_counts_one_byte(tmp_path):
    """Bits per byte count a document's bytes plus one for its end: encoded, a document and its EOS stand for
    ``len(document) + 1`` bytes."""
    bpe = bpe_tokenizer(tmp_path / "tokenizer.json")
    counts = bpe.token_bytes()
    words = TEXT.split()
    doc = " ".join(words[int(i)] for i in torch.randint(len(words), (12,)))
    assert counts[bpe.eos_id] == 1
    assert counts[bpe.encode(doc) + [bpe.eos_id]].sum() == len(doc.encode()) + 1


def _files_options(tmp_path, **extra):
    values = {"source": "files", "path": str(tmp_path / "*.txt"), "seq_len": 8, "num_test": 2, "val_fraction": 0.2,
              "data_dir": str(tmp_path / "data"), **extra}
    return build_options(LanguageModeling.Options, values, "")


def test_every_option_that_changes_the_token_files_has_its_own_prepared_folder(tmp_path):
    """Two option sets that split or bound the documents differently never share a prepared folder (one would
    read the other's split); the same options find the same folder."""
    (tmp_path / "a.txt").write_text("some text " * int(torch.randint(1, 9, ())))
    base = _files_options(tmp_path)
    assert prep.folder(base) == prep.folder(_files_options(tmp_path))
    changes = [{"val_fraction": 0.3}, {"max_documents": 5}, {"doc_separator": "\n\n"}]
    folders = {prep.folder(_files_options(tmp_path, **change)) for change in changes}
    assert len(folders) == len(changes) and prep.folder(base) not in folders


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_token_file_of_another_size_than_its_metadata_says_is_refused(tmp_path, extra):
    folder = _shards(tmp_path / "shards", 300, 100)
    tokens = np.fromfile(folder / "val.bin", dtype=np.uint16)
    (tokens[:extra] if extra < 0 else np.append(tokens, tokens[:extra])).tofile(folder / "val.bin")
    with pytest.raises(UserError, match=r"val\.bin: missing or of the wrong size for 100 tokens"):
        prep.read_meta(folder, _shards_task(folder, 8).options)


def _expected_split(docs, val_fraction):
    """The byte tokens of each split, rebuilt from the documents: each one's bytes, then EOS (256)."""
    out = {"train": [], "val": []}
    for doc in docs:
        side = "val" if int.from_bytes(hashlib.sha256(doc).digest()[:8], "big") < val_fraction * 2.0 ** 64 else "train"
        out[side] += list(doc) + [256]
    return out


def test_a_part_left_by_another_source_is_tokenised_again(tmp_path, monkeypatch):
    """A finished part whose record names other documents (the source changed under an interrupted run) is not
    reused: the token files hold this source's documents."""
    monkeypatch.setattr(prep, "PART_DOCUMENTS", 2)
    words = ["gate", "scan", "key", "value", "decay", "state"]
    expected = {"train": []}
    while not all(expected.get(s) for s in ("train", "val")):  # a draw with documents on both sides
        docs = [" ".join(words[int(i)] for i in torch.randint(len(words), (int(torch.randint(2, 9, ())),))).encode()
                + bytes([65 + k]) for k in range(6)]
        expected = _expected_split(docs, 0.5)
    (tmp_path / "corpus.txt").write_bytes(b"\n\n".join(docs))
    o = _files_options(tmp_path, doc_separator="\n\n", val_fraction=0.5)
    parts = prep.folder(o) / "parts"
    parts.mkdir(parents=True)
    stale = {"train": np.array([7, 7, 256], np.uint16), "val": np.array([9, 256], np.uint16)}
    for split in ("train", "val"):
        stale[split].tofile(parts / f"00000.{split}.bin")
    counts = {s: {"documents": 1, "tokens": len(stale[s]), "bytes": len(stale[s]) - 1} for s in ("train", "val")}
    (parts / "00000.json").write_text(json.dumps({"sha256": "0" * 64, "counts": counts}))
    where, wrote = prep.prepare(o)
    assert wrote
    for split in ("train", "val"):
        assert np.fromfile(where / f"{split}.bin", dtype=np.uint16).tolist() == expected[split]


def test_a_corpus_without_a_validation_document_is_refused_and_left_unfinished(tmp_path):
    docs = []
    while len(docs) < 3:  # documents that all fall in the training split at this fraction
        doc = f"document {seed()}".encode()
        if not _expected_split([doc], 0.05)["val"]:
            docs.append(doc)
    (tmp_path / "corpus.txt").write_bytes(b"\n\n".join(docs))
    o = _files_options(tmp_path, doc_separator="\n\n", val_fraction=0.05)
    with pytest.raises(UserError, match=r"no document fell in the validation split \(3 documents, val_fraction 0.05\)"):
        prep.prepare(o)
    assert not (prep.folder(o) / prep.META).exists()


def test_python_docs_documents_are_each_topics_paragraphs_joined_back():
    """Joined with the blank lines between paragraphs, the documents of each topic give the topic's text; every
    document but a topic's last holds at least ``DOC_BYTES`` bytes."""
    o = build_options(LanguageModeling.Options, {"source": "python-docs", "seq_len": 8}, "")
    docs = iter(sources.documents(o))
    for name in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[name].encode()
        if not text:
            continue
        got = [next(docs)]
        while len(b"\n\n".join(got)) < len(text):
            got.append(next(docs))
        assert b"\n\n".join(got) == text, name
        assert all(len(d) >= sources.DOC_BYTES for d in got[:-1])
    assert next(docs, None) is None


def test_the_stdlib_rule_gives_only_non_empty_hand_written_files_outside_tests(tmp_path):
    kept = {f"pkg/mod{k}.py": f"x = {seed()}\n".encode() for k in range(3)}
    left_out = {"pkg/__init__.py": b"", "pkg/tests/test_a.py": b"y = 1\n", "pkg/gen.py": b"# Generated by hand\nz = 2\n",
                "site-packages/other.py": b"w = 3\n", "pkg/notes.txt": b"text\n"}
    for rel, text in {**kept, **left_out}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(text)
    o = build_options(LanguageModeling.Options, {"source": "python-stdlib", "path": str(tmp_path), "seq_len": 8}, "")
    assert list(stdlib.keyed_documents(o)) == [(rel.encode(), kept[rel]) for rel in sorted(kept)]
