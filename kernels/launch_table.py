"""Launch options measured on a GPU, one table per architecture: ``kernels/launch_tables/sm_<NN>.json``.

Every launcher but attention's (which autotunes among a few configurations, and is left alone here) fixes
``num_warps`` and ``num_stages`` for its kernels: a first call compiles one configuration. Which schedule is
fastest depends on the card and is found by measuring on it: ``python -m zoo.benchmark.launch_tune
--write-table`` times every variant of every kernel of a layer and, where the layer with each kernel at its
fastest computes what it did and is faster side by side, writes those variants into the table of the card's
architecture. :func:`kernels.launch.launch` then launches a kernel on a CUDA device of that architecture with
the table's options wherever an entry matches the launch exactly:

- the kernel (:func:`kernels.launch.kernel_name`),
- whether any of its tensors is bf16 / fp16 (the launchers choose their tiles by it),
- the value of every constexpr argument (block sizes, flags, modes),

that is, the very compiled configuration that was timed. Every other launch keeps its launcher's options, and
options given with :func:`kernels.launch.launch_options` (a tuning sweep) win over the table. Warps and pipeline
stages change how a kernel is scheduled, never what it computes.

A table is JSON::

    {"format": 1, "arch": 90, "entries": [
      {"kernel": "delta._fwd_state", "sixteen_bit": true,
       "constexprs": {"BT": 64, "BV": 32, "H": 8, "HAS_H0": false, "K": 128, "V": 128},
       "num_warps": 8, "num_stages": 2,
       "measured": {"card": "NVIDIA H200", "commit": "1a2b3c4", "mixer": "gated_deltanet", "T": 16384,
                    "d_model": 1024, "head_dim": 128, "dtype": "bf16", "launcher_ms": 1.21, "ms": 0.93}}]}

``measured`` says where an entry comes from. ``python -m zoo.benchmark.launch_table_check`` (the test-suite runs
it) records that layer's launches again without a GPU and fails an entry that no launch matches any more (its
launcher changed since it was measured) or that does not compile for its architecture with its options; the
compile check and ``first_compile`` compile each launch with its architecture's options.
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

#: where the tables live (one file per architecture)
TABLE_DIR = Path(__file__).resolve().parent / "launch_tables"
FORMAT = 1
#: what an entry's ``measured`` holds (the compile check re-records the layer from it)
MEASURED_KEYS = ("card", "commit", "mixer", "T", "d_model", "head_dim", "dtype", "launcher_ms", "ms")


#: the architecture :func:`kernels.launch.launch` takes every launch to run on (:func:`as_if_arch`), else None
forced_arch: int | None = None
_directory: str | None = None


def directory() -> str | None:
    """The folder tables are read from (None: :data:`TABLE_DIR`)."""
    return _directory


@contextlib.contextmanager
def as_if_arch(arch: int, tables: Path | None = None):
    """Inside, every launch looks up the launch table of ``sm_<arch>`` (in ``tables``, default
    :data:`TABLE_DIR`) whatever its tensors' device: the GPU's choice of options, checked without a GPU."""
    global forced_arch, _directory
    outer = forced_arch, _directory
    forced_arch, _directory = int(arch), (str(tables) if tables is not None else outer[1])
    try:
        yield
    finally:
        forced_arch, _directory = outer


class LaunchTableError(ValueError):
    """A launch table that cannot be read: the message names the file, the entry and how to fix it."""


def table_path(arch: int, directory: Path | None = None) -> Path:
    return Path(directory or TABLE_DIR) / f"sm_{int(arch)}.json"


def _plain(value):
    """A constexpr value as JSON holds it (``tl.constexpr`` wraps some)."""
    return getattr(value, "value", value)


def config_key(sixteen_bit: bool, constexprs: dict) -> tuple:
    """A launch's configuration as the tables key it: 16-bit tensors or not, and every constexpr value."""
    return bool(sixteen_bit), tuple(sorted((str(k), _plain(v)) for k, v in constexprs.items()))


def entry_key(entry: dict) -> tuple:
    """What a launch must match to take an entry: its kernel and its configuration (:func:`config_key`)."""
    return (entry["kernel"],) + config_key(entry["sixteen_bit"], entry["constexprs"])


