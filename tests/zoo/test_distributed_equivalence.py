"""What a run under torchrun or in an ablation's cell records must be what one process on its own computes.

- two gloo processes train what one process trains on the same global batch also where the two shards of a
  batch hold different numbers of supervised tokens, with micro-batches, an active gradient clip and periodic
  evaluation, and they resume a checkpoint mid-run to the numbers of the uninterrupted run;
- an ablation cell's row names the device the cell trained on, and a cell's ``train.threads`` does not become
  the thread count of the next cell run by the same process (the sequential executor, a reused Ray worker).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo import build_model, train
from zoo.experiments.ablate import cells_of
from zoo.experiments.executors import run_cell
from zoo.recipes import resolve
from zoo.tasks import Task
from zoo.training import checkpoint as ckpt
from zoo.training.checkpoint import FILENAME, load
from zoo.training.state import ORDER_SEED_OFFSET

from .test_distributed import RTOL, TINY, WEIGHT_RTOL, _free_port

ROOT = Path(__file__).resolve().parents[2]
# mad_recall supervises a key only where it occurred before: the examples hold different numbers of
# supervised tokens, so the two halves of a global batch do too
MAD = """name: mad-ddp
seed: 5
model:
  d_model: 32
  layers: [attention, mamba2]
  mixer_options:
    attention: {n_heads: 2}
    mamba2: {d_state: 8, headdim: 16, chunk_size: 8}
task: {name: mad_recall, vocab_size: 16, seq_len: 16, num_train: 256, num_test: 64}
train: {steps: 4, batch_size: 16, lr: 3.0e-3, warmup_steps: 1, threads: 1, grad_accum: 2, grad_clip: 0.05,
        eval_every: 2, checkpoint_every: 2}
"""


def _torchrun(recipe: Path, out: Path) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "zoo", "train", str(recipe), "--json", "--no-progress",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)["metrics"], run.stderr


def _close(ddp: dict, single: dict, initial: dict) -> None:
    for key in ("train_loss", "test_loss"):
        assert ddp["metrics"][key] == pytest.approx(single["metrics"][key], rel=RTOL), key
    assert ddp["step"] == single["step"] and ddp["finished"] and single["finished"]
    assert [h["step"] for h in ddp["history"]] == [h["step"] for h in single["history"]] == [2]
    for a, b in zip(ddp["history"], single["history"]):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=RTOL)
    differ = torch.cat([(ddp["model"][k] - single["model"][k]).flatten() for k in initial])
    moved = torch.cat([(single["model"][k] - v).flatten() for k, v in initial.items()])
    assert differ.norm() < WEIGHT_RTOL * moved.norm()


class _Stop(Exception):
    pass


def test_two_processes_with_unequal_supervised_counts_and_a_resume_match_one_process(tmp_path, monkeypatch):
    path = tmp_path / "mad.yaml"
    path.write_text(MAD)
    recipe = resolve(path)
    # the two shards of the run's global batches hold different numbers of supervised tokens
    data = Task.from_spec(recipe.task).make("train", recipe.seed)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(recipe.seed + ORDER_SEED_OFFSET))
    shards = order[:4 * 16].view(4, 2, 8)  # 4 steps of 2 shards of 8 examples
    counts = (data.labels[shards] != -100).sum(dim=(-2, -1))
    assert (counts[:, 0] != counts[:, 1]).sum() >= 2, counts.tolist()

    train(recipe, progress=False, checkpoint_dir=tmp_path / "one")
    single = load(tmp_path / "one" / FILENAME)
    initial = build_model(recipe).state_dict()

    metrics, _ = _torchrun(path, tmp_path / "ddp")
    ddp = load(tmp_path / "ddp" / FILENAME)
    assert ddp["world_size"] == 2 and metrics["steps"] == 4
    _close(ddp, single, initial)

    # one process stops after its checkpoint at step 2; two processes resume there and finish the run
    save = ckpt.save

    def save_then_stop(where, state):
        save(where, state)
        if state["step"] == 2:
            raise _Stop

    monkeypatch.setattr(ckpt, "save", save_then_stop)
    with pytest.raises(_Stop):
        train(recipe, progress=False, checkpoint_dir=tmp_path / "resumed")
    monkeypatch.setattr(ckpt, "save", save)
    assert load(tmp_path / "resumed" / FILENAME)["step"] == 2
    _, stderr = _torchrun(path, tmp_path / "resumed")
    assert "at step 2/4" in stderr, stderr[-3000:]  # resumed, not trained from the start
    _close(load(tmp_path / "resumed" / FILENAME), single, initial)


def _cell(*overrides):
    return cells_of(resolve(TINY, ["train.steps=2", "train.warmup_steps=1", *overrides]))[0]


def test_a_cells_row_names_the_device_it_trained_on(monkeypatch):
    """On a machine with a GPU, a cell with train.device=cpu trains on the CPU: its row says so (it named the
    GPU, the machine's default device, while its metrics said cpu)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU this cell never used")
    row = run_cell(_cell("train.device=cpu"))
    assert row["metrics"]["device"] == "cpu"
    assert row["device"] == "cpu" and row["device_name"].startswith("CPU"), (row["device"], row["device_name"])
    assert "cuda" not in row["versions"]


def test_a_cells_threads_do_not_carry_over_to_the_next_cell():
    """train.threads=0 keeps the process's thread count: after a cell with train.threads=1 it is still the
    process's own (it was 1, left by the earlier cell)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        alone = run_cell(_cell("train.threads=0"))["threads"]
        assert run_cell(_cell("train.threads=1"))["threads"] == 1
        after = run_cell(_cell("train.threads=0"))["threads"]
        assert alone == after == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
