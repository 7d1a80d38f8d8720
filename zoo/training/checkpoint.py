"""Training checkpoints: everything needed to resume a run exactly, and to evaluate it later.

A checkpoint is ``<dir>/checkpoint.pt``, one ``torch.save`` of a dict holding the model weights, the
optimizer state, the learning-rate schedule position, the gradient scaler (fp16), the step, the
data-order state (current permutation, cursor and the order generator's state), the RNG states
(torch CPU, CUDA if any, python ``random``, numpy's), the history and the running
averages of the displayed loss and accuracy, elapsed training time, whether training finished, and
the resolved recipe (plain dict, key, and the modules that define its out-of-tree components).

Why ``torch.save`` and not safetensors: safetensors stores flat tensors only, while the optimizer
state is nested (per-parameter dicts, step counters, param groups with hyper-parameters) and the RNG
states and history are tuples, ints and floats. Everything saved is a tensor or a plain Python
container of str/int/float/bool/None (numpy's RNG array is stored as a list), so checkpoints load
with ``torch.load(..., weights_only=True)``: loading never runs code from the file.

Writes are atomic: the dict goes to a temporary file in the same folder, is fsynced, then replaces
the old checkpoint with ``os.replace``, so a kill at any moment leaves the previous checkpoint or the
new one, never a torn file (a temporary file a killed writer leaves is removed by the next run:
:func:`remove_orphans`). A write that fails (a full disk) is refused in one line naming the file and the operating
system's reason, and leaves the checkpoint before it as it was.

Integrity: the state is serialised once more inside the file, next to its SHA-256 (format 2), so a flipped
byte anywhere in it is found at load instead of giving silently different numbers. A checkpoint that does
not load or fails its checksum is reported in one line; a run resuming in that folder moves it aside
(:func:`move_aside`) and starts its training over. Format 1 checkpoints (no checksum) still load.
"""
from __future__ import annotations

import hashlib
import io
import os
import random
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from mixers import MIXERS, STATE_MIXERS

from ..errors import UserError, error_summary
from ..paths import not_a_regular_file
from ..recipes.plain import recipe_differences
from ..tasks import TASKS

FILENAME = "checkpoint.pt"
FORMAT = 2
READABLE_FORMATS = (1, 2)
#: where torch's message for a file that is not plain data gives its reason, after its advice
_UNPICKLER = "WeightsUnpickler error:"


def path_in(location: str | Path) -> Path:
    """``location/checkpoint.pt`` for a folder (whatever its name, ``run.pt`` too); ``location`` itself if it is a
    file (or a pipe or device, which :func:`load` refuses by name) or a missing path ending in ``.pt``."""
    location = Path(location)
    if location.is_dir():
        return location / FILENAME
    return location if location.exists() or location.suffix == ".pt" else location / FILENAME


def check_same_model(path: Path, state: dict, key: str) -> None:
    """Refuse a checkpoint whose stored recipe now resolves to ``key``, another key than the one it was trained
    under: the model built from it would differ from the one its weights were trained in."""
    if key != state["recipe_key"]:
        raise UserError(f"{path}: its recipe no longer resolves to the key it was trained under "
                        f"({key} != {state['recipe_key']}); a default changed since it was written: use it with the "
                        f"mixer-zoo version it was trained with (the commit its results row records as versions.git)")


def tokenizer_record(task) -> dict:
    """``{"tokenizer_fingerprint": ...}`` for a checkpoint of a task that reads text with a tokenizer (else empty)."""
    fingerprint = getattr(task, "tokenizer_fingerprint", None)
    recorded = fingerprint() if callable(fingerprint) else None
    return {"tokenizer_fingerprint": recorded} if recorded else {}


def check_same_tokenizer(path: Path, state: dict, task) -> None:
    """Refuse a language-model checkpoint whose tokenizer (a file named by its path) now has other contents than
    when it was trained: the same vocabulary size reads the weights, but with other tokens. A checkpoint that
    recorded no fingerprint (older ones) is not checked."""
    recorded = state.get("tokenizer_fingerprint")
    if recorded and recorded != tokenizer_record(task).get("tokenizer_fingerprint", recorded):
        raise UserError(f"{path}: its tokenizer {task.options.tokenizer!r} has other contents than the one it was "
                        f"trained with (a file replaced under the same name?); put the original back at that path")


def check_weights_fit(path: Path, weights: dict, model: torch.nn.Module, recipe, fix: str) -> None:
    """Refuse in one line the weights of a checkpoint that the model built from its recipe cannot take (instead
    of ``load_state_dict``'s traceback): a vocabulary that changed since (a tokenizer file edited or replaced under
    the same name) is named as such; any other difference names the first tensors that differ. ``fix`` says what
    to do instead."""
    ours = model.state_dict()
    missing = [k for k in ours if k not in weights]
    unexpected = [k for k in weights if k not in ours]
    shapes = [k for k in ours if k in weights and tuple(getattr(weights[k], "shape", ())) != tuple(ours[k].shape)]
    if not (missing or unexpected or shapes):
        return
    if "embed.weight" in shapes:
        rows, now = weights["embed.weight"].shape[0], ours["embed.weight"].shape[0]
        tokenizer = getattr(recipe.task.options, "tokenizer", None)
        source = f"its tokenizer {tokenizer!r}" if tokenizer else f"its task {recipe.task.name!r}"
        raise UserError(f"{path}: the model has a vocabulary of {rows} tokens but {source} now has {now}; {fix}")
    parts = [f"{k}: {tuple(weights[k].shape)} in the checkpoint, {tuple(ours[k].shape)} here" for k in shapes[:2]]
    parts += [f"missing {', '.join(missing[:3])}"] if missing else []
    parts += [f"not in this model: {', '.join(unexpected[:3])}"] if unexpected else []
    raise UserError(f"{path}: its weights do not fit the model its recipe builds ({'; '.join(parts)}); {fix}")


