"""`zoo ablate --executor ray`: same rows as the sequential executor, retries after a killed worker or a
raised error with nothing lost or duplicated, and the driver as the only writer of results.jsonl.

CPU training with train.threads=1 is deterministic per seed, also across processes: the Ray rows must
equal the in-process rows bit for bit (every metric except wall-clock times, and the history).
"""
import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from zoo.cli import main  # noqa: E402
from zoo.errors import UserError  # noqa: E402
from zoo.experiments.ablate import CellsFailed, run_ablation  # noqa: E402
from zoo.experiments.executors import RayExecutor  # noqa: E402
from zoo.recipes import resolve  # noqa: E402
from zoo.rows import TIMING_METRICS, read_rows  # noqa: E402

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
TIMES = TIMING_METRICS


def grid_recipe(tmp_path: Path, descriptions=("", "", "", "")) -> Path:
    """tiny.yaml with a grid of 4 cells (2 seeds x 2 layer stacks); ``descriptions`` steer the test hook."""
    cells = [(seed, layers) for seed in (1, 2) for layers in ("[attention]", "[mamba2]")]
    lines = [f"  - {{label: c{i}, seed: {seed}, model.layers: {layers}, description: '{d}'}}"
             for i, ((seed, layers), d) in enumerate(zip(cells, descriptions))]
    path = tmp_path / "grid4.yaml"
    path.write_text(f"extends: {TINY}\nimports: [tests.zoo.ray_hooks]\ngrid:\n" + "\n".join(lines) + "\n")
    return path


def comparable(row: dict) -> dict:
    """What must not depend on the executor: everything but wall times and the hook's cosmetic description."""
    out = {k: row[k] for k in ("recipe_key", "label", "seed", "history")}
    out["overrides"] = {k: v for k, v in row["overrides"].items() if k != "description"}
    out["recipe"] = {k: v for k, v in row["recipe"].items() if k != "description"}
    out["metrics"] = {k: v for k, v in row["metrics"].items() if k not in TIMES}
    return out


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def sequential_rows(tmp_path_factory):
    """The reference: the 4 cells trained one after another in this process."""
    tmp = tmp_path_factory.mktemp("sequential")
    rows = run_ablation(resolve(grid_recipe(tmp)), tmp / "out", plot=False, progress=False, echo=lambda *a: None)
    return {row["recipe_key"]: comparable(row) for row in rows}


def check_results(out: Path, expected: dict) -> list[dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is whole JSON
    keys = [r["recipe_key"] for r in rows]
    assert len(keys) == len(set(keys)), "a cell was written twice"
    assert {k: comparable(r) for k, r in zip(keys, rows)} == expected
    table = [line for line in (out / "results.md").read_text().splitlines()
             if line.startswith("| c") and not line.startswith("| cell")]
    assert [line.split("|")[1].strip() for line in table] == ["c0", "c1", "c2", "c3"], "table not in grid order"
    return rows


def test_ray_rows_equal_sequential_rows(tmp_path, local_ray, sequential_rows):
    out = tmp_path / "out"
    log = []
    with RayExecutor(retries=0) as executor:
        rows = run_ablation(resolve(grid_recipe(tmp_path)), out, plot=False, echo=log.append, executor=executor)
    assert [r["label"] for r in rows] == ["c0", "c1", "c2", "c3"]
    written = check_results(out, sequential_rows)
    assert all(r["threads"] == 1 for r in written)  # train.threads respected inside the worker
    assert any("on ray (1 node, 2 CPUs" in line for line in log), log
    # the workers see the driver's TRITON_INTERPRET (set by the test setup on a machine without CUDA)
    probe = ray.remote(lambda: os.environ.get("TRITON_INTERPRET"))
    assert ray.get(probe.remote()) == os.environ.get("TRITON_INTERPRET")


def test_killed_worker_is_retried_nothing_lost_or_duplicated(tmp_path, local_ray, sequential_rows):
    marker = tmp_path / "died"
    recipe = grid_recipe(tmp_path, descriptions=("", f"die-once:{marker}", "", ""))
    out = tmp_path / "out"
    log = []
    rows = run_ablation(resolve(recipe), out, plot=False, echo=log.append, executor=RayExecutor(retries=2))
    pid, key = marker.read_text().split()
    assert key == rows[1]["recipe_key"], "the hook killed another cell than the one asked for"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # that worker process really died
    check_results(out, sequential_rows)
    assert read_rows(out / "results.jsonl") == json.loads("[" + ",".join(
        (out / "results.jsonl").read_text().splitlines()) + "]")


def test_raising_cell_retried_then_reported_rows_kept_and_resumed(tmp_path, local_ray, sequential_rows, capsys):
    once = tmp_path / "failed-once"
    recipe = grid_recipe(tmp_path, descriptions=(f"fail-once:{once}", "fail-always:", "", ""))
    out = tmp_path / "out"
    log = []
    with pytest.raises(CellsFailed) as failed:
        run_ablation(resolve(recipe), out, plot=False, echo=log.append, executor=RayExecutor(retries=1))
    (outcome,) = failed.value.failures
    assert outcome.cell.label == "c1" and outcome.attempts == 2
    assert outcome.error == "ValueError: this cell always fails (test hook)"
    assert any("c0: attempt 1 failed (ValueError: this cell fails once" in line for line in log), log
    rows = read_rows(out / "results.jsonl")
    assert sorted(r["label"] for r in rows) == ["c0", "c2", "c3"]  # every finished row kept
    for row in rows:
        assert comparable(row) == sequential_rows[row["recipe_key"]]

    # the CLI: the same failure is a nonzero exit naming the cell; then a fixed recipe runs only c1
    code = main(["ablate", str(recipe), "--out", str(out), "--executor", "ray", "--retries", "0", "--no-plot",
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 1
    assert "zoo: cell 'c1' failed after 1 attempt: ValueError: this cell always fails" in captured.err
    assert captured.out.count("done already, skipped") == 3
    recipe.write_text(recipe.read_text().replace("fail-always:", ""))
    code = main(["ablate", str(recipe), "--out", str(out), "--executor", "ray", "--no-plot", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.count("done already, skipped") == 3
    check_results(out, sequential_rows)


def test_no_cluster_at_address_is_one_line(tmp_path):
    """`--address auto` with no cluster to find: Ray's search (its temp folder, running GCS processes) is
    pointed at nothing, so a Ray running elsewhere on this machine does not change the answer."""
    import subprocess
    import sys
    code = ("import functools, sys, ray._private.services as s; "
            "s.find_gcs_addresses = functools.lru_cache()(lambda: []); "
            "from zoo.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray"), "RAY_ADDRESS": ""}
    out = subprocess.run([sys.executable, "-c", code, "ablate", str(TINY), "--out", str(tmp_path / "out"),
                          "--executor", "ray", "--address", "auto", "--no-plot"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "--address auto: cannot connect to a Ray cluster" in lines[0] and "ray start --head" in lines[0]
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_cell_larger_than_any_node_is_refused(tmp_path, local_ray):
    recipe = resolve(grid_recipe(tmp_path))
    executor = RayExecutor(cpus_per_cell=64)
    executor.started_here = True  # as when `zoo ablate` starts the local Ray itself
    executor.echo = lambda *a: None
    with pytest.raises(UserError, match="asks for 64 CPUs and 0 GPUs, more than any Ray node has"):
        executor.submit(0, recipe.cells[0])
    assert not executor.pending
