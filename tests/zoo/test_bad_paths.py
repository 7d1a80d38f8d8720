"""Hostile or mistaken paths: recipes that are devices, pipes or huge files are refused before they are
opened; files that are not recipes never have a value or a line repeated in an error; every folder a
command writes into is probed before any work starts. Each ends with one line and exit code 2."""
from __future__ import annotations

import builtins
import errno
import io
import os
import random
import signal
import socket
import stat
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import zoo
import zoo.paths
from tests.zoo.cli_errors import one_line_error
from zoo.errors import UserError
from zoo.paths import MAX_RECIPE_BYTES, probe_writable
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
HAS_PROC = Path("/proc/self/status").is_file()
needs_proc = pytest.mark.skipif(not HAS_PROC, reason="no /proc file system here")
FAST = ["train.steps=2", "train.warmup_steps=0", "--no-progress"]


def _secret(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(24))


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


@pytest.fixture
def never_opened(monkeypatch):
    """Paths added to the returned set make any attempt to open them fail the test (os.open, open, io.open)."""
    forbidden: set[Path] = set()

    def guard(opener):
        def guarded(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)) and Path(os.fsdecode(file)).absolute() in forbidden:
                raise AssertionError(f"{file} was opened")
            return opener(file, *args, **kwargs)
        return guarded

    monkeypatch.setattr(os, "open", guard(os.open))
    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    return forbidden


@pytest.fixture
def alarm():
    """A FIFO opened by mistake would block forever: fail the test instead."""
    def _raise(signum, frame):
        raise AssertionError("blocked: the recipe was opened")
    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------ recipe files
def _not_regular_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.yaml"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    found = {"named pipe": fifo, "socket": sock_path, "folder": folder}
    if Path("/dev/zero").exists():
        found["character device"] = Path("/dev/zero")
    return found


def test_a_recipe_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path, capsys, never_opened, alarm):
    for words, path in _not_regular_files(tmp_path).items():
        never_opened.add(path.absolute())
        err = one_line_error(capsys, "check", path)
        assert f"{path}: is a {words}" in err, err
        child = tmp_path / f"extends_{path.stem}.yaml"
        child.write_text(f"# a recipe on an existing base\nextends: {path}\n")
        err = one_line_error(capsys, "check", child)
        assert f"{child}:2: extends: {path}: is a {words}" in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_fifo_as_the_recipe_argument_does_not_block_the_command(tmp_path):
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    try:  # the timeout only turns a hang into a failure
        out = subprocess.run([sys.executable, "-m", "zoo", "check", str(fifo)], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail("zoo check on a named pipe blocked")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "named pipe" in out.stderr and "Traceback" not in out.stderr


def test_a_checkpoint_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, capsys, never_opened, alarm):
    """zoo eval and zoo generate read a checkpoint with torch.load: a pipe would block it, /dev/zero never end it."""
    for words, path in _not_regular_files(tmp_path).items():
        if words == "folder":  # a folder is a run folder: its checkpoint.pt is missing, said in one line
            continue
        never_opened.add(path.absolute())
        for argv in (["eval", path], ["generate", path, "--prompt", "x"]):
            err = one_line_error(capsys, *argv)
            assert f"{path}: is a {words}" in err and "not a checkpoint" in err, err

def _padded(text: str, size: int) -> bytes:
    """``text`` followed by comment lines, exactly ``size`` bytes."""
    body = text.encode()
    filler = size - len(body)
    lines, left = [], filler
    while left > 0:
        n = min(left, 100)
        lines.append(b"#" * (n - 1) + b"\n" if n > 1 else b"\n")
        left -= n
    out = body + b"".join(lines)
    assert len(out) == size
    return out


def test_a_recipe_over_the_size_limit_is_refused_unread_and_one_at_the_limit_is_read(tmp_path, capsys, never_opened,
                                                                                   rng):
    at_limit = tmp_path / "at_limit.yaml"
    at_limit.write_bytes(_padded(TINY.read_text(), MAX_RECIPE_BYTES))
    assert resolve(at_limit).key == resolve(TINY).key
    over = tmp_path / "over.yaml"
    over.write_bytes(_padded(TINY.read_text(), MAX_RECIPE_BYTES + 1))
    sparse = tmp_path / "sparse.yaml"  # a huge file made in no time: its size is all the check may look at
    with open(sparse, "wb") as fh:
        fh.truncate(rng.randrange(MAX_RECIPE_BYTES + 2, 1 << 34))
    for path in (over, sparse):
        never_opened.add(path.absolute())
        err = one_line_error(capsys, "check", path)
        assert f"{path}: is {path.stat().st_size:,} bytes, larger than the 1 MiB" in err, err
        child = tmp_path / "child.yaml"
        child.write_text(f"extends: {path.name}\n")
        assert f"{child}:1: extends: {path}: is {path.stat().st_size:,} bytes" in one_line_error(capsys, "check", child)


