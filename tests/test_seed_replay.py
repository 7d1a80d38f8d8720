"""A failing randomized test prints its seed, and ZOO_TEST_SEED replays exactly the same draw: torch's, Python's
and NumPy's global generators alike."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

FAILING = '''
import random

import numpy as np
import torch

def test_draw():
    value = torch.randn(()).item()
    print("DRAW", repr((value, random.random(), float(np.random.rand()))).replace(" ", ""))
    assert value > 1e9
'''


def _run(folder, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(folder)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=folder)


def test_failing_test_prints_a_replayable_seed(tmp_path):
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_draw.py").write_text(FAILING)
    env = {k: "" for k in ("ZOO_TEST_SEED",) if k in os.environ}
    first = _run(tmp_path, env)
    assert first.returncode == 1
    seed = re.search(r"ZOO_TEST_SEED=(\d+)", first.stdout).group(1)
    draw = re.search(r"DRAW (\S+)", first.stdout).group(1)
    again = _run(tmp_path, {"ZOO_TEST_SEED": seed})
    assert re.search(r"DRAW (\S+)", again.stdout).group(1) == draw
    other = _run(tmp_path, {"ZOO_TEST_SEED": str(int(seed) + 1)})
    assert re.search(r"DRAW (\S+)", other.stdout).group(1) != draw
