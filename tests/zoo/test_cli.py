"""The `zoo` command: list (text and JSON), check, and the registry it shows."""
import json
import subprocess
import sys
from pathlib import Path

from mixers import MIXERS

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def zoo(*args):
    return subprocess.run([sys.executable, "-m", "zoo", *map(str, args)], capture_output=True, text=True)


def test_list_names_every_mixer_with_description_and_state_formula():
    out = zoo("list")
    assert out.returncode == 0, out.stderr
    for name in MIXERS.names():
        cls = MIXERS.get(name)
        line = next(l for l in out.stdout.splitlines() if l.startswith(name + " "))
        assert cls.description[:30] in line and cls.state_formula[:20] in line
    assert "2 * T" in next(l for l in out.stdout.splitlines() if l.startswith("attention "))


def test_list_json_is_machine_readable():
    out = zoo("list", "--json")
    data = json.loads(out.stdout)
    mixers = {m["name"]: m for m in data["mixers"]}
    assert set(mixers) == set(MIXERS.names())
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
