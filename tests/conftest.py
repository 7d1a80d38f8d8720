"""Test-wide setup: run Triton kernels through the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined, i.e. before the
kernel modules are imported, which is why it happens here at collection time.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: trains a model; part of the default run but kept small")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run, but a failing seed is printed so it can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    yield seed
