"""``zoo data prepare --workers N`` stopped mid-run returns, whatever signal handlers its process holds.

A library or a launcher in the same process may install a Python SIGTERM handler that does not exit (Ray and
torch's elastic agent install handlers of their own). A worker forked from such a process inherits the handler,
so the pool's terminate() does not end it when it sits on a lock it inherited at the fork, and the pool's join
waits for ever (about one run in three, measured). The workers are spawned: fresh processes with neither. Each run
here is a child process with such a handler, interrupted while writing its parts, under a time limit.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.zoo.test_lm import random_corpus

ROOT = Path(__file__).resolve().parents[2]
RUNS = 4

SCRIPT = """
import signal, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from mixers.options import build_options
from zoo.data import prepare as prep
from zoo.tasks.lm import LanguageModeling

def interrupted_write(path, data, writes=[], real=prep._write_atomic):
    writes.append(path)
    if len(writes) == 3:
        raise KeyboardInterrupt
    real(path, data)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: None)   # a handler that returns, as some libraries install
    o = build_options(LanguageModeling.Options, {{"source": "files", "path": {corpus!r}, "doc_separator": "\\n\\n",
                                                 "val_fraction": 0.2, "seq_len": 16, "num_test": 8,
                                                 "data_dir": sys.argv[1]}}, "")
    prep.PART_DOCUMENTS = 2
    prep._write_atomic = interrupted_write
    try:
        prep.prepare(o, workers=2)
    except KeyboardInterrupt:
        print("returned")
"""


def test_an_interrupted_run_with_workers_returns_under_a_sigterm_handler_that_does_not_exit(tmp_path):
    corpus = random_corpus(tmp_path / "corpus", seed=int(torch.randint(1 << 30, ())))
    script = tmp_path / "prepare_interrupted.py"
    script.write_text(SCRIPT.format(root=str(ROOT), corpus=str(corpus / "*.txt")))
    for run in range(RUNS):
        try:
            out = subprocess.run([sys.executable, str(script), str(tmp_path / f"data{run}")], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {run}: the interrupted preparation did not return within 60 s "
                                 "(a worker outlived the pool's terminate)") from None
        assert out.returncode == 0 and out.stdout.strip() == "returned", (run, out.returncode, out.stderr[-2000:])
