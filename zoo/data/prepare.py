"""``zoo data prepare``: a source tokenised once into flat token files, the layout nanoGPT and flame use.

A prepared folder holds ``train.bin`` and ``val.bin`` (every document's tokens followed by EOS, as
``uint16`` or ``uint32`` by vocabulary size) and ``meta.json`` (tokenizer, vocabulary size, EOS id, dtype,
documents, tokens and bytes per split, the source, the SHA-256 of its documents and, for a Python source
read from this interpreter, its Python version). It lives in ``<data_dir>/<key>``, ``key`` hashing the
source, the tokenizer, the split, the Python version (for the Python sources) and the paths, sizes and
modification times of the files (for ``files``, for ``python-stdlib`` with a ``path`` and for the local files
of ``hf``); ``data_dir`` defaults to ``$ZOO_DATA_DIR`` or ``~/.cache/mixer-zoo/data``.

Documents are tokenised in parts of :data:`PART_DOCUMENTS`, by several worker processes (spawned: a script
that calls :func:`prepare` with ``workers > 1`` keeps its own work under ``if __name__ == "__main__":``); each finished
part is written (atomically) under ``parts/`` with a record of the documents it holds. A run that was
interrupted keeps its finished parts and tokenises only the rest; the token files and ``meta.json`` are
written last (``meta.json`` marks a finished folder, and a second run finds it and does nothing). Processes
that prepare one folder at once (every rank of ``torchrun``) take turns on a lock of the folder: the first
prepares it, the others find it finished. The output depends only on the source, the tokenizer and the
split: two runs give byte-identical files, whatever the number of workers.

``source: shards`` names a folder prepared elsewhere in this layout (``path``); it is checked, not
written.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm.auto import tqdm

from ..errors import UserError
from ..paths import probe_writable
from . import sources, stdlib
from .root import data_root
from .tokenize import make_tokenizer, token_dtype

PART_DOCUMENTS = 64
META = "meta.json"
SPLITS = ("train", "val")


def folder(o, tokenizer=None) -> Path:
    """Where the task options ``o`` are prepared (for ``shards``: ``o.path`` itself)."""
    if o.source == "shards":
        return Path(o.path).expanduser()
    tokenizer = tokenizer or make_tokenizer(o.tokenizer)
    what = {"source": sources.describe(o), "rules": sources.RULES_VERSION, "tokenizer": tokenizer.fingerprint(),
            "val_fraction": o.val_fraction,
            "max_documents": o.max_documents}
    if o.source.startswith("python-"):
        what["python"] = sys.version
    if o.source == "files":  # an edited corpus is prepared again, into its own folder
        what["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sources.corpus_files(o)]
    if o.source == "python-stdlib" and o.path:  # this interpreter's own library changes with sys.version
        what["files"] = stdlib.fingerprint(o)
    if o.source == "hf":  # local data files (a Hub dataset has none), less any prepared here under them
        root = data_root(o).expanduser().resolve()
        local = [p for p in sources.local_hf_files(o) if not p.resolve().is_relative_to(root)]
        if local:
            what["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in local]
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return data_root(o) / f"{o.source}-{key}"


def own_python(o) -> bool:
    """Whether the source is text of the running interpreter (its version is then the corpus's version)."""
    return o.source == "python-docs" or (o.source == "python-stdlib" and not o.path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    return make_tokenizer(name)


def _tokenize_part(job) -> tuple[int, dict]:
    """Tokenise one part's documents (runs in a worker process)."""
    index, docs, name, val_fraction = job
    tok = _tokenizer(name)
    dtype = token_dtype(tok.vocab_size)
    out = {s: [] for s in SPLITS}
    counts = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in SPLITS}
    for key, doc in docs:
        split = sources.split_of(key, doc, val_fraction)
        ids = tok.encode(doc) + [tok.eos_id]
        out[split].append(np.asarray(ids, dtype=dtype))
        counts[split]["documents"] += 1
        counts[split]["tokens"] += len(ids)
        counts[split]["bytes"] += len(doc)
    arrays = {s: (np.concatenate(v) if v else np.zeros(0, dtype)).tobytes() for s, v in out.items()}
    return index, {"arrays": arrays, "counts": counts}


def _parts(o) -> Iterator[tuple[int, list[tuple[bytes | None, bytes]], str]]:
    docs = sources.keyed_documents(o)
    for index in itertools.count():
        group = list(itertools.islice(docs, PART_DOCUMENTS))
        if not group:
            return
        digest = hashlib.sha256()
        for key, doc in group:
            if key is not None:  # a split key other than the document (a file's path): it decides the split
                digest.update(b"key" + len(key).to_bytes(8, "big") + key)
            digest.update(len(doc).to_bytes(8, "big") + doc)
        yield index, group, digest.hexdigest()


def _run_parts(o, parts_dir: Path, workers: int, progress: bool) -> tuple[list[dict], str]:
    """Tokenise every part not already finished; returns the part records in order and the source hash."""
    records, source_hash = {}, hashlib.sha256()

    def pending():
        for index, group, digest in _parts(o):
            source_hash.update(digest.encode())
            record = parts_dir / f"{index:05d}.json"
            if record.exists() and json.loads(record.read_text()).get("sha256") == digest:
                records[index] = json.loads(record.read_text())
                continue
            records[index] = {"sha256": digest}
            yield index, group, o.tokenizer, o.val_fraction

    bar = tqdm(desc="tokenising", unit=" parts", disable=None if progress else True, leave=False)
    # Workers are spawned, not forked: a forked worker inherits this process's signal handlers (a Python
    # SIGTERM handler that does not exit keeps it alive through terminate(), and the pool's join waits for
    # ever) and any lock another thread held at the fork (torch's, a tokenizer's thread pool).
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        done = pool.imap(_tokenize_part, pending()) if pool else map(_tokenize_part, pending())
        for index, result in done:
            for split in SPLITS:
                _write_atomic(parts_dir / f"{index:05d}.{split}.bin", result["arrays"][split])
            records[index]["counts"] = result["counts"]
            _write_atomic(parts_dir / f"{index:05d}.json", json.dumps(records[index], sort_keys=True).encode())
            bar.update(1)
    finally:
        bar.close()
        if pool:  # every result is in, or the run stops: close() would tokenise the rest of the source first
            pool.terminate()
            pool.join()
    return [records[i] for i in sorted(records)], source_hash.hexdigest()


def _concatenate(parts_dir: Path, out: Path, count: int, split: str) -> None:
    tmp = out / f".{split}.bin.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        for index in range(count):
            with open(parts_dir / f"{index:05d}.{split}.bin", "rb") as part:
                shutil.copyfileobj(part, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / f"{split}.bin")


def prepare(o, workers: int = 1, progress: bool = False) -> tuple[Path, bool]:
    """Prepare the task options ``o``'s data; returns its folder and whether anything was written."""
    if o.source == "shards":
        read_meta(folder(o), o)
        return folder(o), False
    tokenizer = make_tokenizer(o.tokenizer)
    out = folder(o, tokenizer)
    if (out / META).exists():
        return out, False
    probe_writable(out, "task.data_dir")
    out.mkdir(parents=True, exist_ok=True)
    lock = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing this folder (a torchrun rank) finishes first
        if (out / META).exists():
            return out, False
        for orphan in out.glob(".*.tmp"):  # left by a run stopped while it wrote the token files
            orphan.unlink()
        return _prepare_locked(o, tokenizer, out, workers, progress), True
    finally:
        os.close(lock)


def _prepare_locked(o, tokenizer, out: Path, workers: int, progress: bool) -> Path:
    parts_dir = out / "parts"
    parts_dir.mkdir(exist_ok=True)
    records, source_hash = _run_parts(o, parts_dir, workers, progress)
    totals = {s: {k: sum(r["counts"][s][k] for r in records) for k in ("documents", "tokens", "bytes")}
              for s in SPLITS}
    if not records or totals["train"]["documents"] == 0:
        raise UserError(f"source {sources.describe(o)!r}: no training documents (empty corpus?); check task.source "
                        f"and task.path")
    if totals["val"]["documents"] == 0:
        raise UserError(f"source {sources.describe(o)!r}: no document fell in the validation split "
                        f"({totals['train']['documents']} documents, val_fraction {o.val_fraction}); raise "
                        f"task.val_fraction or add documents")
    for split in SPLITS:
        _concatenate(parts_dir, out, len(records), split)
    meta = {"format": 1, "tokenizer": tokenizer.name, "tokenizer_fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name, "source": sources.describe(o),
            "source_hash": source_hash, "val_fraction": o.val_fraction,
            **({"python": platform.python_version()} if own_python(o) else {}),
            **{k: {s: totals[s][k] for s in SPLITS} for k in ("documents", "tokens", "bytes")}}
    _write_atomic(out / META, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
    shutil.rmtree(parts_dir)
    return out


def same_tokenizer(recorded: str, named: str) -> bool:
    """Whether the tokenizer a folder was prepared with is the one a task names: the same name, or two spellings
    of the same ``tokenizer.json`` file (``./tok.json`` and its absolute path share one prepared folder, whose name
    comes from the file's content)."""
    if recorded == named:
        return True
    try:
        return Path(recorded).is_file() and Path(named).is_file() and os.path.samefile(recorded, named)
    except OSError:
        return False


def read_meta(where: Path, o) -> dict:
    """The metadata of a prepared folder, checked against its token files and the task's tokenizer."""
    path = where / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        hint = "point task.path at a folder with meta.json, train.bin, val.bin" if o.source == "shards" else \
            "run zoo data prepare RECIPE"
        raise UserError(f"{path}: no prepared data here; {hint}") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable metadata ({type(err).__name__}); prepare the data again") from None
    need = ("vocab_size", "eos_id", "dtype", "tokenizer", "tokens")
    if not isinstance(meta, dict) or any(k not in meta for k in need):
        raise UserError(f"{path}: metadata lacks one of {', '.join(need)}")
    counts = meta["tokens"]
    if not (isinstance(counts, dict) and all(isinstance(counts.get(s), int) for s in SPLITS)
            and all(isinstance(meta[k], int) for k in ("vocab_size", "eos_id"))):
        raise UserError(f"{path}: vocab_size and eos_id must be integers and tokens the token counts "
                        f'{{"train": N, "val": N}}; fix it or prepare the data again')
    if not 0 <= meta["eos_id"] < meta["vocab_size"]:
        raise UserError(f"{path}: eos_id {meta['eos_id']} is not a token of a vocabulary of {meta['vocab_size']}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{path}: dtype {meta['dtype']!r}; token files are uint16 or uint32")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        raise UserError(f"{path}: a vocabulary of {meta['vocab_size']} tokens does not fit {meta['dtype']}; "
                        f"write the tokens as uint32")
    if not same_tokenizer(meta["tokenizer"], o.tokenizer):
        raise UserError(f"{path}: tokenised with {meta['tokenizer']!r} but the task names tokenizer {o.tokenizer!r}; "
                        f"set task.tokenizer: {meta['tokenizer']}")
    for split in SPLITS:
        file = where / f"{split}.bin"
        size = file.stat().st_size if file.exists() else -1
        if size != meta["tokens"][split] * np.dtype(meta["dtype"]).itemsize:
            raise UserError(f"{file}: missing or of the wrong size for {meta['tokens'][split]} tokens; prepare "
                            f"the data again")
    return meta
