"""Paths a user hands the zoo, checked before anything is read from or written to them.

- A recipe (the command's argument or an ``extends:`` base) must be a regular file of at most
  :data:`MAX_RECIPE_BYTES`: the type and size are read with ``stat`` before the file is opened, so a
  device (``/dev/zero``), a named pipe or a socket is refused at once instead of being read without
  end or blocking. The file is opened non-blocking and checked again on the open descriptor (it may
  have been replaced in between), and never more than the limit is read (``/proc`` files report size 0).
- A file that parses as YAML but is not a mapping of the recipe's sections (``/etc/shadow``, a
  credentials file) is refused naming the line of its first foreign key, and the key itself only when
  it looks like a name: its values and lines are never repeated in an error.
- Every folder a command writes into (``--out``, checkpoint and tracking folders, prepared data) is
  probed with :func:`probe_writable` before any work starts: a file is created, written and removed in
  it (or in its nearest existing parent), so ``/proc/...``, read-only mounts and full disks are one line
  rather than a traceback after training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import stat
from pathlib import Path

from mixers.options import nearest

from .config import RecipeConfig
from .errors import UserError

#: the largest recipe file read (a recipe is a few kB; anything near this is the wrong file)
MAX_RECIPE_BYTES = 1 << 20
#: top-level keys a recipe file may hold besides the sections of :class:`zoo.config.RecipeConfig` (the reader takes
#: them before validation), with how ``zoo list --options`` describes them
EXTRA_SECTIONS = {
    "extends": ("str", None, "a base recipe file, relative to this one, that this recipe overrides key by key (its "
                             "grid is not inherited)"),
    "imports": ("list[str]", [], "modules to import before the recipe is read, e.g. [my_pkg.my_mixer]: out-of-tree "
                                 "mixers, state mixers and tasks (importing runs their code)"),
}
#: a key that may be repeated in an error: a short name, not a line of some other file
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}\Z")
#: bytes written by the probe: enough that a full disk refuses it
_PROBE_BYTES = b"\0" * 4096


def recipe_sections() -> tuple[str, ...]:
    """The top-level keys of a recipe file."""
    return tuple(f.name for f in dataclasses.fields(RecipeConfig)) + tuple(EXTRA_SECTIONS)


def not_a_regular_file(st: os.stat_result, what: str, instead: str) -> str | None:
    """Why a file of this ``stat`` cannot be read as ``what`` (a folder, a pipe, a device: reading one could
    block or never end), saying to give ``instead``; None for a regular file."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return f"is a folder, not {what}"
    if not stat.S_ISREG(mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        return f"is {kind}, not {what}; give {instead}"
    return None


def _not_a_recipe_file(st: os.stat_result) -> str | None:
    """What is wrong with a file of this ``stat`` as a recipe, or None."""
    problem = not_a_regular_file(st, "a recipe file", "the path of a YAML file")
    if problem:
        return problem
    if st.st_size > MAX_RECIPE_BYTES:
        return _too_large(st.st_size)
    return None


def _too_large(size: int | None) -> str:
    amount = f"{size:,} bytes" if size is not None else "more than that"
    return (f"is {amount}, larger than the {MAX_RECIPE_BYTES / 2**20:g} MiB a recipe may be (a recipe is a few kB); "
            f"check the path")


def recipe_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a recipe file (missing, a folder, a device or pipe, too large), or None.
    Looks only at the file's ``stat``: nothing is opened."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "no such recipe file"
    except OSError as err:
        return f"cannot read: {err.strerror or type(err).__name__}"
    return _not_a_recipe_file(st)


def read_recipe_text(path: str | Path) -> str:
    """The text of the recipe file ``path``, refused in one line before it is read when it is not a
    regular file of at most :data:`MAX_RECIPE_BYTES`, or is not UTF-8."""
    problem = recipe_file_problem(path)
    if problem:
        raise UserError(f"{path}: {problem}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or type(err).__name__}") from None
    try:
        problem = _not_a_recipe_file(os.fstat(fd))  # the file opened, in case the path changed since the stat
        if problem:
            raise UserError(f"{path}: {problem}")
        chunks, size = [], 0
        while size <= MAX_RECIPE_BYTES:
            chunk = os.read(fd, MAX_RECIPE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or type(err).__name__}") from None
    finally:
        os.close(fd)
    if size > MAX_RECIPE_BYTES:  # a file that said it was smaller (a /proc file says 0) or grew meanwhile
        raise UserError(f"{path}: {_too_large(None)}")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8") from None


def refuse_foreign_keys(data: dict, node, path: str | Path) -> None:
    """Refuse a YAML mapping ``data`` (composed as ``node``) whose top-level keys are not all recipe
    sections: it is some other file, so the error names the line and, if it is a plain name, the key,
    never a value or the line's text."""
    sections = recipe_sections()
    lines: dict[str, int] = {}
    pairs = getattr(node, "value", ())  # a mapping node's (key, value) pairs; a null document is a scalar node
    for key_node, _ in pairs if isinstance(pairs, list) else ():
        lines.setdefault(str(key_node.value), key_node.start_mark.line + 1)
    for key in data:
        if key in sections:
            continue
        line = lines.get(str(key), lines.get("<<", 1))  # a key brought in by a merge (<<) points at the merge
        listed = ", ".join(sections)
        if isinstance(key, str) and _NAME.match(key):
            raise UserError(f"{path}:{line}: unknown recipe section {key!r}{nearest(key, sections)} (sections: {listed})")
        raise UserError(f"{path}:{line}: this key is not a recipe section ({listed}); is {path} a recipe file?")


def probe_writable(folder: str | Path, what: str) -> None:
    """Refuse, in one line, a ``folder`` that cannot be written: create, write and remove a small file in
    it, or in its nearest existing parent when it does not exist yet (the folder would be made there).
    ``what`` names where the folder came from (``--out``, ``train.tracking_dir``)."""
    folder = Path(folder)
    place = folder
    while True:
        try:
            st = os.stat(place)
            break
        except (FileNotFoundError, NotADirectoryError):
            if place.parent == place:
                raise UserError(f"{what} {folder}: no existing folder above it; choose another folder") from None
            place = place.parent
        except OSError as err:
            raise UserError(f"{what} {folder}: cannot use {place} ({err.strerror}); choose another folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {folder}: {place} is a file, not a folder; choose another folder")
    probe = place / f".zoo-write-probe.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        _write_probe(probe)
    except OSError as err:
        raise UserError(f"{what} {folder}: cannot write in {place} ({err.strerror or type(err).__name__}); "
                        f"choose a folder you can write to") from None


def _write_probe(probe: Path) -> None:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.write(fd, _PROBE_BYTES)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
