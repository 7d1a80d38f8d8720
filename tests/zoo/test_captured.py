"""Captured training steps (train.cuda_graph, zoo.training.captured): every model's passes on the GPU path hold
nothing a CUDA graph cannot capture (no wait for the device, no copy from host memory; checked on meta tensors);
on a CPU a run asked for a graph says why it cannot and trains exactly as an eager run; torch.compile and a
graph together are refused; on CUDA a step replayed from a graph trains every mixer as the eager step does,
batch after batch (new inputs and a new loss denominator reach the graph), and ``zoo train`` reports that it
replayed one."""
import contextlib
import copy
import types
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernels.backend import meta_takes_triton
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting
from tests.registry import builtin_mixer_names
from zoo.benchmark.train_rate import lm_passes
from zoo.errors import UserError
from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training import distributed, evaluation, loop
from zoo.training.captured import StepPasses, agreement
from zoo.training.loop import train

from .test_train import TINY


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


class UncapturableOps(TorchDispatchMode):
    """Records the operations a CUDA graph's capture refuses, with ``meta`` tensors standing for the device's: a
    read of a device value on the host (a sync), a copy from host memory to the device (pageable: synchronous)
    and a copy from the device to the host."""

    SYNCS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal")

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types=(), args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCS:  # a meta tensor has no value to give: the pass stops here
            self.found.append(f"sync {name}")
            raise Uncapturable(name)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        try:
            out = func(*args, **(kwargs or {}))
        except NotImplementedError as err:  # a meta tensor has no data to copy to the host
            if "out of meta" not in str(err):
                raise
            self.found.append(f"device to host {name}")
            raise Uncapturable(name) from None
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        on_host = [t for t in ins if t.device.type == "cpu"]  # 0-dim ones are wrapped numbers, read as arguments
        if on_host and any(o.is_meta for o in outs) and (name.startswith(("_to_copy", "copy", "lift"))
                                                          or any(t.dim() > 0 for t in on_host)):
            self.found.append(f"host to device {name}")
        return out


class NewDeviceTensors(TorchFunctionMode):
    """Records ``torch.tensor`` / ``as_tensor`` / ``new_tensor`` of host data on the device, which copy from host
    memory below the operations a dispatch mode sees."""

    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor", "new_tensor"):
            device = kwargs.get("device")
            on = torch.device(device) if device is not None else args[0].device if name == "new_tensor" else None
            if on is not None and on.type != "cpu":
                self.found.append(f"host to device {name}")
        return func(*args, **kwargs)


class Uncapturable(Exception):
    pass


def _on_the_gpu_path(fn, launches: list | None = None) -> list[str]:
    """What ``fn`` does that a capture refuses, on the GPU path with meta tensors (Triton launches counted into
    ``launches``, not run)."""
    spy = UncapturableOps()
    with contextlib.suppress(Uncapturable), gpu_path_on_cpu(), meta_takes_triton(), \
            counting(execute=False) as counter, spy, NewDeviceTensors(spy.found):
        fn()
    if launches is not None:
        launches.append(sum(counter.values()))
    return spy.found


def test_the_spy_finds_what_a_capture_refuses():
    x = torch.randn(3, device="meta")
    assert _on_the_gpu_path(lambda: x.sum().item()) == ["sync _local_scalar_dense"]
    assert _on_the_gpu_path(lambda: x + torch.tensor([1.0, 2.0, 3.0]).to("meta")) == ["host to device _to_copy"]
    assert _on_the_gpu_path(lambda: torch.tensor(2.0, device="meta") * x) == ["host to device tensor"]
    assert _on_the_gpu_path(lambda: x.new_tensor([2.0]) * x) == ["host to device new_tensor"]
    assert _on_the_gpu_path(lambda: x.cpu()) == ["device to host _to_copy"]
    assert _on_the_gpu_path(lambda: x * 2.0 + x.sum()) == []


@pytest.mark.parametrize("name", builtin_mixer_names())
def test_every_models_passes_can_be_captured_on_the_gpu_path(name, monkeypatch):
    """The passes :class:`StepPasses` captures, the benchmark's and ``zoo train``'s (its micro-batches, the loss's
    factor as a device tensor, the summed loss and hits), run on the GPU path without a sync or a host copy: a
    capture of them cannot fail on those grounds (autocast left out: it has no meta device)."""
    layers = [name] if name == "attention" else [name, "attention"]
    recipe = resolve({"model": {"d_model": 32, "layers": layers}, "train": {"grad_accum": 2, "batch_size": 4}})
    model = HybridLM.from_recipe(recipe, 64).to("meta")
    ids = torch.randint(64, (4, 33)).to("meta")
    launches = []
    assert _on_the_gpu_path(lambda: lm_passes(model)(ids[:, :-1], ids[:, 1:]), launches) == []
    assert all(p.grad is not None for p in model.parameters())
    assert launches[0] >= 2  # the Triton kernels' launchers ran (attention's rotary embedding at least)
    monkeypatch.setattr(evaluation, "autocast", lambda device, precision: contextlib.nullcontext())
    run = types.SimpleNamespace(recipe=recipe, device=torch.device("meta"), precision="fp32",
                                ctx=distributed.context())
    state = types.SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=False))
    passes = loop._training_passes(run, state, model)
    scale = torch.full((), 0.25, device="meta")
    assert _on_the_gpu_path(lambda: passes(ids[:, :-1], ids[:, 1:], None, scale)) == []


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


def test_agreement_measures_the_gap_between_two_steps():
    model = torch.nn.Linear(6, 2)
    params = list(model.parameters())
    x = torch.randn(5, 6)
    cpu = torch.device("cpu")

    def passes(factor):
        def run(x):
            loss = model(x).square().mean() * factor
            loss.backward()
            return (loss.detach(),)
        return run
    same = agreement(StepPasses(passes(1.0), params, cpu), StepPasses(passes(1.0), params, cpu), {"x": x})
    assert same == {"outputs": 0.0, "grads": 0.0}
    off = agreement(StepPasses(passes(1.0), params, cpu), StepPasses(passes(1.25), params, cpu), {"x": x})
    # fp32: the loss and gradients scaled by 1.25 and their norms round to ~1e-6 of the gap
    assert off["outputs"] == pytest.approx(0.25, rel=1e-5) and off["grads"] == pytest.approx(0.25, rel=1e-5)


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
