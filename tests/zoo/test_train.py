"""Training: reproducible on a CPU, learns, and the one-line swap trains the swapped model."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo import train
from zoo.recipes import resolve
from zoo.training import checkpoint
from zoo.training.optim import lr_at

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_same_seed_same_numbers():
    recipe = resolve(TINY)
    a, b = train(recipe, progress=False).metrics, train(recipe, progress=False).metrics
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert a[key] == b[key], key
    other = resolve(TINY, ["seed=4"])
    assert train(other, progress=False).metrics["test_loss"] != a["test_loss"]


def test_loss_decreases():
    recipe = resolve(TINY, ["train.steps=40", "train.eval_every=0", "model.layers=[attention]"])
    before = resolve(TINY, ["train.steps=1", "train.warmup_steps=1", "model.layers=[attention]"])
    assert train(recipe, progress=False).metrics["test_loss"] < train(before, progress=False).metrics["test_loss"] - 0.2


def test_schedule_warms_up_then_decays_to_the_floor():
    recipe = resolve(TINY, ["train.steps=100", "train.warmup_steps=10", "train.min_lr_ratio=0.1"])
    lrs = [lr_at(s, recipe) for s in range(100)]
    assert lrs[0] == 0.1 and abs(lrs[9] - 1.0) < 1e-12
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert abs(lr_at(100, recipe) - 0.1) < 1e-12


def test_one_line_swap_on_the_command_line():
    result = subprocess.run([sys.executable, "-m", "zoo", "train", str(TINY), "--json", "--no-progress",
                             "model.layers.1=attention"], capture_output=True, text=True)  # overrides after flags
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)  # --json prints nothing but the JSON
    assert out["recipe"]["model"]["layers"] == ["attention", "attention"]
    assert 0.0 <= out["metrics"]["test_accuracy"] <= 1.0


def test_test_time_sweep_evaluates_one_trained_model_at_several_knob_values():
    recipe = resolve(TINY, ["model.layers=[gka]", "model.mixer_options={gka: {n_heads: 2, chunk_size: 8}}",
                            "train.steps=3", "eval.test_time_sweep={num_iter: [0, 2, 30]}"])
    result = train(recipe, progress=False)
    m = result.metrics
    assert {"test_accuracy@num_iter=0", "test_accuracy@num_iter=2", "test_accuracy@num_iter=30"} <= set(m)
    gka = result.model.blocks[0].mixer
    assert gka._test_time == {} and gka.options.num_iter == 30, "the sweep must restore the mixer's own setting"
    from zoo import build_task
    from zoo.training.evaluation import evaluate_data as evaluate
    data = build_task(recipe).make("test", recipe.seed)
    with result.model.test_time({"num_iter": 2}):
        assert evaluate(result.model, data, 128, torch.device("cpu"))["accuracy"] == m["test_accuracy@num_iter=2"]
    # and the knob really changes the computation: no iterations is gated linear attention
    x = torch.randn(1, 12, 32)
    gka.eval()
    with result.model.test_time({"num_iter": 0}):
        y0 = gka(x)
    with result.model.test_time({"num_iter": 30}):
        y30 = gka(x)
    assert not torch.allclose(y0, y30)
    # training ignores evaluation overrides: the knob is a test-time setting only
    gka.train()
    with result.model.test_time({"num_iter": 0}):
        assert torch.allclose(gka(x), gka(x)) and gka.knob("num_iter") == 30


def test_periodic_evaluations_read_the_model_under_the_test_time_knobs_as_the_final_one(monkeypatch):
    """The history's test accuracy (and early stopping on it) is the end-of-run test_accuracy at earlier steps:
    both under eval.test_time."""
    from zoo.training import loop
    seen = []
    evaluate = loop.evaluate_data

    def spy(model, *args, **kwargs):
        was_training = model.training
        model.eval()   # a knob acts in evaluation mode only, which evaluate_data sets
        seen.append(model.blocks[0].mixer.knob("num_iter"))
        model.train(was_training)
        return evaluate(model, *args, **kwargs)
    monkeypatch.setattr(loop, "evaluate_data", spy)
    iters = int(torch.randint(0, 5, ()))
    recipe = resolve(TINY, ["model.layers=[gka]", "model.mixer_options={gka: {n_heads: 2, chunk_size: 8}}",
                            "train.steps=3", "train.eval_every=1", f"eval.test_time={{num_iter: {iters}}}"])
    result = train(recipe, progress=False)
    assert [h["step"] for h in result.history] == [1, 2]
    assert seen[:2] == [iters, iters], seen
    assert result.model.blocks[0].mixer.knob("num_iter") == 30   # the mixer's own setting is restored


def test_a_knob_no_mixer_declares_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "zoo", "check", str(TINY), "eval.test_time={num_iters: 3}"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean 'num_iter'" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _zoo_env(*paths):
    import os
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), *map(str, paths)]),
            "OMP_NUM_THREADS": "1"}


def test_piped_training_prints_plain_progress_on_stderr_and_json_alone_on_stdout():
    result = subprocess.run([sys.executable, "-m", "zoo", "train", str(TINY), "--json", "train.eval_every=2"],
                            capture_output=True, text=True, env=_zoo_env(), timeout=300)  # pipes: not a terminal
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if " step " in line]
    assert [line.split(" step ")[1].split()[0] for line in lines] == ["2/6", "4/6"], result.stderr
    assert all(" loss " in line and " acc " in line and " elapsed " in line for line in lines)
    assert "\r" not in result.stderr  # no progress bar redraws in a pipe


OUT_OF_TREE = '''"""A mixer defined outside the library: a running mean of a projection."""
from dataclasses import dataclass

import torch
from torch import nn

from mixers.base import Mixer, register_mixer
from mixers.options import opt


@register_mixer
class RunningMean(Mixer):
    name = "running_mean_example"
    description = "running mean of a linear projection"
    state_formula = "d_model + 1"

    @dataclass
    class Options:
        scale: float = opt(1.0, "output scale", above=0.0)

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.proj = nn.Linear(d_model, d_model)

    def prefill(self, x, mask=None):
        total = self.proj(x).cumsum(1)
        count = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return self.options.scale * total / count, {"sum": total[:, -1], "count": count[:, -1].expand(x.shape[0], 1)}

    def init_state(self, batch_size, device=None, dtype=None):
        return {"sum": torch.zeros(batch_size, self.d_model, device=device, dtype=dtype),
                "count": torch.zeros(batch_size, 1, device=device, dtype=dtype)}

    def step(self, x_t, state):
        total, count = state["sum"] + self.proj(x_t), state["count"] + 1
        return self.options.scale * total / count, {"sum": total, "count": count}

    def state_size(self, seq_len):
        return self.d_model + 1
'''


def test_an_out_of_tree_mixer_named_by_imports_trains_and_evaluates_from_the_cli(tmp_path):
    import uuid
    module = f"oot_mixer_{uuid.uuid4().hex[:8]}"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / f"{module}.py").write_text(OUT_OF_TREE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {TINY}\nimports: [{module}]\n"
                      "model: {layers: [running_mean_example, {attention: {n_heads: 2}}], "
                      "mixer_options: {running_mean_example: {scale: 0.5}}}\n")
    env = _zoo_env(tmp_path / "pkg")
    run = subprocess.run([sys.executable, "-m", "zoo", "train", str(recipe), "--json", "--no-progress", "--out",
                          str(tmp_path / "run"), "train.steps=4"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    trained = json.loads(run.stdout)
    assert trained["recipe"]["model"]["layers"][0] == "running_mean_example"
    assert trained["recipe"]["model"]["layer_options"][0] == {"scale": 0.5}
    state = checkpoint.load(tmp_path / "run" / "checkpoint.pt")
    assert state["imports"] == [module] and state["model"]["blocks.0.mixer.proj.weight"].shape == (32, 32)
    from mixers import build_mixer
    attention = build_mixer("attention", 32, {"n_heads": 2}).state_size(16)
    assert trained["metrics"]["state_size"] == 33 + attention  # the out-of-tree layer's d_model + 1 counted
    run = subprocess.run([sys.executable, "-m", "zoo", "eval", str(tmp_path / "run"), f"imports=[{module}]", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)  # the user names the module it trusts
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["metrics"]["test_accuracy"] == trained["metrics"]["test_accuracy"]


def test_precision_and_compile_options(monkeypatch):
    import pytest

    from zoo.errors import UserError
    with pytest.raises(UserError, match="fp64"):
        resolve(TINY, ["train.precision=fp64"])
    base = train(resolve(TINY, ["train.steps=3"]), progress=False).metrics
    fp32 = train(resolve(TINY, ["train.steps=3", "train.precision=fp32"]), progress=False).metrics
    assert fp32["test_loss"] == base["test_loss"]  # auto is fp32 on a CPU
    bf16 = train(resolve(TINY, ["train.steps=3", "train.precision=bf16"]), progress=False).metrics
    assert math.isfinite(bf16["test_loss"]) and bf16["test_loss"] != base["test_loss"]  # autocast is on
    assert abs(bf16["test_loss"] - base["test_loss"]) < 0.1

    def broken_compile(model, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler")
        return run
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.warns(UserWarning, match="torch.compile is unavailable here .*no C\\+\\+ compiler.*training eagerly"):
        fallback = train(resolve(TINY, ["train.steps=3", "train.compile=true"]), progress=False).metrics
    assert fallback["test_loss"] == base["test_loss"]


def test_tracking_is_optional_and_named_when_missing(tmp_path):
    import importlib.util

    import pytest

    from zoo.errors import UserError
    recipe = resolve(TINY, ["train.steps=3", "train.tracking=tensorboard", f"train.tracking_dir={tmp_path}"])
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(UserError, match=r"pip install 'mixer-zoo\[tracking\]'"):
            train(recipe, progress=False)
    else:
        train(recipe, progress=False)
        assert list(tmp_path.glob("events.out.tfevents.*"))
    assert resolve(TINY, ["train.tracking=tensorboard"]).key == resolve(TINY).key  # bookkeeping only


def test_the_tracker_logs_each_step_with_the_learning_rate_it_took(monkeypatch):
    """Steps are recorded one step late at times (zoo.training.loop._read_at_once): each logged step still
    carries its own loss and the learning rate of its own update (warm-up then cosine, zoo.training.optim)."""
    from zoo.training import loop
    logged = []

    class Recorder:
        def log(self, step, values):
            logged.append((step, values))

        def close(self):
            pass
    monkeypatch.setattr(loop, "make_tracker", lambda *args, **kwargs: Recorder())
    steps = 7
    recipe = resolve(TINY, [f"train.steps={steps}", "train.warmup_steps=3", "train.tracking=tensorboard",
                            "train.eval_every=4", f"seed={int(torch.randint(0, 1000, ()))}"])
    train(recipe, progress=False)
    per_step = [(s, v) for s, v in logged if "train/lr" in v]
    assert [s for s, _ in per_step] == list(range(1, steps + 1))
    for step, values in per_step:
        assert values["train/lr"] == pytest.approx(recipe.train.lr * lr_at(step - 1, recipe), rel=1e-12), step
    assert len({v["train/loss"] for _, v in per_step}) == steps  # each step's own loss


def test_a_diverged_model_reports_nan_accuracy_not_a_plausible_number():
    """The argmax of NaN logits is token 0: a diverged cell must not read as a (low) accuracy."""
    from zoo import build_task
    from zoo.model import HybridLM
    from zoo.training.evaluation import evaluate_data as evaluate
    recipe = resolve(TINY)
    task = build_task(recipe)
    model = HybridLM.from_recipe(recipe, task.vocab_size)
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    metrics = evaluate(model, task.make("test", recipe.seed), 64, torch.device("cpu"))
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["accuracy"]) and math.isnan(metrics["sequence_accuracy"])


def test_the_dry_step_that_compiles_kernels_ahead_changes_nothing_and_reads_no_kernel_output():
    """On CUDA, ``zoo train`` compiles a step's kernels before its first step by running the model's forward and
    backward (kernels.ahead.dry_forward_backward) with the kernels compiled, not run. Here a hybrid of every
    mixer runs that pass on the GPU path with the kernels not run and every allocation poisoned (NaN, indices
    out of range), as a NaN-filled layer output flows into the next layer: it gets through, launches Triton
    kernels, keeps no gradient and leaves the random stream where it was."""
    from kernels.ahead import dry_forward_backward
    from kernels.device import gpu_path_on_cpu
    from mixers import MIXERS
    from tests.mixers.launches import count_launches
    from zoo import build_model, build_task

    names = MIXERS.builtin_names("mixers")
    recipe = resolve(TINY, [f"model.layers=[{', '.join(names)}]", "model.mixer_options={}"])
    model = build_model(recipe)
    model.register_forward_pre_hook(lambda module, args: torch.rand(1) and None)  # draws, as dropout would
    batch = build_task(recipe).make("train", recipe.seed).batch(torch.arange(4))
    rng = torch.get_rng_state()
    with gpu_path_on_cpu():
        launches, by_name = count_launches(lambda: dry_forward_backward(model, batch.inputs, mask=batch.mask),
                                           execute=False)
    assert sum(n for k, n in by_name.items() if k.startswith("triton:")) > 0
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
