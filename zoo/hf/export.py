"""``zoo export RUN --to DIR``: a trained language model as a folder ``transformers`` loads.

The folder holds ``config.json`` (:class:`zoo.hf.config.ZooConfig`: the resolved recipe), the weights as
``model.safetensors``, ``generation_config.json`` (EOS), the run's tokenizer (``tokenizer.json`` and
``tokenizer_config.json``, :mod:`zoo.hf.tokenizer`) and a ``README.md`` with the recipe, the data and the
run's metrics (its ``results.jsonl`` rows). Everything is written into a temporary folder beside ``DIR``,
loaded back and compared with the checkpoint's weights bit for bit, then renamed to ``DIR``: an export that
fails leaves nothing behind. ``DIR`` must not exist or be an empty folder.

The config stores the test-time knob values (``config.test_time``) the loaded model computes with: the recipe's
``eval.test_time``, the values the run's metrics were measured under, so the exported model's logits are the
zoo model's under ``model.test_time(recipe.eval.test_time)`` and equal ``zoo generate``'s and the harness
adapter's. ``--test-time KNOB=VALUE`` (repeatable) sets one over the recipe's, checked as the recipe's are.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import torch
import yaml
from transformers.utils import logging as hf_logging

from ..errors import UserError
from ..generate import decode_notes, read_lm, resolve_test_time
from ..recipes.plain import layer_label
from ..reevaluate import load_model
from ..rows import read_rows
from . import tokenizer as hf_tokenizer
from .config import ZooConfig
from .model import ZooForCausalLM


def check_target(to: Path) -> None:
    if to.exists() and not to.is_dir():
        raise UserError(f"{to}: is a file, not a folder; zoo export writes a new folder (choose another --to)")
    if to.exists() and any(to.iterdir()):
        raise UserError(f"{to}: exists and is not an empty folder; zoo export writes a new folder (choose another "
                        f"--to, or remove it)")


@contextlib.contextmanager
def _quiet():
    """No progress bars from transformers while writing and reading back."""
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


#: how a ``--test-time`` item of ``zoo export`` is named in a refusal
TEST_TIME_FLAG = "zoo export: --test-time {}"


def export(checkpoint, to, imports: list[str] = (), test_time=()) -> tuple[Path, ZooForCausalLM, dict]:
    """Write the language model of ``checkpoint`` (a file or its folder) to the new folder ``to``, computing with
    the recipe's ``eval.test_time`` with ``test_time`` (``{knob: value}`` or ``KNOB=VALUE`` texts) over it; returns
    the checkpoint's path, the exported model and the checkpoint's ``step`` and ``finished``."""
    to = Path(to)
    check_target(to)
    path, state, recipe, task = read_lm(checkpoint, list(imports), command="zoo export")
    values = resolve_test_time(recipe, test_time, TEST_TIME_FLAG)
    tok = task.tokenizer
    config = ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, imports=state.get("imports", []),
                       vocab_size=task.vocab_size, test_time=values, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id,
                       bos_token_id=tok.eos_id)  # generate() without a prompt starts from EOS, as zoo generate does
    model = ZooForCausalLM(config, hybrid=load_model(state, recipe, torch.device("cpu"), path)).eval()
    tmp = to.parent / f".{to.name}.export-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        with _quiet():
            model.save_pretrained(str(tmp))
            hf_tokenizer.save(tok, tmp)
            _check_reloads(model, tmp)
        (tmp / "README.md").write_text(readme(path, state, recipe, model, to.name))
        if to.exists():
            to.rmdir()
        os.replace(tmp, to)
    except OSError as err:
        raise UserError(f"{to}: cannot write the export ({type(err).__name__}: {err.strerror or err}); nothing was "
                        f"written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, model, {"step": state.get("step"), "finished": state.get("finished"),
                         "steps": recipe.train.steps}


def _check_reloads(model: ZooForCausalLM, folder: Path) -> None:
    again = ZooForCausalLM.from_pretrained(str(folder))
    ours, theirs = model.state_dict(), again.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k]) for k in ours):
        raise RuntimeError(f"{folder}: the written weights do not load back equal to the checkpoint's")
    if again.config.test_time != model.config.test_time:
        raise RuntimeError(f"{folder}: the written config loads back with test-time knobs {again.config.test_time}, "
                           f"not {model.config.test_time}")


def _rows(path: Path, key: str) -> list[dict]:
    """The run's rows (training, and ``zoo eval`` of it) in ``results.jsonl`` beside the checkpoint, or, for an
    ablation cell's checkpoint (``<out>/checkpoints/<key>/checkpoint.pt``), in its ablation's ``<out>/results.jsonl``."""
    folders = [path.parent]
    if path.parent.parent.name == "checkpoints":
        folders.append(path.parent.parent.parent)
    return [r for folder in folders for r in read_rows(folder / "results.jsonl")
            if key in (r.get("recipe_key"), r.get("trained_recipe_key"))]


def _metrics_line(row: dict) -> str:
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row["metrics"].items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("data_"))
    return f"- `{row.get('label', '')}`: {shown}"


def _test_time_lines(recipe, model: ZooForCausalLM) -> list[str]:
    """What the README says of the test-time knobs the model computes with (none: nothing)."""
    values = model.config.test_time or {}
    if not values:
        return []
    shown = ", ".join(f"`{k}={v!r}`" for k, v in sorted(values.items()))
    same = values == {k: v for k, v in recipe.eval.test_time.items() if k in values}
    source = ("the recipe's `eval.test_time`, under which its metrics were measured" if same else
              f"set at export; the recipe's `eval.test_time`: {recipe.eval.test_time or 'none'}")
    return [f"In eval mode the model computes with the test-time knobs {shown} (`config.test_time`: {source}); "
            f"edit `config.test_time` to compute with other values.", ""]


def _decode_lines(model: ZooForCausalLM) -> list[str]:
    """What the README says where a layer decodes otherwise than its forward pass scores (none: nothing): ``generate``
    with the cache then draws from other logits than the forward (``use_cache=False``, the harness's scoring)."""
    notes = decode_notes(model.zoo)
    if not notes:
        return []
    return ["Decoding with the cache differs from the forward pass (scoring, `use_cache=False`): "
            + "; ".join(notes) + ".", ""]


def readme(path: Path, state: dict, recipe, model: ZooForCausalLM, name: str) -> str:
    rows = _rows(path, recipe.key)
    task = recipe.plain["task"]
    data = ", ".join(f"{k}: {v}" for k, v in task.items() if v not in ("", None, 0) and k != "name"
                     and (task.get("source") == "hf" or not k.startswith("hf_")))
    recorded = {k: v for row in rows for k, v in row["metrics"].items() if k.startswith("data_") and k != "data_source"}
    data += "".join(f"; {k[5:].replace('_', ' ')}: {v}" for k, v in recorded.items())
    layers = " + ".join(layer_label(e) for e in recipe.model.layer_entries())
    metrics = [_metrics_line(row) for row in rows] or [f"- no `results.jsonl` row beside the checkpoint (step "
                                                       f"{state.get('step')}, finished: {state.get('finished')})"]
    return "\n".join([
        "---", "library_name: transformers", "tags: [mixer-zoo]", "---", "",
        f"# {recipe.name or name}", "",
        f"A language model trained with mixer-zoo: {layers}, d_model {recipe.model.d_model}, "
        f"{model.zoo.num_params():,} parameters (recipe key `{recipe.key}`, step {state.get('step')}).", "",
        "## Use", "", "```python",
        "import zoo.hf  # pip install 'mixer-zoo[hf]': registers the model type mixer_zoo",
        *(f"import {m}  # defines layers of this model (loading refuses without it)" for m in state.get("imports", [])),
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model, tok = AutoModelForCausalLM.from_pretrained('{name}'), AutoTokenizer.from_pretrained('{name}')",
        "out = model.generate(**tok('The for statement', return_tensors='pt'), max_new_tokens=50)",
        "print(tok.decode(out[0]))", "```", "",
        "Each layer's decode state is the generation cache (`zoo.hf.ZooCache`): a linear-state layer decodes in "
        "constant time and memory per token.", "", *_decode_lines(model), *_test_time_lines(recipe, model),
        "## Data", "", f"Task `lm`: {data}.", "",
        "## Metrics", "", *metrics, "",
        "## Recipe", "", "```yaml", yaml.safe_dump(recipe.plain, sort_keys=False).rstrip(), "```", "",
    ])


def run(args) -> int:
    """The ``zoo export`` command."""
    path, model, progress = export(args.checkpoint, args.to, args.imports or [], args.test_time or [])
    knobs = ", ".join(f"{k}={v!r}" for k, v in sorted((model.config.test_time or {}).items()))
    imports = "".join(f"import {m}; " for m in model.config.imports or [])   # out-of-tree modules its layers need
    print(f"exported {path} ({' + '.join(model.config.mixers)}, {model.zoo.num_params():,} parameters"
          f"{f'; test-time knobs {knobs}' if knobs else ''}) to {args.to}; load it with: import zoo.hf; {imports}"
          f"AutoModelForCausalLM.from_pretrained({str(args.to)!r})")
    for note in decode_notes(model.zoo):  # as zoo generate says it: generate() with the cache decodes the same way
        print(f"zoo export: note: {note} (the exported model's generate() decodes through the same states)",
              file=sys.stderr)
    if progress["finished"] is False:
        print(f"zoo export: {path} is the checkpoint of an unfinished run (step {progress['step']} of "
              f"{progress['steps']}): the export holds a partly trained model; run the command that trained it again "
              f"to finish it, then export again", file=sys.stderr)
    return 0
