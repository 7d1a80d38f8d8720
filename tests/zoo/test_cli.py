"""The `zoo` command: list (text and JSON), check, and the registry it shows; a closed stdout, an empty --out and
a file given for a folder, each ended in one line."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mixers import MIXERS
from tests.registry import builtin_mixer_names
from zoo.paths import recipe_sections

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]


def zoo(*args):
    return subprocess.run([sys.executable, "-m", "zoo", *map(str, args)], capture_output=True, text=True)


def test_list_names_every_mixer_with_description_and_state_formula():
    out = zoo("list")
    assert out.returncode == 0, out.stderr
    for name in builtin_mixer_names():
        cls = MIXERS.get(name)
        line = next(l for l in out.stdout.splitlines() if l.startswith(name + " "))
        assert cls.description[:30] in line and cls.state_formula[:20] in line
    assert "2 * T" in next(l for l in out.stdout.splitlines() if l.startswith("attention "))


def test_list_json_is_machine_readable():
    out = zoo("list", "--json")
    data = json.loads(out.stdout)
    mixers = {m["name"]: m for m in data["mixers"]}
    assert set(mixers) == set(builtin_mixer_names())
    assert {"attention", "mamba2"} <= set(mixers)
    assert mixers["mamba2"]["state_size"] and mixers["attention"]["description"]
    assert any(o["name"] == "d_state" for o in mixers["mamba2"]["options"])
    assert {t["name"] for t in data["tasks"]} >= {"mqar", "parity", "s3"}


def test_check_reports_model_size_and_grid(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(TINY.read_text() + "grid:\n  train.lr: [1.0e-3, 2.0e-3]\n  seed: [0, 1]\n")
    out = zoo("check", path)
    assert out.returncode == 0, out.stderr
    assert "4 grid cells" in out.stdout and "parameters" in out.stdout
    path.write_text(TINY.read_text() + "grid:\n  train.lrr: [1.0e-3]\n")
    bad = zoo("check", path)
    assert bad.returncode == 2 and "did you mean 'lr'" in bad.stderr and "Traceback" not in bad.stderr


def test_overrides_after_flags_and_json_is_only_json(capsys):
    from zoo.cli import main
    assert main(["train", str(TINY), "--no-progress", "train.steps=2", "--json", "seed=5"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # nothing but JSON on stdout
    assert data["metrics"]["steps"] == 2 and data["recipe"]["seed"] == 5
    assert set(data) == {"recipe", "recipe_key", "metrics"}
    assert "training" in captured.err


def test_list_options_shows_top_level_and_eval_keys():
    out = zoo("list", "--options")
    assert out.returncode == 0, out.stderr
    sections = out.stdout.split("\n\n")
    top = next(s for s in sections if s.startswith("recipe (top level):"))
    for key in ("seed", "grid", "name", "extends", "imports"):
        assert any(line.startswith(key + " ") for line in top.splitlines()), top
    listed = json.loads(zoo("list", "--json").stdout)["recipe"]["recipe"]
    assert [o["name"] for o in listed] == list(recipe_sections())
    ev = next(s for s in sections if s.startswith("recipe section eval:"))
    for key in ("test_time_sweep", "test_time", "seq_lens"):
        assert any(line.startswith(key + " ") for line in ev.splitlines()), ev


def test_a_closed_stdout_ends_every_command_quietly_with_141(tmp_path):
    table = tmp_path / "table"
    table.mkdir()
    shutil.copy(ROOT / "tables" / "bdlru_recall" / "results.jsonl", table)
    for argv in (["list", "--json"], ["list", "--options"], ["table", table, "--no-plot"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first byte (`zoo list | head` once head has its lines)
        try:
            out = subprocess.run([sys.executable, "-m", "zoo", *map(str, argv)], stdout=write, stderr=subprocess.PIPE,
                                 text=True)
        finally:
            os.close(write)
        assert (out.returncode, out.stderr) == (141, ""), (argv, out.stderr)
    assert (table / "results.md").is_file()  # what the command writes to files is kept


def test_an_empty_out_or_to_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    from zoo import cli
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "train", lambda *a, **k: pytest.fail("trained"))
    for argv, flag in ((["train", TINY, "--out", ""], "--out"), (["ablate", TINY, "--out", ""], "--out"),
                       (["eval", tmp_path, "--out", ""], "--out"), (["bench", "--out", ""], "--out"),
                       (["export", tmp_path, "--to", ""], "--to")):
        assert cli.main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err == f"zoo: error: zoo {argv[0]}: {flag} is empty (an unset shell variable?); name the folder to " \
                      f"write\n", err
    assert os.listdir(tmp_path) == []


def test_table_of_a_file_or_a_missing_folder_says_which(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "results.jsonl").write_text("")
    for path, said in ((tmp_path / "afile", "is a file, not a results folder"),
                       (tmp_path / "results.jsonl", f"is a file, not a results folder; give its folder, {tmp_path}"),
                       (tmp_path / "nowhere", "no such folder")):
        out = zoo("table", path)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and said in out.stderr, out.stderr
    bench = tmp_path / "bench"    # a folder some other command wrote: not taken for an ablation without rows
    bench.mkdir()
    (bench / "bench.json").write_text("[]")
    out = zoo("table", bench)
    assert out.returncode == 2 and out.stderr == f"zoo: error: zoo table: {bench} holds no results.jsonl; give the " \
                                                 f"folder zoo ablate RECIPE --out DIR wrote (DIR)\n", out.stderr
    assert sorted(os.listdir(bench)) == ["bench.json"]


def test_the_readme_names_every_task_zoo_list_shows():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("Tasks: ")
    sentence = readme[start:readme.index("\n\n", start)]
    named = set(re.findall(r"`([a-z0-9_]+)`", sentence))
    assert {t["name"] for t in json.loads(zoo("list", "--json").stdout)["tasks"]} <= named, sentence


def test_list_imports_modules_first_and_names_a_module_it_cannot_import():
    """``zoo list --imports`` lists an out-of-tree mixer with its options; a module that fails to import is
    named in one line."""
    plain = zoo("list", "--options")
    listed = zoo("list", "--options", "--imports", "tests.zoo.out_of_tree_mixer")
    assert plain.returncode == listed.returncode == 0, listed.stderr
    assert "cumulative_mean" not in plain.stdout
    assert any(line.startswith("cumulative_mean ") for line in listed.stdout.splitlines())
    assert "cumulative_mean options:" in listed.stdout and "d_inner" in listed.stdout
    missing = f"no_such_module_{os.getpid()}"
    refused = zoo("list", "--imports", missing)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"zoo: error: zoo list --imports: cannot import '{missing}': ModuleNotFoundError: No module named '{missing}'"]


def test_data_prepare_help_gives_examples_of_what_preparation_reads():
    """``zoo data prepare``'s override examples are task keys (it reads only the task), not training or model keys."""
    out = zoo("data", "prepare", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split()).split("e.g.", 1)[1]
    examples = re.findall(r"([a-z_]+(?:\.[a-z_0-9<>]+)+)=", text)
    assert examples and all(key.startswith("task.") for key in examples), examples
