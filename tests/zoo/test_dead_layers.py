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
    for command in (["train", str(QUICKSTART), "--out", str(tmp_path / "train")],
                    ["ablate", str(QUICKSTART), "--out", str(tmp_path / "ablate"), "--no-progress"]):
        code = main([*command, "model.layers.1=ska"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and "model.layers.1 (ska)" in err[-1] and "chunk_size=64" in err[-1], err
        assert not any(p.suffix in (".pt", ".jsonl") for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_a_grid_cell_with_a_dead_layer_is_named(capsys, tmp_path):
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {QUICKSTART}\ngrid:\n  - {{label: fine, model.layers: [mamba2, attention]}}\n"
                      f"  - {{label: silent, model.layers: [mamba2, ska]}}\n")
    code = main(["ablate", str(recipe), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "grid cell 'silent'" in err[-1] and "model.layers.1 (ska)" in err[-1], err
