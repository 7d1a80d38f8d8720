"""What one optimizer step of a training run sees and when a run stops: the gradients the update reads have
the global norm ``train.grad_clip`` allows (``torch.nn.utils.clip_grad_norm_`` semantics, recomputed here from
the gradients themselves; under fp16 training after the gradient scaler's factor is taken out, as the loss is
multiplied by it before the backward pass), and a periodic evaluation whose accuracy reaches ``train.early_stop_acc`` exactly
ends the run at that step."""
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zoo import train
from zoo.recipes import resolve
from zoo.training import loop

from .test_train import TINY


def _gradient_norms_at_each_update(recipe) -> list[float]:
    """The global L2 norm of the gradients every AdamW update of a run of ``recipe`` reads."""
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad.double().flatten() for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        norms.append(torch.cat(grads).norm().item())

    handle = register_optimizer_step_pre_hook(record)
    try:
        train(recipe, progress=False)
    finally:
        handle.remove()
    return norms


def test_every_update_reads_gradients_clipped_to_the_declared_global_norm():
    clip = float(torch.empty(()).uniform_(1e-4, 1e-3))  # far below any raw gradient norm of this model
    recipe = resolve(TINY, ["train.steps=3", "train.eval_every=0", f"train.grad_clip={clip}"])
    norms = _gradient_norms_at_each_update(recipe)
    assert len(norms) == 3
    assert norms == pytest.approx([clip] * 3, rel=1e-4)


def test_fp16_updates_read_gradients_clipped_to_the_declared_norm_after_unscaling():
    """Clipping the scaled gradients would leave the update their norm divided by the scaler's factor, which
    AdamW's epsilon then swamps."""
    clip = float(torch.empty(()).uniform_(1e-3, 1e-2))
    recipe = resolve(TINY, ["train.steps=3", "train.eval_every=0", f"train.grad_clip={clip}",
                            "train.precision=fp16", "train.device=cpu"])
    norms = _gradient_norms_at_each_update(recipe)
    assert norms, "no update ran: every fp16 step found an overflow"
    assert norms == pytest.approx([clip] * len(norms), rel=1e-3)


def test_without_clipping_the_update_reads_the_raw_gradients_whose_norm_exceeds_a_small_clip():
    recipe = resolve(TINY, ["train.steps=3", "train.eval_every=0", "train.grad_clip=0"])
    norms = _gradient_norms_at_each_update(recipe)
    assert len(norms) == 3 and min(norms) > 1e-2


@pytest.mark.parametrize("threshold", [0.25, 0.5, 1.0])
def test_an_evaluation_reaching_the_early_stop_accuracy_exactly_ends_the_run(monkeypatch, threshold):
    """The periodic evaluation at step 4 reports accuracy equal to the threshold (the one before it below it):
    the run stops right there, with 4 steps and one more evaluation in its history than steps 2."""
    real = loop.evaluate_data
    seen = []

    def scripted(model, data, batch_size, device, precision="auto"):
        ev = real(model, data, batch_size, device, precision)
        seen.append(ev)
        return {**ev, "accuracy": threshold if len(seen) == 2 else threshold / 2}

    monkeypatch.setattr(loop, "evaluate_data", scripted)
    recipe = resolve(TINY, ["train.steps=12", "train.eval_every=2", f"train.early_stop_acc={threshold}"])
    result = train(recipe, progress=False)
    assert result.metrics["steps"] == 4
    assert [h["step"] for h in result.history] == [2, 4]
    assert result.history[-1]["test_accuracy"] == threshold