def save(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically; a write that fails (a full disk, a folder gone read-only) is refused
    in one line naming the file and the reason, and leaves the checkpoint there before it as it was."""
    inner = io.BytesIO()
    torch.save(state, inner)
    payload = inner.getvalue()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            torch.save({"format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
                        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        stop = _cause(err, KeyboardInterrupt)
        if stop is not None:  # a Ctrl-C or a SIGTERM while torch's writer was writing: a stop, not a failed write
            raise stop from None
        failed = _cause(err, OSError)
        reason = failed.strerror if failed is not None and failed.strerror else error_summary(failed or err)
        raise UserError(f"{path}: cannot write the checkpoint of step {state.get('step')} ({reason}); "
                        f"make room or fix the folder") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _cause(err: BaseException, kind: type) -> BaseException | None:
    """The exception of type ``kind`` behind ``err``, itself or one it was raised while handling: torch's zip
    writer reports whatever its file's ``write`` raised (an OSError of a full disk, the KeyboardInterrupt of a
    Ctrl-C) as a RuntimeError of its own, with that exception as its context."""
    while err is not None and not isinstance(err, kind):
        err = err.__context__
    return err


def _unreadable(err: Exception) -> str:
    """``Type: reason`` of a failed ``torch.load``, in a few words: torch's own reason without its advice to
    load the file with ``weights_only=False`` (checkpoints are read as plain data on purpose)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    if _UNPICKLER in text:  # torch's advice comes first, its reason after this marker
        text = text.split(_UNPICKLER, 1)[1]
        found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
        if found:
            text = f"it holds a {found.group(1)} object, not plain data"
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    reason = line.split(". ")[0].rstrip(".")[:160]
    if "weights_only" in reason:  # advice in a wording this version does not know
        reason = "not plain data"
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def _torch_load(source, map_location, path: Path):
    """``torch.load`` as plain data; a file it cannot read is refused in one line, without the warnings torch gives
    on the way (a pickle of another protocol), which are shown only for a file that loads."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = torch.load(source, map_location=map_location, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged or foreign file: say so in one line
            raise UserError(f"{path}: not a readable mixer-zoo checkpoint ({_unreadable(err)}); the file is damaged "
                            f"or was not written by zoo train") from None
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return loaded


def load(path: Path, map_location="cpu") -> dict:
    if not path.exists():
        raise UserError(f"{path}: no checkpoint here (zoo train RECIPE --out DIR writes DIR/{FILENAME})")
    problem = not_a_regular_file(path.stat(), "a checkpoint", f"a run folder or its {FILENAME}")
    if problem:  # a pipe or a device would block the read or never end it
        raise UserError(f"{path}: {problem}")
    outer = _torch_load(path, map_location, path)
    if not isinstance(outer, dict) or outer.get("format") not in READABLE_FORMATS:
        raise UserError(f"{path}: not a mixer-zoo checkpoint (formats {READABLE_FORMATS})")
    if outer["format"] == 1:
        return outer
    payload = outer.get("payload")
    data = payload.numpy().tobytes() if isinstance(payload, torch.Tensor) else b""
    if hashlib.sha256(data).hexdigest() != outer.get("sha256"):
        raise UserError(f"{path}: the checkpoint is damaged (its checksum does not match its contents)")
    state = _torch_load(io.BytesIO(data), map_location, path)
    if not isinstance(state, dict):
        raise UserError(f"{path}: not a mixer-zoo checkpoint (its contents are not a state dict)")
    return state


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged-<unix time>`` beside it; returns the new path."""
    target = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    os.replace(path, target)
    return target


def remove_orphans(folder: Path) -> list[Path]:
    """Remove the temporary files of checkpoint writes whose process is gone (killed mid-write)."""
    removed = []
    for tmp in folder.glob(f".{FILENAME}.*.tmp") if folder.is_dir() else []:
        pid = tmp.name.split(".")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_same_recipe(state: dict, recipe, path: Path) -> None:
    """Refuse to resume a checkpoint written for a different recipe, naming the differences."""
    if state["recipe_key"] == recipe.key:
        return
    diff = "; ".join(recipe_differences(state["recipe"], recipe.plain)) or "recipe hashes differ"
    raise UserError(f"{path} holds a checkpoint of recipe {state['recipe_key']}, not of this recipe {recipe.key} "
                      f"({diff}); resume with the same recipe, or use another folder")


# ------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------ recipes
def imports_for(recipe) -> list[str]:
    """Modules outside this library that define the recipe's mixers, state mixer or task: those its
    ``imports:`` names, else the modules of the out-of-tree classes it uses."""
    if recipe.imports:
        return sorted(recipe.imports)
    classes = [MIXERS.get(s.name) for s in recipe.layers] + [STATE_MIXERS.get(recipe.state_mixer.name),
                                                              TASKS.get(recipe.task.name)]
    ours = ("mixers", "zoo", "kernels", "__main__")
    return sorted({c.__module__ for c in classes if c.__module__.split(".")[0] not in ours})
