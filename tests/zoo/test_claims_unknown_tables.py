"""``zoo claims --vouch TABLE`` with a table ``claims.yaml`` does not list is refused in one line naming the nearest
tables, as ``--untrained`` is; it was skipped silently (no stale cell found in a missing table) and the ledger
regenerated as if the table had been vouched for. ``zoo claims`` in a root whose tables all await their rows (no
``tables/`` folder yet) writes ``tables/README.md`` instead of ending in a traceback."""
from pathlib import Path

import yaml

from zoo import cli
from zoo.cli import main

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _root(tmp_path: Path) -> Path:
    (tmp_path / "tiny.yaml").write_text(TINY.read_text())
    data = {"papers": {}, "claims": [],
            "tables": {"echo_mask": {"recipe": "tiny.yaml", "no_learning": {"*": {"test_accuracy": 0.1}},
                                     "awaiting_rows": "not run yet"}}}
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(data))
    return tmp_path


def test_vouch_of_a_table_claims_yaml_does_not_list_is_refused(tmp_path, capsys, monkeypatch):
    root = _root(tmp_path)
    asked = []
    monkeypatch.setattr(cli.vouch, "vouch", lambda root, tables: asked.append(tables) or {})
    assert main(["claims", "--root", str(root), "--vouch", "echo_msk"]) == 2
    err = capsys.readouterr().err
    assert "no table 'echo_msk'" in err and "echo_mask" in err and "Traceback" not in err, err
    assert asked == [] and not (root / "CLAIMS.md").exists()   # nothing probed, nothing written
    # a listed table goes on to the probe
    assert main(["claims", "--root", str(root), "--vouch", "echo_mask"]) == 0
    assert asked == [["echo_mask"]] and (root / "CLAIMS.md").is_file()
    assert "`tables/echo_mask`" in (root / "tables" / "README.md").read_text()
