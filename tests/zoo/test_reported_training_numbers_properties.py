"""The training loss and accuracy a run reports. A step's numbers are those of the model it started from on its
batch: a one-step run reports as ``train_loss`` / ``train_accuracy`` the mean cross-entropy and the fraction of correct
argmax predictions over the supervised positions of its first batch, recomputed here with torch directly from
the initial model (built from the recipe's seed) and the first batch of the data order, whatever the
gradient accumulation. Over a run, ``train_loss`` / ``train_accuracy`` are the running averages
``ema <- 0.95 * ema + 0.05 * x`` of the per-step numbers, started at the first step's value."""
import pytest
import torch
import torch.nn.functional as F

from zoo import train
from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.tasks import Task
from zoo.training import loop
from zoo.training.state import ORDER_SEED_OFFSET

from .test_train import TINY


def initial_model_and_first_batch(recipe):
    """The model a run of ``recipe`` starts from (built from its seed) and the first batch its data order draws."""
    task = Task.from_spec(recipe.task)
    data = task.make("train", recipe.seed)
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size)
    order = torch.Generator().manual_seed(recipe.seed + ORDER_SEED_OFFSET)
    return model, data.batch(torch.randperm(len(data), generator=order)[:recipe.train.batch_size])


def _first_step_by_hand(recipe):
    model, batch = initial_model_and_first_batch(recipe)
    with torch.no_grad():
        logits = model(batch.inputs, mask=batch.mask).double()
    supervised = batch.labels != -100
    loss = F.cross_entropy(logits[supervised], batch.labels[supervised]).item()
    accuracy = (logits.argmax(-1)[supervised] == batch.labels[supervised]).double().mean().item()
    return loss, accuracy, int(supervised.sum()), supervised.numel()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_one_step_run_reports_the_initial_models_numbers_on_its_first_batch(grad_accum):
    seed = int(torch.randint(1000, ()))
    recipe = resolve(TINY, [f"seed={seed}", "task.vocab_size=8", "train.batch_size=32", "train.steps=1",
                            "train.warmup_steps=1", "train.eval_every=0", f"train.grad_accum={grad_accum}"])
    loss, accuracy, supervised, positions = _first_step_by_hand(recipe)
    assert supervised < positions  # the batch holds unsupervised positions the numbers must leave out
    metrics = train(recipe, progress=False).metrics
    assert metrics["steps"] == 1
    assert metrics["train_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["train_accuracy"] == pytest.approx(accuracy, rel=1e-12, abs=1e-12)


def test_reported_training_numbers_are_the_running_averages_of_the_steps(monkeypatch):
    real = loop._read
    per_step = []

    def recording(run, queued):
        out = real(run, queued)
        per_step.append(out)
        return out

    monkeypatch.setattr(loop, "_read", recording)
    result = train(resolve(TINY, ["train.steps=7", "train.eval_every=0"]), progress=False)
    assert len(per_step) == 7 and result.metrics["steps"] == 7
    loss, accuracy = per_step[0]
    for step_loss, step_accuracy in per_step[1:]:
        loss = 0.95 * loss + 0.05 * step_loss
        accuracy = 0.95 * accuracy + 0.05 * step_accuracy
    assert result.metrics["train_loss"] == pytest.approx(loss, rel=1e-12)
    assert result.metrics["train_accuracy"] == pytest.approx(accuracy, rel=1e-12, abs=1e-15)
    assert len({round(x, 9) for x, _ in per_step}) > 1  # the steps' losses differ, so the weights matter
