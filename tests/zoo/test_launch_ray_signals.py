"""A scheduler's SIGTERM to ``zoo ablate --executor ray`` while its cells train stops the run as it stops a
sequential one: a line saying so and how to resume, exit status 143."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_stops_a_ray_ablation_as_it_stops_a_sequential_one(tmp_path):
    """A scheduler's SIGTERM while Ray cells train: the driver says it stopped and how to resume, exit 143 (Ray's
    own answer aborted it with a stack dump, exit 134)."""
    pytest.importorskip("ray")
    recipe = tmp_path / "grid.yaml"  # the test hook holds the cell until a file that never comes
    recipe.write_text(f"extends: {TINY}\nimports: [tests.zoo.ray_hooks]\ngrid:\n"
                      f"  - {{label: held, description: 'wait-for:{tmp_path / 'never'}'}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "RAY_ADDRESS": ""}
    driver = subprocess.Popen([sys.executable, "-m", "zoo", "ablate", str(recipe), "--out", str(tmp_path / "out"),
                               "--executor", "ray", "--no-plot", "--no-progress"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "running 1 cell on ray" not in driver.stdout.readline():
            assert driver.poll() is None and time.monotonic() < deadline, driver.stderr.read()[-3000:]
        time.sleep(float(torch.rand(())))  # the cell held on its worker, the driver waiting for it
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "zoo: stopped by SIGTERM; run the same command again to resume" in err, err[-3000:]
    assert "SIGTERM received" not in err
    assert not (tmp_path / "out" / "results.jsonl").exists()