def _check_entry(path: Path, i: int, entry) -> None:
    where = f"{path}: entry {i}"
    if not isinstance(entry, dict):
        raise LaunchTableError(f"{where} is a {type(entry).__name__}, not a mapping; each entry is "
                               "{kernel, sixteen_bit, constexprs, num_warps, num_stages, measured}")
    missing = [k for k in ("kernel", "sixteen_bit", "constexprs", "num_warps", "num_stages", "measured")
               if k not in entry]
    if missing:
        raise LaunchTableError(f"{where} ({entry.get('kernel', '?')}) lacks {missing}; write tables with "
                               "python -m zoo.benchmark.launch_tune --write-table")
    if not isinstance(entry["constexprs"], dict) or not isinstance(entry["measured"], dict):
        raise LaunchTableError(f"{where} ({entry['kernel']}): constexprs and measured must be mappings")
    lacking = [k for k in MEASURED_KEYS if k not in entry["measured"]]
    if lacking:
        raise LaunchTableError(f"{where} ({entry['kernel']}): measured lacks {lacking} (where the entry was "
                               "measured; the compile check records that layer again from them)")
    warps, stages = entry["num_warps"], entry["num_stages"]
    if not (isinstance(warps, int) and warps in (1, 2, 4, 8, 16, 32)):
        raise LaunchTableError(f"{where} ({entry['kernel']}): num_warps {warps!r} is not a power of two "
                               "from 1 to 32")
    if not (isinstance(stages, int) and 1 <= stages <= 8):
        raise LaunchTableError(f"{where} ({entry['kernel']}): num_stages {stages!r} is not an integer from 1 to 8")


def read(path: Path) -> dict:
    """The table in ``path`` (validated), as JSON holds it; an empty table where there is no file."""
    path = Path(path)
    named = path.stem.removeprefix("sm_")
    if not (path.stem.startswith("sm_") and named.isdigit()):
        raise LaunchTableError(f"{path}: a launch table is named sm_<NN>.json for its architecture (sm_90.json)")
    if not path.exists():
        return {"format": FORMAT, "arch": int(named), "entries": []}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LaunchTableError(f"{path}: not a readable JSON launch table ({err}); restore it from git or "
                               "delete it (its kernels then keep their launchers' options)") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise LaunchTableError(f"{path}: expected {{'format': {FORMAT}, 'arch': N, 'entries': [...]}}")
    if data.get("arch") != int(named):
        raise LaunchTableError(f"{path}: says arch {data.get('arch')!r} but its name is for {path.stem}")
    seen = set()
    for i, entry in enumerate(data["entries"]):
        _check_entry(path, i, entry)
        key = entry_key(entry)
        if key in seen:
            raise LaunchTableError(f"{path}: entry {i} ({entry['kernel']}) repeats the launch of an earlier "
                                   "entry; keep one")
        seen.add(key)
    return data


@functools.lru_cache(maxsize=None)
def options_by_kernel(arch: int, directory: str | None = None) -> dict:
    """``{kernel: {config_key: {"num_warps": w, "num_stages": s}}}`` of the architecture's table (empty without
    one); read once per process."""
    out: dict = {}
    for entry in read(table_path(arch, directory and Path(directory)))["entries"]:
        name, *config = entry_key(entry)
        out.setdefault(name, {})[tuple(config)] = {"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]}
    return out


def lookup(arch: int, kernel: str, sixteen_bit: bool, constexprs: dict, directory: str | None = None) -> dict | None:
    """The table's options for this launch, or None."""
    return options_by_kernel(arch, directory).get(kernel, {}).get(config_key(sixteen_bit, constexprs))


def merge(arch: int, new_entries: list[dict], directory: Path | None = None) -> Path:
    """Write ``new_entries`` into the architecture's table: each replaces an entry for the same launch, the
    others stay. Returns the file written."""
    path = table_path(arch, directory)
    table = read(path)
    by_key = {entry_key(e): e for e in table["entries"]}
    for i, entry in enumerate(new_entries):
        _check_entry(path, i, entry)
        by_key[entry_key(entry)] = entry
    table["entries"] = sorted(by_key.values(), key=lambda e: (e["kernel"], not e["sixteen_bit"],
                                                              json.dumps(e["constexprs"], sort_keys=True)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    options_by_kernel.cache_clear()
    return path


def tables() -> list[Path]:
    """The architectures' table files that exist."""
    return sorted(TABLE_DIR.glob("sm_*.json"))
