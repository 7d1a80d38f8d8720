"""Where the language-model task's documents come from, each yielded as ``bytes`` in a fixed order.

- ``python-docs`` (default, no download): the English help text of ``pydoc_data.topics`` that every
  Python installation ships (about 0.5 MB; it changes with the Python version, so every prepared file
  records its hash). In the order of the topic names, each topic's paragraphs (blocks between blank
  lines) are joined into documents of at least :data:`DOC_BYTES` bytes (a topic's last document may be
  shorter), so validation holds a few dozen documents rather than a few long topics.
- ``python-stdlib`` (no download): the standard library's own code, one document per ``.py`` file, tests,
  generated files and site-packages left out by the rule of :mod:`zoo.data.stdlib` (about 10 MB for
  CPython 3.11), in the order of the relative paths; ``path`` may name another root. Split by file.
- ``files``: the files matching ``path`` (a glob, ``**`` recursive; several separated by ``;``), read
  as bytes in the order of the sorted paths, less the folders prepared in ``data_dir``. The leading
  part of a glob that names an existing file or folder is read literally (a folder ``draft [v2]`` is that
  folder, not a glob class). A file is one document; with ``doc_separator`` set (e.g. ``"\\n\\n\\n"``), its
  non-empty pieces between separators are the documents.
- ``hf``: a Hugging Face dataset (``hf_dataset``, ``hf_config``, ``hf_split``, ``hf_text_field``; local
  data files with ``hf_data_files``), streamed with ``datasets`` (``pip install 'mixer-zoo[lm]'``); a
  record whose text is missing (null) or empty is an empty document, left out. Local files it reads
  (``hf_data_files``, a local ``hf_dataset``) are fingerprinted like those of ``files``, so an edited one is
  prepared again.
- ``shards``: tokens prepared elsewhere (:mod:`zoo.data.prepare` reads ``path`` directly; no documents).

``max_documents`` (0: no bound) bounds every source but ``shards`` alike, counting the documents prepared: the
first ``max_documents`` non-empty documents in the order above. An empty document (an empty file, an ``hf``
record whose text is null or empty) is left out and not counted, so a bound of N gives N documents whenever the
source holds that many; the source is not read past the N-th (no later ``hf`` record is asked for).

Split: a document goes to validation when the first 8 bytes of the SHA-256 of its split key, read as a
fraction of 2^64, fall below ``val_fraction``; so the split is deterministic and independent of the order
of the documents. The split key is the document itself (two identical documents land on the same side:
train and validation share no document), except for ``python-stdlib``, whose key is the file's relative
path (train and validation share no file, and an edited file keeps its side).
"""
from __future__ import annotations

import glob
import hashlib
import os
import pydoc_data.topics
import re
from pathlib import Path
from typing import Iterator

from ..errors import UserError
from . import stdlib
from .root import data_root

#: the version of the rules above (how sources become documents): part of a prepared folder's key
RULES_VERSION = 2
#: python-docs: the least bytes of a document (paragraphs of a topic are joined up to it)
DOC_BYTES = 2000
SOURCES = ("python-docs", "python-stdlib", "files", "hf", "shards")


def is_validation(split_key: bytes, val_fraction: float) -> bool:
    """Whether the document with this split key (see above) belongs to the validation split."""
    return int.from_bytes(hashlib.sha256(split_key).digest()[:8], "big") < val_fraction * 2.0 ** 64


def _python_docs() -> Iterator[bytes]:
    topics = pydoc_data.topics.topics
    for name in sorted(topics):
        doc = b""
        for paragraph in topics[name].encode("utf-8").split(b"\n\n"):
            doc = doc + b"\n\n" + paragraph if doc else paragraph
            if len(doc) >= DOC_BYTES:
                yield doc
                doc = b""
        if doc:
            yield doc


def literal_prefix_glob(part: str) -> str:
    """``part`` as a glob whose longest leading run of path components that exists on disk is taken literally: a
    folder or file named ``draft [v2]`` is that folder or file, not the glob class ``[v2]``; the rest keeps its glob
    meaning (``draft [v2]/*.txt``)."""
    text = os.path.expanduser(part)
    components = text.split(os.sep)
    for n in range(len(components), 0, -1):
        head = os.sep.join(components[:n])
        if head and os.path.lexists(head):
            return glob.escape(head) + text[len(head):]
    return text


def matching_files(pattern: str) -> list[Path]:
    """The files ``task.path`` names (globs separated by ``;``), sorted; a part naming no file is refused."""
    parts = [p.strip() for p in pattern.split(";") if p.strip()]
    if not parts:
        raise UserError("task.path is empty: source 'files' needs a glob of text files, e.g. path: 'corpus/**/*.txt'")
    paths = set()
    for part in parts:
        found = [Path(p) for p in glob.glob(literal_prefix_glob(part), recursive=True)]
        if not any(p.is_file() for p in found):
            raise UserError(f"task.path: no file matches {part!r}; check the path (globs: *, **)")
        paths |= {p for p in found if p.is_file()}
    return sorted(paths)


def prepared_folder_name(name: str) -> bool:
    """Whether a folder name is one :func:`zoo.data.prepare.folder` gives a prepared source (``files-<16 hex>``)."""
    return re.fullmatch(rf"(?:{'|'.join(map(re.escape, SOURCES))})-[0-9a-f]{{16}}", name) is not None


