"""What a results row records about the code that computed it: the commit of the checkout when the code was
loaded, not the one HEAD has moved to by the time the row is written."""
import subprocess

from zoo import environment


def test_the_recorded_commit_is_the_one_read_when_the_code_was_loaded(monkeypatch):
    loaded = environment.environment()["versions"].get("git")
    moved = subprocess.CompletedProcess(args=[], returncode=0, stdout="0123abc\n", stderr="")
    monkeypatch.setattr(environment.subprocess, "run", lambda *a, **k: moved)  # HEAD moves on during a run
    assert environment.environment()["versions"].get("git") == loaded
    environment._git_commit.cache_clear()  # a new process would read the new commit
    assert environment.environment()["versions"]["git"] == "0123abc"
    environment._git_commit.cache_clear()
