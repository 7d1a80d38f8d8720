"""A long run on a shared machine, stopped from outside and resumed as the README says: a scheduler's SIGTERM stops
``zoo train`` and ``zoo ablate`` the way a Ctrl-C does, with a line saying where the run stopped, what its checkpoint
holds and how to resume, and the resumed run ends with the numbers of an uninterrupted one; a stop during the final
evaluation keeps the whole training; a checkpoint that cannot be written (a full disk) stops the run in one line
that keeps the checkpoint before it; a row that cannot be appended keeps the cell's trained model."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo import train
from zoo.cli import main
from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.rows import read_rows
from zoo.training import checkpoint as ckpt
from zoo.training import loop
from zoo.training.stopping import Terminated

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("steps", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_sequence_accuracy")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _zoo(*args) -> subprocess.Popen:
    # SIGINT at its default in the child (a test run in the background ignores it, and the child would inherit that)
    return subprocess.Popen([sys.executable, "-m", "zoo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.01)


def _stop_line(stderr: str, how: str) -> re.Match:
    found = re.search(rf"stopped by {how} at step (\d+)/(\d+); (\S+) holds step (\d+)", stderr)
    assert found, stderr
    return found


@pytest.mark.slow
def test_sigterm_stops_zoo_train_in_lines_that_say_where_and_the_same_command_resumes_it_exactly(tmp_path):
    steps = int(torch.randint(250, 300, ()))
    overrides = [f"train.steps={steps}", "train.checkpoint_every=20", "train.eval_every=60", "train.threads=1",
                 f"seed={int(torch.randint(0, 1000, ()))}"]
    out = tmp_path / "run"
    command = ["train", str(TINY), "--out", str(out), "--json", "--no-progress", *overrides]
    proc = _zoo(*command)
    _wait_for(out / ckpt.FILENAME, proc)
    time.sleep(float(torch.rand(())) * 0.3)  # anywhere in the steps after the first checkpoint
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, stderr)  # stopped, and not silently
    assert "Traceback" not in stderr and stdout == "", stderr
    said = _stop_line(stderr, "SIGTERM")
    saved = ckpt.load(out / ckpt.FILENAME)
    assert Path(said.group(3)) == out / ckpt.FILENAME and int(said.group(4)) == saved["step"], stderr
    assert saved["step"] <= int(said.group(1)) < steps == int(said.group(2)) and not saved["finished"], stderr
    assert "run the same command again to resume" in stderr, stderr
    assert not list(out.glob(".checkpoint.pt.*.tmp")) and not (out / "results.jsonl").exists()

    again = _zoo(*command)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert f"resuming from {out / ckpt.FILENAME} at step {saved['step']}/{steps}" in stderr, stderr
    resumed = json.loads(stdout)["metrics"]
    uninterrupted = train(resolve(TINY, overrides), progress=False)
    for key in COMPARED:
        assert resumed[key] == uninterrupted.metrics[key], (key, resumed[key], uninterrupted.metrics[key])
    final = ckpt.load(out / ckpt.FILENAME)
    assert final["history"] == uninterrupted.history
    for name, tensor in uninterrupted.model.state_dict().items():
        assert torch.equal(final["model"][name], tensor), name


@pytest.mark.slow
def test_sigterm_between_the_cells_of_an_ablation_stops_it_like_ctrl_c_and_the_same_command_finishes_it(tmp_path):
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(TINY.read_text() + f"""imports: [tests.zoo.ray_hooks]
grid:
  - {{label: first, train.lr: 0.002}}
  - {{label: second, train.lr: 0.004, description: 'wait-for:{tmp_path / "release"}'}}
