"""The numbers a commit's code gives for a table cell, before any training: run inside a checkout of that commit.

Read by :mod:`zoo.experiments.vouch`, which runs this file with the checkout first on ``sys.path`` (so it
imports that commit's ``zoo``, ``mixers`` and ``kernels``) and compares two commits. For each resolved recipe
given on stdin (a JSON list) it prints, as JSON: a hash of the task's first training and test sequences, the
model's loss on them at its seed, the gradient norm of every parameter, the names of the parameters that the
commit's optimizer decays, the learning-rate schedule at a few steps, and what the commit's end-of-run metric
functions make of the untrained model on the first test sequences. It uses only names that every commit
since recipes were resolved from mappings has (``zoo.recipes.resolve``, ``zoo.model.HybridLM``) and looks the
others up in both layouts.
"""
import contextlib
import hashlib
import json
import os
import sys

import torch


def _mapping(plain: dict) -> dict:
    """A row's resolved recipe as a recipe mapping: per-layer options back inside the layer list."""
    plain = json.loads(json.dumps(plain))
    model = plain["model"]
    options = model.pop("layer_options", None)
    if options is not None:
        model["layers"] = [{name: opts} if opts else name for name, opts in zip(model["layers"], options)]
    return plain


def _task(recipe):
    try:
        from zoo.tasks import Task
        return Task.from_spec(recipe.task)
    except (ImportError, AttributeError):
        from zoo.train import build_task
        return build_task(recipe)


def _decayed(model, recipe) -> list[str]:
    try:
        from zoo.training.optim import param_groups
    except ImportError:
        from zoo.train import _param_groups as param_groups
    decayed = {id(p) for g in param_groups(model, 0.1) if g["weight_decay"] > 0 for p in g["params"]}
    return sorted(name for name, p in model.named_parameters() if id(p) in decayed)


def _schedule(recipe) -> list[float]:
    try:
        from zoo.training.optim import lr_at
    except ImportError:
        from zoo.train import lr_at
    steps = recipe.train.steps
    return [round(lr_at(s, recipe), 12) for s in sorted({0, 1, steps // 4, steps // 2, steps - 1, steps})]


def probe(plain: dict) -> dict:
    from zoo.model import HybridLM
    from zoo.recipes import resolve
    recipe = resolve(_mapping(plain))
    task = _task(recipe)
    train, test = task.make("train", recipe.seed), task.make("test", recipe.seed)
    batch = train.batch(torch.arange(min(8, len(train))))
    digest = _digest(batch, test.batch(torch.arange(min(8, len(test)))))
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size)
    loss = _loss(model, batch)
    loss.backward()
    grads = {name: float(p.grad.norm()) if p.grad is not None else 0.0 for name, p in model.named_parameters()}
    return {"data": digest, "loss": float(loss.detach()), "grads": grads, "decayed": _decayed(model, recipe),
            "schedule": _schedule(recipe), "evaluation": _evaluation(model, recipe, task),
            "metrics": _metrics(model, recipe, task, test.batch(torch.arange(min(8, len(test)))))}


def _digest(*batches) -> str:
    """A hash of the batches' inputs, labels and masks."""
    digest = hashlib.sha256()
    for data in batches:
        for tensor in (data.inputs, data.labels, data.mask):
            if tensor is not None:
                digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def _loss(model, batch) -> torch.Tensor:
    """The model's mean cross-entropy on ``batch``'s supervised positions."""
    logits = model(batch.inputs, mask=batch.mask)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1),
                                             ignore_index=-100)


