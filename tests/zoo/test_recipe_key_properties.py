"""The recipe key (the name a run's rows and checkpoints are found by) against edits made here: every edit that
changes what a run computes or measures gives another key; a name, a description or a checkpoint interval
gives the same one."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import torch
import yaml

from zoo.recipes import resolve

TINY = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny.yaml").read_text())

COMPUTED = {
    "seed": lambda r: r.update(seed=r["seed"] + 1),
    "train.lr": lambda r: r["train"].update(lr=r["train"]["lr"] * 2),
    "train.weight_decay": lambda r: r["train"].update(weight_decay=0.02),
    "task.num_kv_pairs": lambda r: r["task"].update(num_kv_pairs=3),
    "model.d_model": lambda r: r["model"].update(d_model=48),
    "model.norm_eps": lambda r: r["model"].update(norm_eps=1e-6),
    "model.layers": lambda r: r["model"].update(layers=["mamba2", "attention"]),
    "model.mixer_options": lambda r: r["model"]["mixer_options"]["attention"].update(n_heads=4),
    "eval.seq_lens": lambda r: r.setdefault("eval", {}).update(seq_lens=[32]),
}
COSMETIC = {
    "name": lambda r: r.update(name="another"),
    "description": lambda r: r.update(description="the same run, described"),
    "train.checkpoint_every": lambda r: r["train"].update(checkpoint_every=7),
}


def edited(edit) -> dict:
    data = copy.deepcopy(TINY)
    edit(data)
    return data


def test_an_edit_to_what_a_run_computes_changes_the_key_and_a_cosmetic_one_does_not():
    base = resolve(copy.deepcopy(TINY)).key
    names = list(COMPUTED)
    random.Random(int(torch.randint(0, 2**31, ()))).shuffle(names)
    keys = {}
    for name in names:
        key = resolve(edited(COMPUTED[name])).key
        assert key != base, f"editing {name} keeps the key"
        keys[key] = name
    assert len(keys) == len(COMPUTED)  # no two edits share a key
    for name, edit in COSMETIC.items():
        assert resolve(edited(edit)).key == base, f"editing {name} changes the key"
