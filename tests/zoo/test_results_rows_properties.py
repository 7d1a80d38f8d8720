"""Appending a results row after a line a kill cut short (zoo.rows.append_row): the new row starts a line of
its own, so reading finds it beside every earlier whole row, and a repair moves only the cut line aside."""
import json

import torch

from zoo.rows import append_row, read_rows, repair_rows


def _row(i: int) -> dict:
    return {"recipe_key": f"k{i}", "label": f"cell {i}", "recipe": {"seed": i}, "metrics": {"test_accuracy": i / 10}}


def test_a_row_appended_after_a_cut_line_is_read_and_survives_the_repair(tmp_path):
    path = tmp_path / "results.jsonl"
    whole = int(torch.randint(0, 4, ()))
    for i in range(whole):
        append_row(path, _row(i))
    cut = json.dumps(_row(99))[: int(torch.randint(1, 30, ()))].encode()
    with open(path, "ab") as fh:
        fh.write(cut)  # a write a kill interrupted: no line end
    append_row(path, _row(whole))
    lines = path.read_bytes().split(b"\n")
    assert lines[whole] == cut and lines[-1] == b""
    assert json.loads(lines[whole + 1]) == _row(whole)
    assert read_rows(path) == [_row(i) for i in range(whole + 1)]
    rows, damaged = repair_rows(path)
    assert rows == [_row(i) for i in range(whole + 1)]
    assert [d.raw.rstrip(b"\n") for d in damaged] == [cut]
    assert read_rows(path) == rows
