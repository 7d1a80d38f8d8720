"""What a result was produced on: library versions, the code's commit, the device and the threads.

One capture for every record the zoo writes (ablation rows, ``zoo bench``, checkpoints), so a table can
say what it ran on and a cell can be re-run exactly. Versions come from the installed package metadata
(importing flash-attn or mamba-ssm just to read a version is slow and noisy).
"""
from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

#: version key -> distribution names that provide it (the first one installed wins)
PACKAGES = {
    "triton": ("triton",), "einops": ("einops",), "fla": ("flash-linear-attention", "fla-core"),
    "flash_attn": ("flash-attn", "flash_attn"), "mamba_ssm": ("mamba-ssm", "mamba_ssm"),
    "mixer-zoo": ("mixer-zoo",),
}


def _version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


@functools.lru_cache(maxsize=None)
def _git_commit() -> str | None:
    """The checkout's commit, read once per process (see the call below the function)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git, not a checkout: the commit is simply unknown
        return None


# read when the code is loaded, not when a row is written: a long run whose checkout moves on (a commit made
# while it trains) still records the commit of the code it runs
_git_commit()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def environment(device: torch.device | str | None = None) -> dict:
    """``{"versions": {...}, "device": ..., "device_name": ..., "threads": ..., ...}`` for a record."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions.update({key: v for key, dists in PACKAGES.items() if (v := _version(dists)) is not None})
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
    commit = _git_commit()
    if commit:
        versions["git"] = commit
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_name()} ({torch.get_num_threads()} threads)"
    return {"versions": versions, "device": str(device), "device_name": name, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}