def corpus_files(o) -> list[Path]:
    """The files the ``files`` source reads: those ``task.path`` matches, less any inside a prepared folder of the
    prepared-data folder (a glob such as ``notes/**/*`` around ``task.data_dir`` would otherwise read the token
    files it prepared as text, and prepare again, into a new folder, at every run)."""
    root = data_root(o).expanduser().resolve()

    def prepared(path: Path) -> bool:
        path = path.resolve()
        return path.is_relative_to(root) and len(inside := path.relative_to(root).parts) > 1 \
            and prepared_folder_name(inside[0])

    matched = matching_files(o.path)
    kept = [p for p in matched if not prepared(p)]
    if not kept:
        raise UserError(f"task.path: every file {o.path!r} matches is prepared data under {root} (task.data_dir): "
                        f"token files, not text; point task.path at the corpus")
    return kept


def local_hf_files(o) -> list[Path]:
    """The local files an ``hf`` source reads, sorted: those ``hf_data_files`` matches (a path or a glob) and, when
    ``hf_dataset`` names a local file or folder, that file or every file under that folder; none for a dataset
    of the Hub."""
    found = set()
    if o.hf_data_files:
        found |= {Path(p) for p in glob.glob(str(Path(o.hf_data_files).expanduser()), recursive=True)}
    dataset = Path(o.hf_dataset).expanduser() if o.hf_dataset else None
    if dataset is not None and dataset.is_dir():
        found |= set(dataset.rglob("*"))
    elif dataset is not None and dataset.is_file():
        found.add(dataset)
    return sorted(p for p in found if p.is_file())


def _files(paths: list[Path], separator: str) -> Iterator[bytes]:
    sep = separator.encode("utf-8")
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise UserError(f"task.path: cannot read {path}: {err.strerror}") from None
        yield from (piece for piece in data.split(sep) if piece.strip()) if sep else [data]


def _hf(o) -> Iterator[bytes]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"source 'hf' ({o.hf_dataset!r}) needs the Hugging Face datasets library: "
                        f"pip install 'mixer-zoo[lm]'") from None
    if not o.hf_dataset:
        raise UserError("task.hf_dataset is empty: name a dataset, e.g. HuggingFaceFW/fineweb-edu")
    kwargs = {"data_files": o.hf_data_files} if o.hf_data_files else {}
    try:
        data = datasets.load_dataset(o.hf_dataset, o.hf_config or None, split=o.hf_split, streaming=True, **kwargs)
        for i, record in enumerate(data):  # max_documents counts the documents: keyed_documents bounds them
            if o.hf_text_field not in record:
                raise UserError(f"task.hf_text_field: {o.hf_dataset} has no field {o.hf_text_field!r} "
                                f"(fields: {', '.join(record)})")
            text = record[o.hf_text_field]
            if text is None:  # a missing value is no text (an empty document, left out), never the word "None"
                text = ""
            if not isinstance(text, str):
                raise UserError(f"task.hf_text_field: the field {o.hf_text_field!r} of {o.hf_dataset} holds "
                                f"{type(text).__name__}, not text (record {i}); name a field of strings")
            yield text.encode("utf-8")
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing dataset, no network, a bad config: one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"source hf {o.hf_dataset!r}: cannot stream it ({type(err).__name__}: {text[:200]})") from None


def _keyed(o) -> Iterator[tuple[bytes | None, bytes]]:
    if o.source == "python-stdlib":
        return stdlib.keyed_documents(o)
    if o.source == "python-docs":
        raw = _python_docs()
    elif o.source == "files":
        raw = _files(corpus_files(o), o.doc_separator)
    elif o.source == "hf":
        raw = _hf(o)
    else:
        raise UserError(f"source {o.source!r} has no documents to read (shards are already tokenised)")
    return ((None, doc) for doc in raw)


def keyed_documents(o) -> Iterator[tuple[bytes | None, bytes]]:
    """``(split key, document)`` for the non-empty documents of the task options ``o``'s source, in their
    fixed order, the first ``o.max_documents`` of them when that is set (empty ones are not counted); the key is
    None where the document is its own split key. The source is not read past the last document given."""
    count = 0
    for key, doc in _keyed(o):
        if not doc:
            continue
        yield key, doc
        count += 1
        if o.max_documents and count >= o.max_documents:
            return


def documents(o) -> Iterator[bytes]:
    """The non-empty documents of the task options ``o``'s source, in their fixed order."""
    return (doc for _key, doc in keyed_documents(o))


def split_of(key: bytes | None, doc: bytes, val_fraction: float) -> str:
    """``"val"`` or ``"train"``: the split of a document given with its split key (None: the document)."""
    return "val" if is_validation(doc if key is None else key, val_fraction) else "train"


def describe(o) -> str:
    """The source in words, for the prepared data's metadata."""
    if o.source == "files":
        return f"files {o.path}" + (f" split at {o.doc_separator!r}" if o.doc_separator else "")
    if o.source == "hf":
        described = f"hf {o.hf_dataset} {o.hf_config} {o.hf_split} {o.hf_text_field} {o.hf_data_files}".strip()
        # with the bound said here, a folder prepared when it counted records (empty ones too) is not reused
        return described + (f", first {o.max_documents} non-empty documents" if o.max_documents else "")
    if o.source == "python-stdlib" and o.path:
        return f"python-stdlib {o.path}"
    return o.source
