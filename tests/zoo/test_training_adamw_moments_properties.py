"""Several AdamW updates of ``make_optimizer`` against an explicit loop over the AdamW equations (Decoupled Weight
Decay Regularization, arXiv:1711.05101): the declared ``train.betas`` weigh the moment averages, the schedule's
learning rate changes between the updates, and decay reaches only the declared parameters. The first update
alone cannot tell the betas apart (its bias-corrected moments are the gradient and its square whatever the
betas), so the check runs three updates with a different gradient each."""
import pytest
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.optim import lr_at, make_optimizer

from .test_train import TINY

EPS = 1e-8  # torch's AdamW default, which make_optimizer keeps


def _hand_adamw(before, grads_per_step, lrs, betas, decayed, wd):
    """The parameters after the AdamW updates, step by step in float64."""
    b1, b2 = betas
    params = {n: p.double().clone() for n, p in before.items()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for k, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        for n in params:
            g = grads[n].double()
            if n in decayed:
                params[n] = params[n] * (1 - lr * wd)
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            m_hat, v_hat = m[n] / (1 - b1 ** k), v[n] / (1 - b2 ** k)
            params[n] = params[n] - lr * m_hat / (v_hat.sqrt() + EPS)
    return params


def test_three_updates_follow_the_declared_betas_and_the_scheduled_learning_rates():
    b1 = float(torch.empty(()).uniform_(0.3, 0.7))
    b2 = float(torch.empty(()).uniform_(0.5, 0.8))
    lr, wd, warmup = 0.02, float(torch.empty(()).uniform_(0.1, 0.5)), 3
    recipe = resolve(TINY, [f"train.lr={lr}", f"train.weight_decay={wd}", f"train.warmup_steps={warmup}",
                            f"train.betas=[{b1}, {b2}]", "train.steps=10"])
    model = HybridLM.from_recipe(recipe, vocab_size=12)
    optimizer, scheduler = make_optimizer(model, recipe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # gradients of changing sign and size, so that the moment averages differ from the last gradient
    grads_per_step = [{n: torch.randn(p.shape) * scale for n, p in model.named_parameters()}
                      for scale in (1.0, 0.1, 3.0)]
    for grads in grads_per_step:
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        optimizer.step()
        scheduler.step()
    # the embedding and every vector (gains, biases, recurrence parameters) are undecayed; matrices decay
    decayed = {n for n, p in model.named_parameters() if n != "embed.weight" and p.dim() >= 2}
    lrs = [lr * lr_at(s, recipe) for s in range(3)]
    assert lrs == pytest.approx([lr / 3, 2 * lr / 3, lr], rel=1e-12)  # the warm-up's values, by hand
    want = _hand_adamw(before, grads_per_step, lrs, (b1, b2), decayed, wd)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), want[n], rtol=1e-5, atol=1e-6, msg=n)
