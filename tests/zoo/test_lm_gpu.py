"""The GPU language-model grid (recipes/ablations/lm_gpu.yaml) checked on a CPU: every cell built at full
size (parameters within 15 % of attention's, heads, short convolutions, one token budget, enough
evaluations), and scripts/lm_gpu.sh run end to end at toy size on a small library tree."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import zoo
from mixers import MIXERS
from tests.registry import builtin_mixer_names
from zoo.experiments.results import table_columns
from zoo.model import HybridLM
from zoo.recipes import resolve

from .test_lm import lm_recipe
from .test_stdlib_corpus import make_tree

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "ablations" / "lm_gpu.yaml"
SCRIPT = ROOT / "scripts" / "lm_gpu.sh"
HYBRIDS = {"mamba2 + attention": {"mamba2", "attention"}, "gka + attention": {"gka", "attention"},
           "echo hybrid": {"mamba2", "ska"}}
#: option names of a short convolution (a width, or a switch)
CONV_OPTIONS = ("conv_size", "d_conv", "use_short_conv")


@pytest.fixture(scope="module")
def cells():
    return {cell.label: cell.recipe for cell in resolve(RECIPE).cells}


def layer_names(recipe) -> list[str]:
    return [spec.name for spec in recipe.layers]


def test_the_grid_holds_every_registered_mixer_and_the_three_hybrids_as_8_layer_models(cells):
    assert set(cells) == set(builtin_mixer_names()) | set(HYBRIDS)
    for name in builtin_mixer_names():
        assert layer_names(cells[name]) == [name] * 8
    for label, mixers in HYBRIDS.items():
        assert len(cells[label].layers) == 8 and set(layer_names(cells[label])) == mixers
    assert layer_names(cells["echo hybrid"]) == ["mamba2", "ska"] * 4  # Mamba-2 then SKA
    assert cells["echo hybrid"].state_mixer.name == "koopman_mlp"


def test_every_cell_is_within_15_percent_of_attentions_parameters(cells):
    counts = {}
    for label, recipe in cells.items():
        with torch.device("meta"):  # full size, no memory, no initialisation
            model = HybridLM.from_recipe(recipe, 257)
        counts[label] = sum(p.numel() for p in model.parameters())
    attention = counts["attention"]
    far = {label: f"{n / attention - 1:+.1%}" for label, n in counts.items() if abs(n / attention - 1) > 0.15}
    assert not far, f"parameters against attention's {attention:,}: {far}"


def test_heads_of_64_to_128_and_each_mixers_usual_short_convolution(cells):
    for label, recipe in cells.items():
        d_model = recipe.model.d_model
        for spec in recipe.layers:
            o = spec.options
            defaults = {f.name: f.default for f in dataclasses.fields(MIXERS.get(spec.name).Options)}
            if hasattr(o, "n_heads") or hasattr(o, "headdim"):
                width = next((getattr(o, k) for k in ("head_dim", "headdim", "d_v", "value_dim") if getattr(o, k, None)),
                             None) or d_model // o.n_heads
                assert 64 <= width <= 128, f"{label}: {spec.name} has heads of {width}"
            for key in CONV_OPTIONS:  # on, at the mixer's default width (at least 2 taps)
                if hasattr(o, key):
                    value = getattr(o, key)
                    assert value == defaults[key] and (value is True or (type(value) is int and value >= 2)), (label, key)


def test_one_token_budget_at_2048_in_bf16_with_eight_evaluations_and_the_long_lengths(cells):
    written = yaml.safe_load(RECIPE.read_text())["train"]
    assert {"lr", "warmup_steps", "tokens"} <= set(written)  # fixed before the run, not left to defaults
    for label, recipe in cells.items():
        t, task = recipe.train, recipe.task.options
        assert task.seq_len == 2048 and task.source == "python-stdlib" and t.precision == "bf16", label
        assert t.tokens == written["tokens"] >= 20_000_000 and t.steps * t.batch_size * task.seq_len >= t.tokens
        assert len(range(t.eval_every, t.steps, t.eval_every)) >= 8, label  # periodic evaluations before the end
        assert {4096, 8192} <= set(recipe.eval.seq_lens), label


def test_language_model_tables_show_peak_memory_where_rows_have_it():
    row = {"metrics": {"val_bpb": 2.0, "val_bpb@4096": 2.1}}
    assert "peak_memory_mib" not in table_columns([row])
    assert "peak_memory_mib" in table_columns([row, {"metrics": {**row["metrics"], "peak_memory_mib": 812.5}}])


@pytest.mark.slow
def test_the_device_script_runs_the_grid_at_toy_size_on_the_cpu(tmp_path):
    tree = tmp_path / "Lib"
    make_tree(tree, n_modules=60)
    out = tmp_path / "table"
    env = {**os.environ, "PYTHON": sys.executable, "ZOO_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), f"task.path={tree}"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    labels = [cell.label for cell in resolve(RECIPE).cells]
    assert sorted(r["label"] for r in rows) == sorted(labels)
    for row in rows:
        m = row["metrics"]
        assert row["recipe"]["model"]["d_model"] == 32 and m["steps"] == 2
        assert all(math.isfinite(m[k]) for k in ("val_bpb", "val_bpb@64", "val_bpb@128", "train_tokens_per_second"))
        assert m["params"] > 0 and m["state_size"] > 0 and m["data_source_hash"]
        assert [h["step"] for h in row["history"]] == [1]
        assert m["cuda_graph"].startswith("eager: it needs a CUDA device")  # the recipe asks; a CPU cannot
    with open(out / "curves.csv") as fh:
        points = list(csv.DictReader(fh))
    for row in rows:
        mine = [p for p in points if p["cell"] == row["label"]]
        # bytes: every token is one byte, so bits per byte = nats per token / ln 2 at every point
        assert [int(p["tokens"]) for p in mine] == [0, 2 * 32, 2 * 2 * 32]
        assert float(mine[0]["val_bpb"]) == pytest.approx(row["step0_metrics"]["test_loss"] / math.log(2), rel=1e-5)
        assert float(mine[1]["val_bpb"]) == pytest.approx(row["history"][0]["test_loss"] / math.log(2), rel=1e-5)
        assert float(mine[2]["val_bpb"]) == pytest.approx(row["metrics"]["val_bpb"], rel=1e-6)
    assert (out / "curves.png").stat().st_size > 0 and (out / "results.md").exists()
    assert not (out / "checkpoints").exists()  # every cell has its row: the checkpoints are gone


@pytest.mark.gpu
def test_rows_on_cuda_report_the_training_peak_memory(tmp_path):
    result = zoo.train(lm_recipe(tmp_path, device="cuda"), progress=False)
    params = sum(p.numel() for p in result.model.parameters())
    # fp32 weights, their gradients and AdamW's two moments are all held during a step
    assert result.metrics["peak_memory_mib"] >= 16 * params / 2**20
