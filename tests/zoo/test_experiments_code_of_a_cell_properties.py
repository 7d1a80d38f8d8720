"""The code of a cell, read from a small module tree written here: relative imports resolve against the importing
module's package (one dot: its own package; two: the one above), a package's ``__init__`` resolves against itself,
modules are followed transitively, and the infrastructure modules (mixer contract, option parsing, dispatch) are
left out while the modules they sit beside are kept."""
from __future__ import annotations

import random

import torch

from zoo.experiments.freshness import code_modules, imported_modules


def _tree(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_relative_imports_resolve_against_the_importing_package():
    text = ("from . import base\nfrom .mqar import make\nfrom ..data import corpus\nfrom .. import model\n"
            "import mixers.gla\nimport torch\nfrom kernels.backend import pick\n")
    assert imported_modules("zoo.tasks.recall", text) == {
        "zoo.tasks", "zoo.tasks.base", "zoo.tasks.mqar", "zoo.tasks.mqar.make", "zoo.data", "zoo.data.corpus",
        "mixers.gla", "kernels.backend", "kernels.backend.pick"}


def test_a_cells_modules_are_followed_transitively_without_the_infrastructure(tmp_path):
    rng = random.Random(torch.initial_seed())
    sub = f"part{rng.randrange(100)}"
    _tree(tmp_path, {
        "mixers/__init__.py": "from .base import Mixer\n",
        "mixers/base.py": "from mixers.options import parse\n",
        "mixers/options.py": "",
        "mixers/fancy/__init__.py": f"from .{sub} import scan\n",       # a package: `.` is the package itself
        f"mixers/fancy/{sub}.py": "from ..base import Mixer\nfrom ..common import norm\n",
        "mixers/common.py": "from kernels.scan import fused\n",
        "mixers/unused.py": "",
        "kernels/__init__.py": "",
        "kernels/backend.py": "",
        "kernels/scan.py": "from . import backend\nfrom .util import pad\n",
        "kernels/util.py": "",
    })
    found = code_modules(tmp_path, frozenset({"mixers.fancy"}))
    assert found == {"mixers.fancy", f"mixers.fancy.{sub}", "mixers.common", "kernels.scan", "kernels.util"}