@needs_proc
def test_a_file_that_reports_a_wrong_size_is_read_no_further_than_the_limit(tmp_path, monkeypatch):
    proc_file = Path("/proc/self/status")  # a regular file whose stat says 0 bytes
    assert proc_file.stat().st_size == 0 and len(proc_file.read_bytes()) > 40
    monkeypatch.setattr(zoo.paths, "MAX_RECIPE_BYTES", 40)
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(UserError, match="larger than the"):
        zoo.paths.read_recipe_text(proc_file)
    assert sum(reads) <= 41


# ------------------------------------------------------------------------------------ files that are not recipes
def _shadow_like(rng: random.Random, users: int) -> tuple[str, list[str]]:
    secrets = [_secret(rng) for _ in range(users)]
    lines = [f"{rng.choice(['root', 'daemon', 'bin', 'sys'])}{i}:$6${s}:20228:0:99999:7:::" for i, s in enumerate(secrets)]
    return "\n".join(lines) + "\n", secrets


def test_extending_a_password_file_never_prints_its_lines(tmp_path, capsys, rng):
    text, secrets = _shadow_like(rng, rng.randint(1, 5))
    shadow = tmp_path / "shadow"
    shadow.write_text(text)
    assert isinstance(yaml.safe_load(text), dict)  # it parses as a mapping, so only the key check stops it
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {shadow}\n" + TINY.read_text())
    for target in (recipe, shadow):
        err = one_line_error(capsys, "check", target)
        assert f"{shadow}:1: this key is not a recipe section" in err, err
        assert not any(s in err for s in secrets) and not any(line[:8] in err for line in text.splitlines()), err


@pytest.mark.skipif(not os.access("/etc/shadow", os.R_OK), reason="/etc/shadow is not readable here")
def test_extends_etc_shadow_prints_none_of_it(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: /etc/shadow\n")
    err = one_line_error(capsys, "check", recipe)
    lines = [line.rstrip(":") for line in Path("/etc/shadow").read_text().splitlines() if line.strip()]
    assert "/etc/shadow" in err and not any(line in err for line in lines), err
    assert not any(part in err for line in lines for part in line.split(":")[1:] if len(part) > 6), err


def test_a_yaml_file_of_other_keys_names_the_key_and_line_never_a_value(tmp_path, capsys, rng):
    """A credentials file: the first key that is no recipe section is named with its line; no value, even
    of keys that are sections (model: <secret> above it), appears."""
    secrets = [_secret(rng) for _ in range(4)]
    entries = [f"model: {secrets[0]}", f"train: [{secrets[1]}]", f"description: {secrets[2]}"]
    rng.shuffle(entries)
    at = rng.randrange(len(entries) + 1)
    entries.insert(at, f"api_token: {secrets[3]}")
    base = tmp_path / "credentials.yaml"
    base.write_text("\n".join(entries) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {base.name}\n")
    err = one_line_error(capsys, "check", recipe)
    assert f"{base}:{at + 1}: unknown recipe section 'api_token'" in err, err
    assert not any(s in err for s in secrets), err
    key = f"sk-{secrets[0]} token"  # a key that is not a plain name is not repeated either
    base.write_text(f"seed: 1\n{key}: 1\n")
    err = one_line_error(capsys, "check", recipe)
    assert f"{base}:2: this key is not a recipe section" in err and secrets[0] not in err, err
    base.write_text(f"<<: {{api_token: {secrets[1]}}}\nseed: 1\n")  # a key brought in by a merge
    err = one_line_error(capsys, "check", recipe)
    assert f"{base}:1: unknown recipe section 'api_token'" in err and secrets[1] not in err, err
    for text in (f"- {secrets[2]}\n- {secrets[3]}\n", f"{secrets[2]}\n"):  # not a mapping at all
        base.write_text(text)
        err = one_line_error(capsys, "check", recipe)
        assert "must be a mapping of sections" in err and not any(s in err for s in secrets), err


def test_a_misspelt_section_still_gets_a_suggestion(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY.read_text().replace("\ntrain:", "\ntrian:"))
    line = recipe.read_text().splitlines().index(next(l for l in recipe.read_text().splitlines() if l.startswith("trian")))
    err = one_line_error(capsys, "check", recipe)
    assert f"{recipe}:{line + 1}: unknown recipe section 'trian'; did you mean 'train'?" in err, err


# ------------------------------------------------------------------------------------ output folders
@pytest.fixture
def nothing_trains(monkeypatch):
    """Building a model for training fails the test: a refusal must come before."""
    from zoo.training import loop

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for training")
    monkeypatch.setattr(loop.HybridLM, "from_recipe", refuse)


def _lm_recipe(tmp_path: Path, data_dir: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(3):
        (corpus / f"{i}.txt").write_text("\n\n".join(f"document {i}.{j} of the corpus" for j in range(12)))
    recipe = tmp_path / "lm.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"d_model": 16, "layers": ["gla"]},
                                      "task": {"name": "lm", "source": "files", "path": str(corpus / "*.txt"),
                                               "doc_separator": "\n\n", "val_fraction": 0.3, "seq_len": 16,
                                               "num_test": 4, "data_dir": str(data_dir)},
                                      "train": {"steps": 2, "batch_size": 2, "warmup_steps": 0}}))
    return recipe


