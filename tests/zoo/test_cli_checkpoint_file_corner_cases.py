"""Files given where a checkpoint is read that torch cannot load as plain data, and a folder where the checkpoint
file should be: ``zoo eval`` and ``zoo generate`` end in one line naming the file, with no warning of torch's
before it."""
import pickle
import random
import subprocess
import sys
import warnings

import pytest
import torch

from tests.zoo.cli_errors import one_line_error
from zoo.training import checkpoint as ckpt


@pytest.fixture
def rng(_fresh_seed):
    return random.Random(_fresh_seed)


def _plain_pickle(tmp_path, rng):
    data = {"weights": [rng.random() for _ in range(rng.randint(1, 5))], "name": "".join(rng.sample("abcdef", 4))}
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps(data, protocol=rng.choice([4, 5])))
    return path


def test_a_plain_pickle_given_as_the_checkpoint_is_refused_in_one_line(tmp_path, capsys, rng):
    path = _plain_pickle(tmp_path, rng)
    for argv in (["eval", path, "--out", tmp_path / "out"], ["generate", path, "--prompt", "x"]):
        err = one_line_error(capsys, *argv)
        assert f"{path}: not a readable mixer-zoo checkpoint" in err, err
    assert not (tmp_path / "out").exists()


def test_a_plain_pickle_prints_no_warning_before_its_error(tmp_path, rng):
    """In a process of its own: pytest would capture the warning torch gives for the pickle's protocol."""
    path = _plain_pickle(tmp_path, rng)
    out = subprocess.run([sys.executable, "-m", "zoo", "eval", str(path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"zoo: error: {path}: not a readable mixer-zoo checkpoint"), out.stderr


def test_warnings_of_a_checkpoint_that_loads_are_still_shown(tmp_path, monkeypatch):
    path = tmp_path / ckpt.FILENAME
    state = {"format": 1, "step": int(torch.randint(1, 100, ())), "model": {"w": torch.randn(2, 3)}}
    torch.save(state, path)
    real_load = torch.load

    def load_with_a_warning(*args, **kwargs):
        warnings.warn("a note from torch.load", UserWarning, stacklevel=2)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load_with_a_warning)
    with pytest.warns(UserWarning, match="a note from torch.load"):
        loaded = ckpt.load(path)
    assert loaded["step"] == state["step"] and torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_a_folder_named_like_the_checkpoint_is_named_once(tmp_path, capsys):
    run = tmp_path / "run"
    (run / ckpt.FILENAME).mkdir(parents=True)
    err = one_line_error(capsys, "eval", run)
    assert f"{run / ckpt.FILENAME} is a folder, not a checkpoint" in err, err
    assert f"{ckpt.FILENAME}/{ckpt.FILENAME}" not in err, err
