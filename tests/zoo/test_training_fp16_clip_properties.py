"""Gradient clipping under fp16 training: the loss is multiplied by the gradient scaler's factor before the
backward pass, so the gradients must be unscaled before their global norm is clipped. Every update must read
gradients of global norm ``train.grad_clip`` (recomputed here from the gradients themselves), not that norm
divided by the scaler's factor, which AdamW's epsilon would then swamp."""
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zoo import train
from zoo.recipes import resolve

from .test_train import TINY


def test_fp16_updates_read_gradients_clipped_to_the_declared_norm_after_unscaling():
    clip = float(torch.empty(()).uniform_(1e-3, 1e-2))  # far below any raw gradient norm of this model
    recipe = resolve(TINY, ["train.steps=3", "train.eval_every=0", f"train.grad_clip={clip}",
                            "train.precision=fp16", "train.device=cpu"])
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
    assert norms, "no update ran: every fp16 step found an overflow"
    assert norms == pytest.approx([clip] * len(norms), rel=1e-3)
