"""Checkpoints: a SIGKILLed `zoo train --out` resumes from its checkpoint and ends with exactly the
numbers of an uninterrupted run; checkpoints load with weights_only; another recipe's checkpoint is refused."""
import json
import os
import re
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from zoo import train
from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.recipes.plain import recipe_mapping
from zoo.training.checkpoint import FILENAME, load

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]
# long enough that a kill lands mid-run; the first checkpoint (step 20) comes after the first reshuffle
# (256 examples, 16 per step), so the data-order generator state matters; eval_every fills the history
LONG = ["train.steps=150", "train.checkpoint_every=20", "train.eval_every=40", "train.threads=1"]
COMPARED = ("steps", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_sequence_accuracy")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _zoo_train(out, *extra, **kw):
    return subprocess.Popen([sys.executable, "-m", "zoo", "train", str(TINY), "--out", str(out), "--json",
                             "--no-progress", *LONG, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), **kw)


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    out = tmp_path / "run"
    proc = _zoo_train(out)
    path = out / FILENAME
    deadline = time.time() + 120
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint after 120 s"
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=60)
    killed_at = load(path)["step"]
    assert 0 < killed_at < 150 and not load(path)["finished"], killed_at
    assert not (out / "results.jsonl").exists()

    proc = _zoo_train(out)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    resumed = json.loads(stdout)["metrics"]
    match = re.search(r"resuming from .* at step (\d+)/150", stderr)
    assert match and int(match.group(1)) >= killed_at > 0, stderr  # continued, not restarted from step 0

    uninterrupted = train(resolve(TINY, LONG), progress=False)
    print(f"killed at step {killed_at}, resumed from step {match.group(1)}; resumed "
          f"{ {k: resumed[k] for k in COMPARED} }; uninterrupted { {k: uninterrupted.metrics[k] for k in COMPARED} }")
    for key in COMPARED:
        assert resumed[key] == uninterrupted.metrics[key], (key, resumed[key], uninterrupted.metrics[key])
    final = load(path)
    assert final["finished"] and final["step"] == 150
    assert final["history"] == uninterrupted.history and len(final["history"]) == 3
    for name, tensor in uninterrupted.model.state_dict().items():
        assert torch.equal(final["model"][name], tensor), name
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["recipe_key"] == resolve(TINY, LONG).key and rows[0]["label"] == "train"


def test_in_process_resume_and_refusal_of_another_recipe(tmp_path):
    recipe = resolve(TINY, ["train.steps=12", "train.checkpoint_every=4"])
    first = train(recipe, progress=False, checkpoint_dir=tmp_path)
    state = load(tmp_path / FILENAME)  # everything saved is weights_only-loadable (load uses weights_only=True)
    assert state["recipe_key"] == recipe.key and state["step"] == 12 and state["finished"]
    assert state["metrics"]["test_accuracy"] == first.metrics["test_accuracy"]
    again = train(recipe, progress=False, checkpoint_dir=tmp_path)  # a finished checkpoint: no retraining
    assert again.metrics["test_loss"] == first.metrics["test_loss"]
    other = resolve(TINY, ["train.steps=13"])
    with pytest.raises(UserError, match=r"train.steps: 12 -> 13"):
        train(other, progress=False, checkpoint_dir=tmp_path)
    # the checkpoint interval is bookkeeping, not part of the recipe's identity
    assert resolve(TINY, ["train.steps=12", "train.checkpoint_every=3"]).key == recipe.key


def test_recipe_in_a_checkpoint_resolves_back_to_the_same_key():
    recipe = resolve(TINY, ["model.layers=null", "model.pattern=[attention, {mamba2: {d_state: 4}}]",
                            "model.n_layers=3", "task.num_test=32"])
    again = resolve(recipe_mapping(recipe.plain))
    assert again.key == recipe.key and again.plain == recipe.plain


def test_a_damaged_checkpoint_is_a_one_line_error(tmp_path):
    (tmp_path / FILENAME).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable mixer-zoo checkpoint"):
        load(tmp_path / FILENAME)


def test_an_unreadable_checkpoint_names_the_file_and_the_error_never_torchs_advice_to_load_it_unsafely(tmp_path):
    torch.save({"model": Fraction(1, 3)}, tmp_path / "foreign.pt")  # an object: unpickling one could run code
    (tmp_path / "garbage.pt").write_bytes(b"garbage\n")
    (tmp_path / "torn.pt").write_bytes(b"\x00" * 100)
    for name, reason in (("garbage.pt", "UnpicklingError: Unsupported operand"),
                         ("torn.pt", "UnpicklingError: Unsupported operand"),
                         ("foreign.pt", "UnpicklingError: it holds a fractions.Fraction object, not plain data")):
        with pytest.raises(UserError) as refused:
            load(tmp_path / name)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / name}: not a readable mixer-zoo checkpoint ({reason}"), message
        assert "weights_only" not in message and "\n" not in message and len(message) < 300, message


def test_a_flipped_byte_inside_a_checkpoint_is_found_by_its_checksum(tmp_path):
    recipe = resolve(TINY, ["train.steps=3"])
    train(recipe, progress=False, checkpoint_dir=tmp_path)
    path = tmp_path / FILENAME
    assert load(path)["step"] == 3
    raw = bytearray(path.read_bytes())
    payload = torch.load(path, weights_only=True)["payload"].numpy().tobytes()  # the state, stored inside
    start = bytes(raw).find(payload[:256])
    assert start > 0
    flipped = start + int(torch.randint(0, len(payload), (1,)))  # one byte anywhere in the stored state
    raw[flipped] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="checksum does not match"):
        load(path)


def test_under_torchrun_every_process_starts_over_from_a_damaged_checkpoint(tmp_path, capsys):
    """The main process moves a damaged checkpoint aside; another process that reads it (before or after the
    move) starts over too, never stopping the job with an error while the main process trains."""
    from zoo.training.loop import _saved_state
    path = tmp_path / FILENAME
    path.write_bytes(bytes(torch.randint(0, 256, (100,), dtype=torch.uint8).tolist()))
    assert _saved_state(path, main=False) is None and path.exists()   # read before the move
    assert _saved_state(path, main=True) is None and not path.exists()
    assert "moved it to" in capsys.readouterr().err
    assert _saved_state(path, main=False) is None                      # read after the move


def test_a_damaged_checkpoint_is_moved_aside_and_the_run_starts_over(tmp_path, capsys):
    recipe = resolve(TINY, ["train.steps=4", "train.threads=1"])
    clean = train(recipe, progress=False).metrics
    (tmp_path / FILENAME).write_bytes(b"\x00" * 100)  # a checkpoint torn by a disk fault
    orphan = tmp_path / f".{FILENAME}.999999999.tmp"  # left by a writer killed mid-write (no such pid)
    orphan.write_bytes(b"partial")
    metrics = train(recipe, progress=False, checkpoint_dir=tmp_path).metrics
    assert "moved it to" in capsys.readouterr().err
    moved = list(tmp_path.glob(f"{FILENAME}.damaged-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == b"\x00" * 100
    assert not orphan.exists()
    assert load(tmp_path / FILENAME)["finished"]
    assert {k: metrics[k] for k in COMPARED} == {k: clean[k] for k in COMPARED}
