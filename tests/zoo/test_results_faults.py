"""Result folders under faults: damaged rows are reported, moved aside and only their cells recomputed;
rendering never writes results.jsonl; unwritable places are refused before training; grids that would
train one recipe twice are refused; zoo table and zoo ablate write the same table; every committed table's
recorded recipe loads back to its key."""
from __future__ import annotations

import json
import os
import random
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from zoo.cli import main
from zoo.recipes import resolve
from zoo.rows import DAMAGED_NAME, TIMING_METRICS, append_row, read_rows, repair_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
FAST = ["train.steps=3", "train.warmup_steps=1", "task.num_test=16", "--no-plot", "--no-progress"]


def _grid(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"extends: {TINY}\ngrid:\n" + "".join(f"  - {{label: c{i}, train.lr: {1e-3 * (i + 1)}}}\n"
                                                           for i in range(n)))
    return path


def _ablate(recipe: Path, out: Path, *extra) -> int:
    return main(["ablate", str(recipe), "--out", str(out), *FAST, *extra])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished three-cell ablation (its folder is copied by each test)."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe = _grid(tmp)
    assert _ablate(recipe, tmp / "out") == 0
    return recipe, tmp / "out"


DAMAGE = {
    "nul bytes": lambda line: b"\x00" * 37 + b"\n",
    "cut short": lambda line: line[: len(line) // 2] + b"\n",
    "blank": lambda line: b"\n",
    "not an object": lambda line: b"[1, 2, 3]\n",
    "a string": lambda line: b'"row"\n',
    "no fields": lambda line: b'{"recipe_key": "x"}\n',
    "not utf-8": lambda line: line[:10] + b"\xff\xfe" + line[12:],
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_middle_row_is_moved_aside_and_only_its_cell_recomputed(finished, tmp_path, capsys, kind):
    recipe, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 3
    damaged = DAMAGE[kind](lines[1])
    (out / "results.jsonl").write_bytes(lines[0] + damaged + lines[2])
    before = (out / "results.jsonl").read_bytes()

    assert main(["table", str(out), "--no-plot"]) == 0  # renders the good rows, reports the rest
    assert "line 2 is not a results row" in capsys.readouterr().err
    assert (out / "results.jsonl").read_bytes() == before, "zoo table wrote results.jsonl"

    assert _ablate(recipe, out) == 0
    said = capsys.readouterr().out
    assert "line 2 is not a results row" in said and said.count("done already, skipped") == 2
    after = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    assert after[:2] == [lines[0], lines[2]], "a valid row was not kept byte for byte"
    assert json.loads(after[2])["label"] == json.loads(lines[1])["label"]  # only the damaged cell ran again
    assert (out / DAMAGED_NAME).read_bytes().startswith(damaged.rstrip(b"\n"))


def test_rows_reading_reports_and_repair_keeps_valid_rows(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [{"recipe_key": f"k{i}", "label": f"c{i}", "recipe": {}, "metrics": {"x": random.random()}} for i in range(4)]
    for row in rows:
        append_row(path, row)
    raw = path.read_bytes()
    with open(path, "ab") as fh:
        fh.write(b'{"recipe_key": "k9", "trunc')  # a write cut off by a kill
    seen = []
    assert read_rows(path, seen.append) == rows and len(seen) == 1 and seen[0].line_number == 5
    assert path.read_bytes().startswith(raw) and len(path.read_bytes()) > len(raw)  # reading wrote nothing
    kept, moved = repair_rows(path)
    assert kept == rows and path.read_bytes() == raw and len(moved) == 1
    assert (tmp_path / DAMAGED_NAME).read_bytes() == b'{"recipe_key": "k9", "trunc\n'


def _deny_writes_to(monkeypatch, *denied: Path):
    """Make ``denied`` unwritable as the permission check sees it (this machine may run tests as root, whom
    file modes do not stop), then also set their modes for a non-root run."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and not (
        Path(p) in denied and mode & os.W_OK))
    for path in denied:
        path.chmod(stat.S_IRUSR | (stat.S_IXUSR if path.is_dir() else 0))


def test_a_read_only_results_file_is_refused_before_training(finished, tmp_path, capsys, monkeypatch):
    recipe, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(lines[0])
    _deny_writes_to(monkeypatch, out / "results.jsonl")
    assert _ablate(recipe, out) == 2
    assert "results.jsonl is not writable" in _one_line(capsys)
    assert not (out / "checkpoints" / resolve(recipe).cells[1].recipe.key).exists(), "a cell trained"


def test_unwritable_places_are_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch):
    recipe = _grid(tmp_path, 1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, words in ((a_file, "is a file"), (a_file / "sub", "is a file"), (Path("/dev/null"), "is a file")):
        assert _ablate(recipe, out) == 2, out
        assert words in _one_line(capsys)
    locked = tmp_path / "locked"
    locked.mkdir()
    _deny_writes_to(monkeypatch, locked)
    for out in (locked, locked / "sub"):
        assert _ablate(recipe, out) == 2
        assert "not writable" in _one_line(capsys)
        assert not (locked / "sub").exists()


def test_a_relabelled_cell_is_found_by_its_recipe_and_shown_under_its_new_label(finished, tmp_path, capsys):
    recipe, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    relabelled = tmp_path / "relabelled.yaml"
    relabelled.write_text(recipe.read_text().replace("label: c1,", "label: renamed,"))
    assert _ablate(relabelled, out) == 0
    assert capsys.readouterr().out.count("done already, skipped") == 3
    table = (out / "results.md").read_text()
    assert "| renamed " in table and "| c1 " not in table


def test_zoo_table_and_zoo_ablate_write_the_same_bytes(finished, tmp_path):
    _recipe, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    written = {n: (out / n).read_bytes() for n in ("results.md", "results.csv")}
    for name in written:
        (out / name).unlink()
    assert main(["table", str(out), "--no-plot"]) == 0
    assert {n: (out / n).read_bytes() for n in written} == written


def test_two_cells_with_one_recipe_are_refused_at_check(tmp_path, capsys):
    path = tmp_path / "twins.yaml"
    path.write_text(f"extends: {TINY}\ngrid:\n  - {{label: a, train.lr: 0.001}}\n  - {{label: b, train.lr: 1.0e-3}}\n")
    assert main(["check", str(path)]) == 2
    err = _one_line(capsys)
    assert "'a' and 'b' resolve to the same recipe" in err


def test_warmup_beyond_the_steps_is_refused(capsys):
    assert main(["check", str(TINY), "train.steps=10", "train.warmup_steps=11"]) == 2
    assert "warmup_steps (11) exceeds train.steps (10)" in _one_line(capsys)


def test_an_invalid_test_time_value_is_refused_at_check(capsys):
    assert main(["check", str(TINY), "model.layers=[gka]", "eval.test_time={num_iter: -1}"]) == 2
    assert "eval.test_time.num_iter" in _one_line(capsys)


def _committed_first_rows():
    # a table whose rule is committed before its run has an empty results.jsonl until the run
    return [pytest.param(json.loads(path.read_bytes().splitlines()[0]), id=path.parent.name)
            for path in sorted((ROOT / "tables").glob("*/results.jsonl")) if path.read_bytes().strip()]


@pytest.mark.parametrize("row", _committed_first_rows())
def test_a_recorded_recipe_loads_back_with_its_key_and_passes_check(row, tmp_path, capsys):
    assert resolve(row["recipe"]).key == row["recipe_key"]
    path = tmp_path / "recorded.yaml"
    path.write_text(yaml.safe_dump(row["recipe"]))  # the row's recipe, as it is
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert row["recipe_key"] in capsys.readouterr().out


TIMING = TIMING_METRICS


def _outcomes(out: Path) -> dict:
    """label -> metrics without wall-clock timings, for the rows of ``out``."""
    return {r["label"]: {k: v for k, v in r["metrics"].items() if k not in TIMING}
            for r in read_rows(out / "results.jsonl")}


def _killed_while_writing(done: Path, out: Path, rng: random.Random) -> str:
    """A copy of ``done`` as a SIGKILL at a random byte of a row write or of a checkpoint write leaves it:
    the rows before the cell in flight, and that cell's half-written row or half-written checkpoint."""
    shutil.copytree(done, out)
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    i = rng.randrange(len(lines))
    key = json.loads(lines[i])["recipe_key"]
    for later in lines[i + 1:]:
        shutil.rmtree(out / "checkpoints" / json.loads(later)["recipe_key"])
    folder = out / "checkpoints" / key
    if rng.random() < 0.5:  # in the row's one write: a prefix of the line reached the disk
        cut = rng.randrange(len(lines[i]))
        (out / "results.jsonl").write_bytes(b"".join(lines[:i]) + lines[i][:cut])
        return f"row {i} cut at byte {cut}"
    # in a checkpoint write: the temporary file holds a prefix, the checkpoint itself is not there yet
    data = (folder / "checkpoint.pt").read_bytes()
    cut = rng.randrange(len(data))
    (folder / "checkpoint.pt").unlink()
    (folder / ".checkpoint.pt.999999999.tmp").write_bytes(data[:cut])
    (out / "results.jsonl").write_bytes(b"".join(lines[:i]))
    return f"checkpoint of cell {i} cut at byte {cut}"


def test_kills_during_row_and_checkpoint_writes_always_resume_to_the_uninterrupted_table(finished, tmp_path):
    recipe, done = finished
    expected = _outcomes(done)
    rng = random.Random(random.getrandbits(32))  # from the test's seed: replayable
    for point in range(20):
        out = tmp_path / f"kill{point}"
        where = _killed_while_writing(done, out, rng)
        assert _ablate(recipe, out) == 0, where
        assert _outcomes(out) == expected, where
        assert not list(out.glob("checkpoints/*/.checkpoint.pt.*.tmp")), where
