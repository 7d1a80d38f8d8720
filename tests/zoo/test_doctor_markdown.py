"""``zoo doctor --markdown FILE`` with a FILE it cannot rewrite ends in one line naming it, not a traceback after
the whole report: a missing file (a typo), a folder. An existing file gets its zoo-doctor block."""
import pytest

from zoo.cli import main
from zoo.doctor import BEGIN, END


@pytest.mark.parametrize("kind, words", [("missing", "no such file"), ("folder", "is a folder")])
def test_a_markdown_target_that_cannot_be_rewritten_is_one_line(tmp_path, capsys, kind, words):
    target = tmp_path / "BENCHMARKS.md"
    if kind == "folder":
        target.mkdir()
    assert main(["doctor", "--markdown", str(target)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and words in captured.err and str(target) in captured.err, captured.err
    assert captured.out == ""   # refused before the report ran
    assert kind == "folder" or not target.exists()


def test_an_existing_markdown_file_gets_its_block(tmp_path, capsys):
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("# Benchmarks\n")
    assert main(["doctor", "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.startswith("# Benchmarks\n") and text.count(BEGIN) == 1 and text.count(END) == 1
    assert capsys.readouterr().out.strip() in text
