"""A layer that cannot contribute at a recipe's lengths is refused by ``zoo check`` (and so before any
training): one line naming the layer, the mixer, the option and a value that works; the value it names
passes."""
import re
from pathlib import Path

from zoo.cli import main

QUICKSTART = Path(__file__).parents[2] / "recipes" / "ablations" / "quickstart.yaml"


def check(capsys, *overrides):
    code = main(["check", str(QUICKSTART), *overrides])
    return code, capsys.readouterr().err.strip()


def test_ska_with_the_default_chunk_size_is_refused_at_the_quickstart_length(capsys):
    code, err = check(capsys, "model.layers.1=ska")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.layers.1 (ska)" in err and "seq_len 32" in err and "chunk_size=64" in err
    working = re.search(r"use chunk_size=(\d+)", err).group(1)
    code, err = check(capsys, "model.layers.1=ska", f"model.mixer_options.ska.chunk_size={working}")
    assert code == 0, err


def test_an_eval_length_where_the_layer_is_dead_is_refused_too(capsys):
    """Alive at the training length 32 (chunk_size 16), dead at a shorter test length."""
    code, err = check(capsys, "model.layers.1=ska", "model.mixer_options.ska.chunk_size=16", "eval.seq_lens=[16]")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "seq_len 16 (an eval.seq_lens length)" in err and "chunk_size=16" in err


def test_prefix_mode_reads_its_whole_prefix_at_any_length(capsys):
    code, err = check(capsys, "model.layers.1=ska", "model.mixer_options.ska.mode=prefix", "model.use_mask=true")
    assert code == 0, err


def test_train_and_ablate_refuse_before_anything_trains(capsys, tmp_path):
    """``zoo train`` trains the base, whose second layer the override makes a dead SKA; ``zoo ablate`` trains the
    cells, every one of which sets its own layers, so the same override changes nothing it trains."""
    for command, refusal in ((["train", str(QUICKSTART), "--out", str(tmp_path / "train")], "chunk_size=64"),
                             (["ablate", str(QUICKSTART), "--out", str(tmp_path / "ablate"), "--no-progress"],
                              "changes no cell of the grid")):
        code = main([*command, "model.layers.1=ska"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and refusal in err[-1], err
        assert not any(p.suffix in (".pt", ".jsonl") for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_a_grid_cell_with_a_dead_layer_is_named(capsys, tmp_path):
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {QUICKSTART}\ngrid:\n  - {{label: fine, model.layers: [mamba2, attention]}}\n"
                      f"  - {{label: silent, model.layers: [mamba2, ska]}}\n")
    code = main(["ablate", str(recipe), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "grid cell 'silent'" in err[-1] and "model.layers.1 (ska)" in err[-1], err


def test_each_command_checks_only_what_it_trains(capsys, tmp_path):
    """``zoo ablate`` trains a grid's cells and never its base; ``zoo train`` trains the base and never a cell: a
    dead layer in what the command does not train refuses nothing (both refused before), one in what it trains
    is named."""
    dead_base = tmp_path / "dead_base.yaml"        # the base's ska is dead at this length; no cell keeps it
    dead_base.write_text(f"extends: {QUICKSTART}\nmodel: {{layers: [mamba2, ska]}}\ngrid:\n"
                         f"  - {{label: a, model.layers: [mamba2, attention]}}\n"
                         f"  - {{label: b, model.layers: [attention, mamba2]}}\n")
    dead_cell = tmp_path / "dead_cell.yaml"        # the base is fine; cell 'silent' keeps a dead ska
    dead_cell.write_text(f"extends: {QUICKSTART}\ngrid:\n  - {{label: fine, model.layers: [mamba2, attention]}}\n"
                         f"  - {{label: silent, model.layers: [mamba2, ska]}}\n")
    steps = ["train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "train.threads=1"]
    assert main(["ablate", str(dead_base), "--out", str(tmp_path / "a"), "--no-progress", "--no-plot", *steps]) == 0
    assert main(["train", str(dead_cell), "--out", str(tmp_path / "t"), "--no-progress", *steps]) == 0
    capsys.readouterr()
    assert main(["train", str(dead_base), "--out", str(tmp_path / "t2"), "--no-progress", *steps]) == 2
    assert "model.layers.1 (ska)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["ablate", str(dead_cell), "--out", str(tmp_path / "a2"), "--no-progress", *steps]) == 2
    assert "grid cell 'silent'" in capsys.readouterr().err.strip().splitlines()[-1]
