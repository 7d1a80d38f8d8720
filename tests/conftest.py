"""Test-wide setup: run Triton kernels through the CPU interpreter when there is no GPU (and stop at once,
with the fix, where the installed Triton and NumPy cannot interpret them).

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined, i.e. before the
kernel modules are imported, which is why it happens here at collection time.
"""
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ``pytest -n N`` (pytest-xdist) runs N worker processes: each takes its share of the cores instead of all of
# them, as N processes of torch's default thread count on few cores stall one another at every thread barrier
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped cleanly without one)")
    config.addinivalue_line("markers", "slow: trains a model; part of the default run but kept small")
    from kernels.backend import triton_interpreter_problem, triton_interpreting

    problem = triton_interpreting() and triton_interpreter_problem()
    if problem:  # every interpreted kernel test would fail with NumPy's TypeError: stop with the fix instead
        pytest.exit(f"the tests check the Triton kernels through the interpreter, but {problem}", returncode=4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SEED_VARIABLE = "ZOO_TEST_SEED"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs every run; a failing test prints its seed, and ZOO_TEST_SEED=<seed> replays it. The
    seed sets torch's, Python's and NumPy's global generators, so a test drawing from any of them replays."""
    fixed = os.environ.get(SEED_VARIABLE)
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed takes 32 bits
    request.node.zoo_seed = seed
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "zoo_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"torch seed {seed}; replay with: "
                                               f"{SEED_VARIABLE}={seed} python -m pytest '{item.nodeid}'"))