def _evaluation(model, recipe, task) -> dict:
    """What the end-of-run evaluation reads beyond the training length and task: per ``eval.seq_lens`` length and
    per ``eval.tasks`` entry (at the training length and at each of those lengths), a hash of the first test
    sequences and the untrained model's loss on the first two of them; and per value of an ``eval.test_time_sweep``
    knob some layer declares (``<knob>=<value>``), the loss on the first two test sequences in eval mode under
    that value, as the end-of-run evaluation reads them. A commit that cannot compute an entry (an older layout)
    records why, and that entry is not compared."""
    from zoo.tasks import Task
    entries = [(f"@{L}", task, L) for L in recipe.eval.seq_lens]
    for label, spec in getattr(recipe, "eval_tasks", []):
        for L in [None, *recipe.eval.seq_lens]:
            entries.append((f"task={label}" + (f"@{L}" if L else ""), spec, L))
    out = {}
    with torch.no_grad():
        for label, source, L in entries:
            try:
                t = source if hasattr(source, "make") else Task.from_spec(source)
                data = t.make("test", recipe.seed, **({"seq_len": L} if L else {}))
                first = data.batch(torch.arange(min(2, len(data))))
                out[label] = {"data": _digest(first), "loss": float(_loss(model, first))}
            except Exception as err:  # noqa: BLE001 - an older commit without this API: not compared
                out[label] = {"error": f"{type(err).__name__}: {err}"[:200]}
        for knob, values in (getattr(recipe.eval, "test_time_sweep", None) or {}).items():
            for value in values:
                try:
                    if knob not in model.test_time_knobs():
                        continue  # the end-of-run evaluation skips a knob no layer declares
                    data = task.make("test", recipe.seed)
                    first = data.batch(torch.arange(min(2, len(data))))
                    model.eval()
                    with model.test_time({**(recipe.eval.test_time or {}), knob: value}):
                        out[f"{knob}={value}"] = {"data": _digest(first), "loss": float(_loss(model, first))}
                except Exception as err:  # noqa: BLE001 - an older commit without test-time knobs: not compared
                    out[f"{knob}={value}"] = {"error": f"{type(err).__name__}: {err}"[:200]}
                finally:
                    model.train()
    return out


def _metrics(model, recipe, task, first) -> dict:
    """The end-of-run metric functions of the commit on the untrained model and the first test sequences (in
    batches of 4, so that pooling across batches is exercised; under ``eval.test_time``, as at the end of a run):
    loss, accuracy and sequence accuracy, and for a text task bits per byte, perplexity and the loss by position;
    with the numbers of supervised positions and of rows with one, which bound how far a near-tie in an argmax
    can move an accuracy. A commit without these functions records why, and they are not compared."""
    try:
        from zoo.training.evaluation import evaluate_data
        cpu = torch.device("cpu")
        knobs = getattr(recipe.eval, "test_time", None) or {}
        with torch.no_grad(), (model.test_time(knobs) if hasattr(model, "test_time") else contextlib.nullcontext()):
            out = dict(evaluate_data(model, first, 4, cpu))
            supervised = first.labels != -100
            out["positions"], out["rows"] = int(supervised.sum()), int(supervised.any(1).sum())
            if hasattr(task, "token_bytes"):
                from zoo.training.evaluation import text_metrics
                out.update({f"text_{k}": v for k, v in text_metrics(model, first, task.token_bytes(), 4, cpu).items()})
        return out
    except Exception as err:  # noqa: BLE001 - an older commit without these functions: not compared
        return {"error": f"{type(err).__name__}: {err}"[:200]}


def _only_this_checkout() -> None:
    """Import nothing of the zoo from anywhere but the checkout in the working folder: an editable install's
    import hook would otherwise fill a module this commit lacks (e.g. a later layout's) from another tree."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
    import zoo
    here = os.path.realpath(os.getcwd())
    if not os.path.realpath(zoo.__file__).startswith(here + os.sep):
        raise SystemExit(f"the probe imported zoo from {zoo.__file__}, not from the checkout {here}")


def main() -> None:
    _only_this_checkout()
    torch.set_num_threads(1)
    out = []
    for plain in json.load(sys.stdin):
        try:
            out.append(probe(plain))
        except Exception as err:  # noqa: BLE001 - an older commit may not know a recipe field: reported, compared as such
            out.append({"error": f"{type(err).__name__}: {err}"[:300]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
