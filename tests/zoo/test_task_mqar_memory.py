"""MQAR's without-replacement draws (keys and values: the first entries of a random permutation per row) are
made a block of rows at a time: the examples equal those of one draw over every row (recomputed here the
direct way, at a block of a few rows), and generating at a large vocabulary holds one block's draws in
memory, not all rows' (measured in a fresh process as its peak resident memory)."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

import zoo.tasks.mqar as mqar
from mixers.options import build_options
from zoo.tasks import TASKS


def make(**options):
    cls = TASKS.get("mqar")
    return cls(build_options(cls.Options, options))


def test_blocked_draws_give_the_examples_of_one_draw(monkeypatch):
    seed = int(torch.randint(2 ** 31, ()))
    spec = {"vocab_size": 64, "num_kv_pairs": 6, "random_fill": True}
    monkeypatch.setattr(mqar, "DRAW_BLOCK_ELEMENTS", 70)  # two rows of 31 keys per block
    got = make(**spec).generate(9, 32, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    keys = torch.argsort(torch.rand(9, 31, generator=g), dim=1)[:, :6] + 1
    values = torch.argsort(torch.rand(9, 32, generator=g), dim=1)[:, :6] + 32
    assert torch.equal(got.inputs[:, 0:12:2], keys) and torch.equal(got.inputs[:, 1:12:2], values)
    monkeypatch.setattr(mqar, "DRAW_BLOCK_ELEMENTS", 2 ** 22)
    whole = make(**spec).generate(9, 32, torch.Generator().manual_seed(seed))
    for name in ("inputs", "labels", "mask"):
        assert torch.equal(getattr(got, name), getattr(whole, name)), name


PEAK = """
import json, resource, torch
from mixers.options import build_options
from zoo.tasks import TASKS
cls = TASKS.get("mqar")
task = cls(build_options(cls.Options, {"vocab_size": 65536, "num_kv_pairs": 8}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data = task.generate(1500, 64, torch.Generator().manual_seed(0))
print(json.dumps({"grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "max_id": int(data.inputs.max())}))
"""


def test_a_large_vocabulary_holds_one_block_of_draws():
    """1,500 rows at a vocabulary of 65,536: one draw of all rows' keys held 1,500 x 32,767 uniforms and their
    order (the process grew by 668 MiB); a block holds 4 Mi of each (it grows by about 120 MiB, sorting included)."""
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": ""})
    result = json.loads(out.stdout)
    assert result["max_id"] < 65536
    assert result["grew_mib"] < 200, result
