"""Where prepared data lives: ``task.data_dir``, else ``$ZOO_DATA_DIR``, else ``~/.cache/mixer-zoo/data``."""
from __future__ import annotations

import os
from pathlib import Path


def data_root(o) -> Path:
    """The folder the prepared folders of the task options ``o`` go under."""
    return Path(o.data_dir or os.environ.get("ZOO_DATA_DIR") or Path.home() / ".cache" / "mixer-zoo" / "data")
