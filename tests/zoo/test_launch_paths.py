"""How a grid or a run is launched: ``zoo ablate`` under torchrun (refused with several processes, before its folder
is made), a local Ray started whatever cluster the environment names, a recipe module a Ray worker cannot import
(named in the cell's error), more torchrun processes than GPUs and ``zoo check`` of a grid cell whose device is
missing (each one line naming the cause and what to do)."""
import json
import os
import socket
import uuid
from pathlib import Path

import pytest
import torch

from zoo.cli import main
from zoo.config import Cell
from zoo.errors import UserError
from zoo.experiments.executors import _ray_task
from zoo.recipes import resolve
from zoo.training import distributed

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _grid(tmp_path: Path, cells: list[str]) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"extends: {TINY}\ntrain: {{steps: 2}}\ngrid:\n" + "".join(f"  - {c}\n" for c in cells))
    return path


def _torchrun_env(monkeypatch, world: int, rank: int = 0) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
        monkeypatch.setenv(name, str(value))
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # no rendezvous to find: joining a group fails at once
        monkeypatch.delenv(name, raising=False)


def test_ablate_under_torchrun_with_several_processes_is_refused_before_the_folder_is_made(tmp_path, monkeypatch,
                                                                                          capsys):
    """Every process would run the whole grid into one folder (the second found the first's lock and named it as
    another zoo ablate, while the first waited for it in the process group)."""
    world = int(torch.randint(2, 9, ()))
    _torchrun_env(monkeypatch, world, rank=int(torch.randint(0, world, ())))
    out = tmp_path / "out"
    code = main(["ablate", str(_grid(tmp_path, ["{label: a, model.layers: [attention]}"])), "--out", str(out),
                 "--no-progress", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"under torchrun here ({world} processes)" in err[0] and "without torchrun" in err[0], err
    assert not out.exists()


def test_ablate_under_torchrun_with_one_process_runs(tmp_path, monkeypatch, capsys):
    _torchrun_env(monkeypatch, 1)
    out = tmp_path / "out"
    labels = [f"c{uuid.uuid4().hex[:6]}", f"c{uuid.uuid4().hex[:6]}"]
    code = main(["ablate", str(_grid(tmp_path, [f"{{label: {labels[0]}, model.layers: [attention]}}",
                                                f"{{label: {labels[1]}, model.layers: [mamba2]}}"])),
                 "--out", str(out), "--no-progress", "--no-plot"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == labels


def test_a_local_ray_starts_whatever_cluster_ray_address_names(monkeypatch):
    """Without --address the executor starts its own Ray (as the help says); Ray alone reads RAY_ADDRESS (or a
    running `ray start`), joins that cluster and refuses the local CPU count it was given."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray is running in this process already")
    from zoo.experiments.executors import RayExecutor
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with RayExecutor(retries=0, num_cpus=1) as executor:
        assert executor.describe() == "ray (1 node, 1 CPUs, 0 GPUs)"
        assert executor.started_here and executor.local
    assert not ray.is_initialized()


def test_a_recipe_module_a_ray_worker_cannot_import_is_named():
    """The reason a cell fails on a worker is its error's first line (what the driver reports): the module's name
    and its own message, not Ray's wrapper of the error."""
    recipe = resolve(TINY, ["train.steps=2"])
    missing = f"zoo_absent_{uuid.uuid4().hex}"
    with pytest.raises(RuntimeError) as raised:
        _ray_task(Cell("base", {}, recipe), ("json", missing), progress=False)
    first = str(raised.value).splitlines()[0]
    assert f"cannot import {missing!r} (the recipe's imports)" in first, first
    assert f"ModuleNotFoundError: No module named {missing!r}" in first and "every Ray node" in first, first


@pytest.mark.parametrize("trial", range(3))
def test_more_torchrun_processes_than_gpus_is_one_line_before_joining(monkeypatch, trial):
    """LOCAL_RANK past the machine's GPUs: CUDA's invalid-ordinal error becomes one line naming the count."""
    count = int(torch.randint(1, 5, ()))
    local = count + int(torch.randint(0, 4, ()))
    _torchrun_env(monkeypatch, local + 1, rank=local)
    joined = []

    def set_device(index):
        if index >= count:
            raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: joined.append(backend))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    with pytest.raises(UserError, match=rf"LOCAL_RANK={local}: this machine has {count} CUDA device.*"
                                        rf"--nproc_per_node {count}\)"):
        distributed.context(torch.device("cuda"))
    assert joined == []
    monkeypatch.setenv("LOCAL_RANK", str(count - 1))  # a rank with a GPU of its own joins as before
    assert distributed.context(torch.device("cuda")).local_rank == count - 1 and joined == ["nccl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_check_names_the_grid_cell_whose_device_is_missing(tmp_path, capsys):
    labels = [f"c{uuid.uuid4().hex[:6]}" for _ in range(3)]
    on_cuda = int(torch.randint(0, 3, ()))
    cells = [f"{{label: {label}, model.layers: [{mixer}]" + (", train.device: cuda}" if i == on_cuda else "}")
             for i, (label, mixer) in enumerate(zip(labels, ["attention", "mamba2", "gla"]))]
    code = main(["check", str(_grid(tmp_path, cells))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"grid cell {labels[on_cuda]!r}: train.device=cuda but no CUDA device" in err[0], err


def test_a_ray_cell_no_node_can_hold_is_refused_before_the_folder_changes(tmp_path, capsys):
    """A cell asking for more CPUs than the local Ray has was refused at its own submission: the cells before it
    were launched (then cancelled) and the folder had its layout written, though a refused run changes nothing."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray is running in this process already")
    grid = _grid(tmp_path, ["{label: a, train.lr: 0.001}", "{label: b, train.lr: 0.002}"])
    out = tmp_path / "out"
    cpus = int(torch.randint(3, 200, ()))   # above the local Ray's CPUs, started with this machine's count
    if cpus <= (os.cpu_count() or 1):
        cpus = (os.cpu_count() or 1) + 1
    code = main(["ablate", str(grid), "--out", str(out), "--executor", "ray", "--cpus-per-cell", str(cpus),
                 "--no-progress", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"cell 'a' asks for {cpus} CPUs and 0 GPUs, more than any Ray node has" in err[-1], err
    assert not ray.is_initialized()
    assert sorted(p.name for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")) == [], \
        list(out.rglob("*"))


def test_a_torchrun_rank_runs_its_trial_pass_on_its_own_gpu(tmp_path, monkeypatch):
    """The recipe's trial pass ran before the process group pinned each rank's GPU, so every rank ran it on GPU 0
    (a CUDA context each there): the rank's GPU is now current before the trial."""
    count = int(torch.randint(2, 9, ()))
    local = int(torch.randint(1, count, ()))   # GPU 0 would pass without the pinning
    _torchrun_env(monkeypatch, count, rank=local)
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.__setitem__(0, index))
    seen = []

    def trial(cells):   # stands in for the trial pass: where would it run, then stop the command
        seen.append(current[0])
        raise UserError("stopped after the trial")

    monkeypatch.setattr("zoo.cli.refuse_unrunnable", trial)
    assert main(["train", str(TINY), "train.device=cuda", "--out", str(tmp_path / "o")]) == 2
    assert seen == [local]
