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


def _torchrun_each_rank(tmp_path, command: str) -> subprocess.CompletedProcess:
    """Two gloo processes, each running the shell ``command`` (``$LOCAL_RANK`` is its rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--no-python", "sh", "-c", command]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ZOO_PY": sys.executable}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_processes_that_read_different_checkpoint_folders_are_refused(tmp_path):
    """Ranks that each see their own --out (one holding a checkpoint, the other none) would train on from different
    weights and rank 0 would write the row of their mixture: every rank refuses, and nothing is written."""
    steps = int(torch.randint(2, 5, ()))
    overrides = [f"train.steps={steps}", "train.threads=1"]
    train(resolve(TINY, overrides), progress=False, checkpoint_dir=tmp_path / "r0")   # rank 0's folder only
    before = (tmp_path / "r0" / FILENAME).read_bytes()
    run = _torchrun_each_rank(tmp_path, f'exec "$ZOO_PY" -m zoo train {TINY} --no-progress --out "r$LOCAL_RANK" '
                                        + " ".join(overrides))
    assert run.returncode != 0
    said = [line for line in run.stderr.splitlines() if line.startswith("zoo: error: the 2 processes start from")]
    assert len(said) == 2, run.stderr[-3000:]
    assert f"this one from {steps}" in " ".join(said) and "this one from 0" in " ".join(said)
    assert (tmp_path / "r0" / FILENAME).read_bytes() == before
    assert not any((tmp_path / f"r{rank}" / "results.jsonl").exists() for rank in (0, 1))


def test_a_tracking_package_missing_stops_every_process_in_one_line(tmp_path):
    """Checked before the processes join their group: each stops with the one-line error (rank 1 waited on rank 0
    and died in the group's connection instead)."""
    import importlib.util

    missing = [name for name in ("tensorboard", "wandb") if importlib.util.find_spec(name) is None]
    if not missing:
        pytest.skip("both tracking packages are installed here")
    run = _torchrun_each_rank(tmp_path, f'exec "$ZOO_PY" -m zoo train {TINY} --no-progress --out "r$LOCAL_RANK" '
                                        f"train.steps=2 train.threads=1 train.tracking={missing[0]}")
    assert run.returncode != 0
    said = [line for line in run.stderr.splitlines() if line.startswith("zoo: error:") and missing[0] in line]
    assert len(said) == 2 and "Connection closed by peer" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_the_process_group_backend_follows_the_training_device_not_the_machine(monkeypatch, device, backend):
    """On a machine with GPUs, a run with train.device=cpu joins gloo: NCCL cannot all-reduce CPU tensors."""
    from zoo.training import distributed
    joined, pinned = [], []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: joined.append(backend))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    ctx = distributed.context(torch.device(device))
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (1, 2, 1)
    assert joined == [backend]
    assert pinned == ([1] if backend == "nccl" else [])
