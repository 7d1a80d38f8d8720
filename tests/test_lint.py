"""The whole tree passes the linter configured in pyproject.toml (ruff), as CI runs it with the test suite."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_the_whole_tree():
    # the test extra pins ruff, so every machine reads the same rules the same way
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
