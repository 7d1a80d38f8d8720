"""The README's paragraph on several processes and tracking names the curves ``train.tracking`` logs and the folder
it logs them in: those must be the names and the folder a run uses.

The tracker is replaced by one that records what it is given, so the check needs neither TensorBoard nor
Weights & Biases; the recipe (seed, learning rate, evaluation interval) is drawn afresh on every run.
"""
import fnmatch
import random
import re
from pathlib import Path

from zoo import train
from zoo.recipes import resolve
from zoo.training import loop
from zoo.training.tracking import Tracker, default_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _tracking_paragraph() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("`train.tracking:")
    return text[start:text.index("`results.jsonl` stays the record", start)]


def _documented_curves() -> set[str]:
    return set(re.findall(r"`((?:train|test|final)/[\w*]+)`", _tracking_paragraph()))


class _Recorder(Tracker):
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []
        self.closed = False

    def log(self, step, values):
        self.logged.append((step, dict(values)))

    def close(self):
        self.closed = True


def test_the_tracked_curves_are_the_ones_the_readme_names(tmp_path, monkeypatch):
    steps = random.randint(4, 7)
    every = random.randint(2, steps - 1)
    overrides = [f"seed={random.randint(0, 10_000)}", f"train.steps={steps}", "train.warmup_steps=1",
                 f"train.eval_every={every}", f"train.lr={random.uniform(1e-3, 5e-3)}", "train.threads=1"]
    recipe = resolve(TINY, overrides)
    recorder, asked = _Recorder(), []

    def make(recipe_, checkpoint_dir=None, resume_step=0):
        asked.append(default_dir(recipe_, checkpoint_dir))
        return recorder

    monkeypatch.setattr(loop, "make_tracker", make)
    out = tmp_path / "run"
    train(recipe, progress=False, checkpoint_dir=out)

    assert asked == [out / "tracking"]  # the README: DIR/tracking with --out DIR
    assert recorder.closed
    documented = _documented_curves()
    assert documented, _tracking_paragraph()
    logged = {key for _, values in recorder.logged for key in values}
    undocumented = {k for k in logged if not any(fnmatch.fnmatchcase(k, pattern) for pattern in documented)}
    assert not undocumented, (undocumented, documented)
    never = {p for p in documented if not any(fnmatch.fnmatchcase(k, p) for k in logged)}
    assert not never, (never, logged)

    per_step = {"train/loss", "train/accuracy", "train/loss_ema", "train/lr"}
    assert per_step <= documented
    assert [s for s, v in recorder.logged if per_step <= set(v)] == list(range(1, steps + 1))
    evaluated = [s for s, v in recorder.logged if "test/accuracy" in v]
    assert evaluated == [s for s in range(1, steps) if s % every == 0]
    final = [v for s, v in recorder.logged if any(k.startswith("final/") for k in v)]
    assert len(final) == 1 and {"final/test_loss", "final/test_accuracy"} <= set(final[0])


def test_the_tracking_folder_without_a_checkpoint_folder_is_the_one_the_readme_names():
    recipe = resolve(TINY, [f"seed={random.randint(0, 10_000)}"])
    assert "`runs/<recipe name>`" in _tracking_paragraph()
    assert default_dir(recipe, None) == Path("runs") / recipe.name
    chosen = f"elsewhere/{random.randint(0, 10_000)}"
    assert default_dir(resolve(TINY, [f"train.tracking_dir={chosen}"]), Path("out")) == Path(chosen)