""")
    out = tmp_path / "out"
    command = ["ablate", str(recipe), "--out", str(out), "--no-progress", "--no-plot"]
    proc = _zoo(*command)
    _wait_for(out / "results.jsonl", proc)  # the first cell's row: the second waits for its release
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, stdout, stderr)
    assert "zoo: stopped by SIGTERM; run the same command again" in stderr, stderr
    assert "Traceback" not in stderr and "run the same command again to resume" in stderr, stderr
    assert [r["label"] for r in read_rows(out / "results.jsonl")] == ["first"]

    (tmp_path / "release").touch()
    again = _zoo(*command)  # the lock was released: the same command runs at once
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "[1/2] first: done already, skipped" in stdout, stdout
    assert sorted(r["label"] for r in read_rows(out / "results.jsonl")) == ["first", "second"]


REAL_STEP = loop._step


def _interrupt_at_step(monkeypatch, at: int) -> None:
    """A Ctrl-C while the ``at``-th step of this process is queued."""
    real, calls = REAL_STEP, []

    def step(*args):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(loop, "_step", step)


def test_a_stop_names_the_step_and_what_the_checkpoint_holds(tmp_path, monkeypatch, capsys):
    every = int(torch.randint(3, 6, ()))
    recipe = resolve(TINY, ["train.steps=30", f"train.checkpoint_every={every}", "train.threads=1"])
    at = int(torch.randint(every + 2, 25, ()))
    _interrupt_at_step(monkeypatch, at)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False, checkpoint_dir=tmp_path)
    said = _stop_line(capsys.readouterr().err, "Ctrl-C")
    saved = ckpt.load(tmp_path / ckpt.FILENAME)
    # steps 1 .. at - 2 are recorded when step at is queued (the step before it is read after that one is queued)
    stopped_at = int(said.group(1))
    assert stopped_at in (at - 1, at - 2) and int(said.group(4)) == saved["step"] == stopped_at // every * every

    _interrupt_at_step(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False, checkpoint_dir=tmp_path / "fresh")
    assert re.search(rf"stopped by Ctrl-C at step [01]/30; nothing saved yet \(the first checkpoint comes at step "
                     rf"{every}\)", capsys.readouterr().err)
    _interrupt_at_step(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    assert re.search(r"stopped by Ctrl-C at step [01]/30; nothing saved \(no checkpoint folder", capsys.readouterr().err)


# needs, in tests/zoo/test_training_checkpoint_clock_properties.py, the extra write before the final evaluation in its
# list of writes: `assert writes == [k for k in range(every, steps, every)] + [steps, steps]`
def test_a_stop_during_the_final_evaluation_keeps_the_whole_training(tmp_path, monkeypatch, capsys):
    steps = int(torch.randint(12, 20, ()))
    recipe = resolve(TINY, [f"train.steps={steps}", "train.checkpoint_every=5", "train.threads=1",
                            f"seed={int(torch.randint(0, 1000, ()))}"])
    real = loop.test_metrics

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "test_metrics", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False, checkpoint_dir=tmp_path)
    assert f"stopped by Ctrl-C during the final evaluation, after step {steps}/{steps}" in capsys.readouterr().err
    monkeypatch.setattr(loop, "test_metrics", real)
    resumed = train(recipe, progress=False, checkpoint_dir=tmp_path)
    assert f"at step {steps}/{steps} (finished)" in capsys.readouterr().err  # evaluated again, not trained again
    uninterrupted = train(recipe, progress=False)
    for key in COMPARED:
        assert resumed.metrics[key] == uninterrupted.metrics[key], key
    assert ckpt.load(tmp_path / ckpt.FILENAME)["metrics"]["test_loss"] == uninterrupted.metrics["test_loss"]


def _disk_full():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullDisk:
    """``open`` of the checkpoint module on a disk of ``capacity`` bytes, which the files of the folder written
    into already fill in part: a write past what is left raises ``error()`` (a full disk's OSError, or the stop a
    signal arriving at that moment raises)."""

    def __init__(self, capacity: int, error=_disk_full):
        self.capacity, self.real, self.error = capacity, open, error

    def __call__(self, path, mode="r", *args, **kwargs):
        fh = self.real(path, mode, *args, **kwargs)
        if "w" not in mode:
            return fh
        room = self.capacity - sum(f.stat().st_size for f in Path(path).parent.iterdir() if f.is_file())
        write = fh.write

        def write_until_full(data):
            if fh.tell() + len(data) > room:
                raise self.error()
            return write(data)
        fh.write = write_until_full
        return fh


def test_a_full_disk_at_a_checkpoint_stops_in_one_line_and_keeps_the_checkpoint_before(tmp_path, monkeypatch,
                                                                                          capsys):
    every = int(torch.randint(3, 6, ()))
    overrides = ["train.steps=20", f"train.checkpoint_every={every}"]
    train(resolve(TINY, overrides), progress=False, checkpoint_dir=tmp_path / "size")
    size = (tmp_path / "size" / ckpt.FILENAME).stat().st_size
    # room for the first checkpoint, not for the second beside it
    monkeypatch.setattr(ckpt, "open", _FullDisk(int(size * 1.5)), raising=False)
    out = tmp_path / "run"
    assert main(["train", str(TINY), "--out", str(out), "--no-progress", *overrides]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("zoo: error: "), err
    assert str(out / ckpt.FILENAME) in last and "No space left on device" in last, err
    assert f"holds step {every}" in last, err  # what is kept, where the same command resumes
    kept = ckpt.load(out / ckpt.FILENAME)
    assert kept["step"] == every and not kept["finished"]
    assert [f.name for f in out.iterdir()] == [ckpt.FILENAME]  # no temporary file left behind


def test_a_row_that_cannot_be_appended_stops_the_ablation_in_one_line_and_keeps_the_trained_cell(tmp_path,
                                                                                                  monkeypatch, capsys):
    from zoo.experiments import ablate
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {TINY}\ngrid:\n  - {{label: a, train.lr: 0.002}}\n  - {{label: b, train.lr: 0.003}}\n")
    args = ["ablate", str(recipe), "--out", str(tmp_path / "out"), "--no-progress", "--no-plot"]

    def full(path, row):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(ablate, "append_row", full)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "No space left on device" in err and "results.jsonl" in err and "'a'" in err, err
    monkeypatch.undo()
    trained = resolve(recipe).cells[0].recipe
    assert ckpt.load(tmp_path / "out" / "checkpoints" / trained.key / ckpt.FILENAME)["finished"]
    assert main(args) == 0
    assert f"at step {trained.train.steps}/{trained.train.steps} (finished)" in capsys.readouterr().err  # not retrained
    assert [r["label"] for r in read_rows(tmp_path / "out" / "results.jsonl")] == ["a", "b"]


def test_user_error_is_what_a_failed_checkpoint_write_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "open", _FullDisk(0), raising=False)
    with pytest.raises(UserError, match="No space left on device"):
        ckpt.save(tmp_path / ckpt.FILENAME, {"step": 3, "model": {"w": torch.randn(64)}})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_stop_while_a_checkpoint_is_written_is_a_stop_and_keeps_the_checkpoint_before(tmp_path, monkeypatch, capsys,
                                                                                       stop):
    """torch's writer turns what its file's write raises into a RuntimeError of its own: a Ctrl-C or a SIGTERM
    arriving mid-write must still stop the run as one, not end it as a failed write."""
    every = int(torch.randint(3, 6, ()))
    recipe = resolve(TINY, ["train.steps=20", f"train.checkpoint_every={every}"])
    train(recipe, progress=False, checkpoint_dir=tmp_path / "size")
    size = (tmp_path / "size" / ckpt.FILENAME).stat().st_size
    # the second checkpoint is stopped at a random byte of its write
    monkeypatch.setattr(ckpt, "open", _FullDisk(size + int(torch.randint(1, size, ())), stop), raising=False)
    out = tmp_path / "run"
    with pytest.raises(stop):
        train(recipe, progress=False, checkpoint_dir=out)
    how = "SIGTERM" if stop is Terminated else "Ctrl-C"
    said = _stop_line(capsys.readouterr().err, how)
    assert int(said.group(1)) == 2 * every and int(said.group(4)) == every
    assert ckpt.load(out / ckpt.FILENAME)["step"] == every
    assert [f.name for f in out.iterdir()] == [ckpt.FILENAME]


def test_sigterm_is_a_stop_only_within_the_block_and_a_handler_of_the_host_program_stays(tmp_path):
    """Inside a run SIGTERM raises Terminated; after it, Python's default comes back; a program (a Ray worker, a
    notebook server) that handles SIGTERM itself keeps its handler during the run."""
    from zoo.training.stopping import terminate_as_interrupt
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(Terminated), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    received = []
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
