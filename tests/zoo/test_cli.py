"""The `zoo` command: list (text and JSON), check, and the registry it shows."""
import json
import subprocess
import sys
from pathlib import Path

from mixers import MIXERS
from tests.registry import builtin_mixer_names

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


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
    for key in ("seed", "grid", "name"):
        assert any(line.startswith(key + " ") for line in top.splitlines()), top
    ev = next(s for s in sections if s.startswith("recipe section eval:"))
    for key in ("test_time_sweep", "test_time", "seq_lens"):
        assert any(line.startswith(key + " ") for line in ev.splitlines()), ev
