"""torchrun: two gloo processes on a CPU, each on half of the global batch, train the same model as
one process on the whole batch (up to float summation order); the global batch must divide."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo import build_model, train
from zoo.recipes import resolve
from zoo.training.checkpoint import FILENAME, load
from zoo.training.distributed import DistContext, shard_size

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]
STEPS = ["train.steps=5", "train.threads=1"]
# DDP averages shard gradients of (shard loss sum) x world / (global supervised tokens): the full-batch
# gradient up to the order of float additions (all-reduce, split batches). AdamW divides by sqrt(v), so
# a near-zero gradient entry can turn that rounding into a visible update difference; the weights are
# therefore compared as the norm of their difference relative to how far training moved them. Measured:
# 2e-7 relative in the loss, 2.5e-6 largest weight difference.
RTOL, WEIGHT_RTOL = 1e-5, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_gloo_matches_one_process_on_the_global_batch(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "zoo", "train", str(TINY), "--json", "--no-progress",
           "--out", str(tmp_path / "ddp"), *STEPS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = json.loads(run.stdout)["metrics"]  # rank 0 alone printed: one JSON document
    single = train(resolve(TINY, STEPS), progress=False, checkpoint_dir=tmp_path / "one")
    for key in ("train_loss", "test_loss"):
        assert ddp[key] == pytest.approx(single.metrics[key], rel=RTOL), key
    assert ddp["steps"] == single.metrics["steps"] == 5
    a, b = load(tmp_path / "ddp" / FILENAME), load(tmp_path / "one" / FILENAME)
    assert a["world_size"] == 2 and b["world_size"] == 1
    initial = build_model(resolve(TINY, STEPS)).state_dict()
    differ = torch.cat([(a["model"][k] - b["model"][k]).flatten() for k in initial])
    moved = torch.cat([(b["model"][k] - v).flatten() for k, v in initial.items()])
    print(f"weights: max |difference| {differ.abs().max():.3g}, |difference| / |training update| "
          f"{differ.norm() / moved.norm():.3g}; train_loss {ddp['train_loss']!r} vs {single.metrics['train_loss']!r}")
    assert differ.norm() < WEIGHT_RTOL * moved.norm()
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [FILENAME, "results.jsonl"]


def test_global_batch_must_divide_by_the_world_size():
    assert shard_size(16, 2) == 8
    with pytest.raises(ValueError, match=r"batch_size=10 .* divide by the 4 processes"):
        shard_size(10, 4)
    shards = [DistContext(r, 4, r).shard(16) for r in range(4)]
    assert [list(range(16))[s] for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert DistContext().all_sum([1.5, 2.0], torch.device("cpu")) == [1.5, 2.0]
