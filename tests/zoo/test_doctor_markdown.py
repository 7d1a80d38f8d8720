"""``zoo doctor --markdown FILE`` writes the report into FILE's zoo-doctor block: an existing file keeps the rest of
its text, a new file (in an existing folder) is created holding the block. A FILE it cannot write ends in one line
naming it and the fix, before the report runs, not a traceback after it: a missing folder (a typo), a folder, a
file or folder it may not write."""
import os

import pytest

from zoo import doctor
from zoo.cli import main
from zoo.doctor import BEGIN, END


def _refused(capsys, target) -> str:
    assert main(["doctor", "--markdown", str(target)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and str(target) in captured.err, captured.err
    assert captured.out == ""   # refused before the report ran
    return captured.err.strip()


@pytest.mark.parametrize("kind, words", [("missing folder", "mkdir -p"), ("folder", "is a folder"),
                                         ("file for a folder", "is a file, not a folder")])
def test_a_markdown_target_that_cannot_be_written_is_one_line(tmp_path, capsys, kind, words):
    target = tmp_path / "docs" / "BENCHMARKS.md"
    if kind == "folder":
        target.mkdir(parents=True)
    if kind == "file for a folder":
        (tmp_path / "docs").write_text("not a folder\n")
    err = _refused(capsys, target)
    assert words in err and len(err.splitlines()) == 1, err
    assert kind == "folder" or not target.exists()


def test_an_existing_markdown_file_gets_its_block(tmp_path, capsys):
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("# Benchmarks\n")
    assert main(["doctor", "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.startswith("# Benchmarks\n") and text.count(BEGIN) == 1 and text.count(END) == 1
    assert capsys.readouterr().out.strip() in text


def test_a_new_markdown_file_is_created_with_the_block(tmp_path, capsys):
    target = tmp_path / "NEW.md"
    assert main(["doctor", "--markdown", str(target)]) == 0
    report = capsys.readouterr().out.strip()
    text = target.read_text()
    assert text.startswith(BEGIN) and text.rstrip().endswith(END) and report in text
    assert main(["doctor", "--markdown", str(target)]) == 0   # written again: the block is replaced, not added
    assert target.read_text().count(BEGIN) == 1


@pytest.mark.parametrize("existing", [True, False])
def test_a_file_or_folder_that_may_not_be_written_is_refused(tmp_path, capsys, monkeypatch, existing):
    target = tmp_path / "BENCHMARKS.md"
    if existing:
        target.write_text("# Benchmarks\n")
    denied = target if existing else tmp_path
    real_access = os.access
    monkeypatch.setattr(doctor.os, "access",   # permissions as a user without write access sees them
                        lambda path, mode: False if os.fspath(path) == os.fspath(denied) else real_access(path, mode))
    err = _refused(capsys, target)
    assert ("chmod" if existing else "cannot create a file in") in err, err
    assert target.read_text() == "# Benchmarks\n" if existing else not target.exists()
