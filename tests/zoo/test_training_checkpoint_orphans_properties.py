"""The temporary files of checkpoint writes (zoo.training.checkpoint.remove_orphans): a file left by a writer whose
process is gone is removed, while the file of a writer still running (this process) stays, so that a second run
starting in the same folder never pulls a checkpoint from under a write in progress."""
import os
import subprocess
import sys

from zoo.training import checkpoint as ckpt


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_the_temporary_files_of_finished_writers_are_removed(tmp_path):
    alive = tmp_path / f".{ckpt.FILENAME}.{os.getpid()}.tmp"
    gone = tmp_path / f".{ckpt.FILENAME}.{_gone_pid()}.tmp"
    other = tmp_path / "notes.tmp"
    for path in (alive, gone, other):
        path.write_bytes(os.urandom(16))
    assert ckpt.remove_orphans(tmp_path) == [gone]
    assert alive.exists() and other.exists() and not gone.exists()
