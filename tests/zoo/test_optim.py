"""The optimizer decays exactly the parameters their modules declare decayed, and updates a CUDA model in the
fused kernels (zoo.training.optim)."""
import copy

import pytest
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.optim import make_optimizer, param_groups

from .test_train import TINY


def test_one_adamw_step_shrinks_only_the_decayed_parameters():
    """With zero gradients an AdamW step multiplies a decayed parameter by ``1 - lr * wd`` and leaves an
    undecayed one unchanged: the embedding, every RMSNorm gain, Jordan's (N, m) LayerNorm gain and
    bias, the recurrence parameters and the biases stay, the projections shrink."""
    lr, wd = 0.1, 0.5
    recipe = resolve(TINY, ["model.layers=[jordan, mamba2]", "model.mixer_options.jordan.state_norm=step",
                            f"train.lr={lr}", f"train.weight_decay={wd}", "train.warmup_steps=1"])
    model = HybridLM.from_recipe(recipe, vocab_size=12)
    optimizer, _ = make_optimizer(model, recipe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    shrunk = set()
    for name, p in model.named_parameters():
        if torch.equal(p, before[name]):
            continue
        torch.testing.assert_close(p, before[name] * (1 - lr * wd), rtol=1e-6, atol=0)
        shrunk.add(name)
    assert shrunk == {n for n, p in model.named_parameters() if n.endswith("weight") and p.ndim >= 2
                      and "embed" not in n and "norm_weight" not in n}
    for name in ("embed.weight", "blocks.0.mixer.norm_weight", "blocks.0.mixer.norm_bias", "norm.weight",
                 "blocks.0.mixer_norm.weight", "blocks.1.mixer.D", "blocks.1.mixer.gate.A_log",
                 "blocks.0.mixer.coupling", "blocks.1.mixer.conv.conv.bias"):
        assert name not in shrunk, name


def _step(optimizer, model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    optimizer.step()
    return optimizer


def test_a_cpu_model_keeps_the_default_update():
    recipe = resolve(TINY, ["model.layers=[jordan, mamba2]"])
    model = HybridLM.from_recipe(recipe, vocab_size=12)
    assert not make_optimizer(model, recipe)[0].defaults["fused"]


@pytest.mark.gpu
def test_a_cuda_model_is_updated_by_the_fused_kernels_to_the_same_values():
    """The fused update computes AdamW's step: from the same parameters and gradients it lands where the
    default (foreach) update lands, within fp32 rounding."""
    recipe = resolve(TINY, ["model.layers=[attention, mamba2]", "train.weight_decay=0.1"])
    fused_model = HybridLM.from_recipe(recipe, vocab_size=12).cuda()
    plain_model = copy.deepcopy(fused_model)
    grads = [torch.randn_like(p) for p in fused_model.parameters()]
    fused = make_optimizer(fused_model, recipe)[0]
    assert fused.defaults["fused"]
    lr = fused.param_groups[0]["lr"]   # the schedule's first value
    plain = torch.optim.AdamW(param_groups(plain_model, 0.1), lr=lr, betas=tuple(recipe.train.betas))
    assert not plain.defaults["fused"]
    for _ in range(3):
        _step(fused, fused_model, grads)
        _step(plain, plain_model, grads)
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