def _every_writer(tmp_path: Path, folder: Path, rng: random.Random) -> list[tuple[str, list]]:
    """(what the error names, argv) for every command that writes into ``folder`` (or a new folder in it)."""
    target = folder / f"zoo_out_{rng.randrange(10**9)}" if rng.random() < 0.5 else folder
    return [
        ("--out", ["train", TINY, "--out", target, *FAST]),
        ("train.tracking_dir", ["train", TINY, "train.tracking=tensorboard", f"train.tracking_dir={target}", *FAST]),
        ("--out", ["ablate", TINY, "--out", target, "--no-plot", *FAST]),
        ("train.tracking_dir", ["ablate", TINY, "--out", tmp_path / f"ablation{rng.randrange(10**9)}", "--no-plot",
                                "train.tracking=tensorboard", f"train.tracking_dir={target}", *FAST]),
        ("--out", ["eval", tmp_path / "run", "--out", target]),
        ("--out", ["bench", "--mixers", "attention", "--seq-lens", "8", "--repeats", "1", "--out", target,
                   "--no-progress", "--no-plot"]),
        ("task.data_dir", ["data", "prepare", _lm_recipe(tmp_path, target), "--workers", "1", "--no-progress"]),
    ]


@needs_proc
def test_output_folders_under_proc_are_refused_before_anything_trains(tmp_path, capsys, nothing_trains, rng):
    for what, argv in _every_writer(tmp_path, Path("/proc"), rng):
        err = one_line_error(capsys, *argv)
        assert f"{what} /proc" in err and "cannot write in /proc" in err, (argv, err)
    with pytest.raises(UserError, match="checkpoint folder /proc/zoo_out: cannot write in /proc"):
        zoo.train(resolve(TINY), progress=False, checkpoint_dir="/proc/zoo_out")  # the Python API too


class _FailingWrites:
    """Writes into ``folder`` fail with ``code``: creating a file there (EROFS, EACCES), or, for ENOSPC,
    writing to a file created there (as on a full disk, where the file is made but takes no bytes)."""

    def __init__(self, monkeypatch, folder: Path, code: int):
        self.folder, self.code, self.fds = folder.resolve(), code, set()
        self.real_open, self.real_write = os.open, os.write
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "write", self.write)

    def open(self, path, flags, *args, **kwargs):
        inside = self.folder in Path(os.fsdecode(path)).resolve().parents
        if inside and flags & os.O_CREAT and self.code != errno.ENOSPC:
            raise OSError(self.code, os.strerror(self.code), os.fsdecode(path))
        fd = self.real_open(path, flags, *args, **kwargs)
        if inside:
            self.fds.add(fd)
        return fd

    def write(self, fd, data):
        if fd in self.fds:
            self.fds.discard(fd)
            raise OSError(self.code, os.strerror(self.code))
        return self.real_write(fd, data)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_folder_whose_writes_fail_is_refused_before_anything_trains(tmp_path, capsys, monkeypatch, nothing_trains,
                                                                      rng, code):
    folder = tmp_path / "failing"
    folder.mkdir()
    writers = _every_writer(tmp_path, folder, rng)
    _FailingWrites(monkeypatch, folder, code)
    for what, argv in writers:
        err = one_line_error(capsys, *argv)
        assert f"{what} {folder}" in err and f"cannot write in {folder} ({os.strerror(code)})" in err, (argv, err)
    assert not any(folder.iterdir()), "the probe left a file behind"


def test_an_ablation_whose_checkpoint_folder_fails_is_refused_before_the_first_cell(tmp_path, capsys, monkeypatch,
                                                                                    nothing_trains):
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"  # kept from an earlier run, on a disk that is now full
    checkpoints.mkdir(parents=True)
    _FailingWrites(monkeypatch, checkpoints, errno.ENOSPC)
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {TINY}\ngrid:\n  train.lr: [1.0e-3, 2.0e-3]\n")
    err = one_line_error(capsys, "ablate", recipe, "--out", out, "--no-plot", *FAST)
    assert f"checkpoint folder {checkpoints}/" in err and f"cannot write in {checkpoints} (" in err, err
    assert not any(checkpoints.iterdir()) and not (out / "results.jsonl").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="file modes do not stop root's writes")
def test_a_read_only_folder_is_refused(tmp_path, capsys, nothing_trains, rng):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        for what, argv in _every_writer(tmp_path, folder, rng):
            err = one_line_error(capsys, *argv)
            assert f"{what} {folder}" in err and ("cannot write in" in err or "not writable" in err), (argv, err)
    finally:
        folder.chmod(stat.S_IRWXU)


def test_the_probe_leaves_nothing_behind_and_refuses_a_file(tmp_path, rng):
    folder = tmp_path / "out"
    folder.mkdir()
    deep = folder / "a" / "b"
    for target in (folder, deep):
        probe_writable(target, "--out")
    assert list(folder.iterdir()) == [], "the probe left something behind"
    a_file = folder / f"file{rng.randrange(100)}"
    a_file.write_text("x")
    for target in (a_file, a_file / "sub"):
        with pytest.raises(UserError, match=f"--out {target}: {a_file} is a file, not a folder"):
            probe_writable(target, "--out")
