"""Checkpoints written before the checksum existed (format 1: the state dict itself, with ``format: 1``) still load
(zoo.training.checkpoint.load), with every value as written."""
import torch

from zoo.training import checkpoint as ckpt


def test_a_format_one_checkpoint_loads_as_written(tmp_path):
    state = {"format": 1, "step": int(torch.randint(1, 1000, ())), "finished": bool(torch.randint(0, 2, ())),
             "model": {"w": torch.randn(3, 4)}, "history": [{"step": 2, "test_loss": float(torch.rand(()))}]}
    path = tmp_path / ckpt.FILENAME
    torch.save(state, path)
    loaded = ckpt.load(path)
    assert loaded.keys() == state.keys()
    assert (loaded["step"], loaded["finished"], loaded["history"]) == (state["step"], state["finished"], state["history"])
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
