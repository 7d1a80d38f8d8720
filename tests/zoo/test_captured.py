"""Captured training steps (train.cuda_graph, zoo.training.captured): on a CPU a run asked for a graph says why
it cannot and trains exactly as an eager run; torch.compile and a graph together are refused; on CUDA a step
replayed from a graph trains every mixer as the eager step does, batch after batch (new inputs and a new loss
denominator reach the graph), and ``zoo train`` reports that it replayed one."""
import copy
import warnings

import pytest
import torch

from tests.registry import builtin_mixer_names
from zoo.benchmark.train_rate import lm_passes
from zoo.errors import UserError
from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.captured import StepPasses
from zoo.training.loop import train

from .test_train import TINY


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def test_a_cpu_run_asked_for_a_graph_says_why_not_and_trains_as_the_eager_run():
    seed = _seed()
    eager = train(resolve(TINY, [f"seed={seed}", "train.grad_accum=2"]), progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asked = train(resolve(TINY, [f"seed={seed}", "train.grad_accum=2", "train.cuda_graph=true"]), progress=False)
    said = [str(w.message) for w in caught if "cuda_graph" in str(w.message)]
    assert said == ["train.cuda_graph=true: it needs a CUDA device and this run trains on cpu; training eagerly"]
    assert asked.metrics["cuda_graph"].startswith("eager: it needs a CUDA device")
    assert "cuda_graph" not in eager.metrics
    for a, b in zip(eager.model.parameters(), asked.model.parameters()):
        assert torch.equal(a, b)
    assert asked.metrics["train_loss"] == eager.metrics["train_loss"]


def test_compile_and_a_graph_together_are_refused():
    with pytest.raises((UserError, ValueError), match="train.compile and train.cuda_graph"):
        resolve(TINY, ["train.compile=true", "train.cuda_graph=true"])


def test_eager_passes_start_every_step_from_no_gradient():
    """Eagerly, each call's gradients are that call's alone (a fresh backward's), not a sum over calls."""
    model = torch.nn.Linear(5, 3)
    passes = StepPasses(lambda x: (model(x).square().sum().backward(),), list(model.parameters()),
                        torch.device("cpu"))
    for _ in range(3):
        x = torch.randn(4, 5)
        passes({"x": x})
        expected = torch.autograd.grad(model(x).square().sum(), model.weight)[0]
        torch.testing.assert_close(model.weight.grad, expected)
    assert passes.mode == "eager" and passes.error is None


def _tiny_lm(name: str, seed: int):
    layers = [name] if name == "attention" else [name, "attention"]
    recipe = resolve({"model": {"d_model": 32, "layers": layers}, "seed": seed})
    torch.manual_seed(seed)
    return HybridLM.from_recipe(recipe, 64).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("name", builtin_mixer_names())
def test_a_step_replayed_from_a_graph_trains_as_the_eager_step(name):
    seed = _seed()
    eager_model = _tiny_lm(name, seed)
    graph_model = copy.deepcopy(eager_model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager_model, graph_model)]
    eager = StepPasses(lm_passes(eager_model), list(eager_model.parameters()), torch.device("cuda"))
    graphed = StepPasses(lm_passes(graph_model), list(graph_model.parameters()), torch.device("cuda"), cuda_graph=True)
    for step in range(4):  # a new batch every step: the graph must read it, not replay the first
        ids = torch.randint(64, (2, 65), device="cuda")
        batch = {"inputs": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        (a,), (b,) = eager(batch), graphed(batch)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{name}: loss at step {step}")
        for optimizer in optimizers:
            optimizer.step()
    assert graphed.mode == "graph", graphed.error
    for p, q in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_zoo_train_replays_a_graph_and_trains_as_the_eager_run():
    """MQAR supervises a varying number of tokens per batch: the loss's denominator changes every step and must
    reach the graph as a tensor. Gradient accumulation runs two micro-batches inside the one graph."""
    seed = _seed()
    common = [f"seed={seed}", "train.device=cuda", "train.precision=fp32", "train.grad_accum=2"]
    eager = train(resolve(TINY, common), progress=False)
    graphed = train(resolve(TINY, common + ["train.cuda_graph=true"]), progress=False)
    assert graphed.metrics["cuda_graph"] == "graph"
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    assert graphed.metrics["train_loss"] == pytest.approx(eager.metrics["train_loss"], rel=1e-4)
