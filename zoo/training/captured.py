"""A training step's forward and backward passes captured once as a CUDA graph and replayed
(``train.cuda_graph``): the host issues one graph launch a step instead of every kernel of it.

A small model's training step on a GPU waits on its host: Python, autograd and the kernel launchers take
longer to issue the step's few hundred kernels than the card takes to run them, and a layer that dispatches
more operations than attention (a state mixer's gates, convolution, norms and its chunked kernels) loses
tokens/s by that alone. A CUDA graph records the kernels of one step once and replays them with one launch.

What is captured: the forward, the loss and the backward of every micro-batch (the ``passes`` callable).
What stays eager: gradient clipping, the optimizer step and the learning-rate schedule (fused AdamW is one
or two launches, and its learning rate changes every step).

A graph replays the same kernels on the same memory, hence the rules :class:`CapturedPasses` keeps:

- the batch is copied into the graph's static inputs before each replay; a batch of another shape runs
  eagerly (:meth:`CapturedPasses.fits`);
- a number that changes between steps (the loss's denominator) reaches the passes as a device tensor that is
  refilled before each replay, never as a Python number, which the capture would freeze;
- the gradients are the graph's own tensors: the first micro-batch's backward writes them and later ones add
  to them, so a step does not zero them, and each replay puts them back on the parameters in case anything
  (an eager step, ``zero_grad``) replaced them;
- the passes must not wait for the device (``.item()``, a copy to the host): the capture fails if they do,
  and :class:`StepPasses` then warns once and trains eagerly.

Before capturing, the passes run :data:`WARMUP_PASSES` times on a side stream (first-call compilation, cuBLAS
workspaces and lazy initialisations happen there, not inside the capture), as PyTorch's CUDA-graph notes
prescribe; those passes only fill gradients, which are dropped, and update no parameter.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

#: passes run on a side stream before the capture
WARMUP_PASSES = 2


def _drop_grads(params) -> None:
    for p in params:
        p.grad = None


def _signature(value):
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("number" if isinstance(value, (int, float)) else "none", None, None)


class CapturedPasses:
    """``passes(**inputs)`` (a forward and backward that leaves its gradients on ``params`` and returns a tuple
    of tensors) captured as one CUDA graph; calling the object with new inputs of the same shapes replays it
    and returns the same output tensors, refilled.

    ``inputs`` maps names to tensors (copied into static device tensors before each replay), Python numbers
    (0-dim float32 device tensors refilled before each replay: the passes see tensors) or None (passed as
    None, fixed)."""

    def __init__(self, passes: Callable, inputs: dict, params: list[torch.nn.Parameter], device: torch.device,
                 warmup: int = WARMUP_PASSES):
        self.params, self.signature = list(params), {k: _signature(v) for k, v in inputs.items()}
        self.static = {k: (v.to(device, copy=True) if torch.is_tensor(v)
                           else torch.full((), float(v), dtype=torch.float32, device=device)
                           if isinstance(v, (int, float)) else None)
                       for k, v in inputs.items()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                _drop_grads(self.params)
                passes(**self.static)
        torch.cuda.current_stream(device).wait_stream(side)
        _drop_grads(self.params)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = passes(**self.static)
        self.grads = [p.grad for p in self.params]

    def fits(self, inputs: dict) -> bool:
        """Whether ``inputs`` have the names, shapes and dtypes the graph was captured with."""
        return {k: _signature(v) for k, v in inputs.items()} == self.signature

    def __call__(self, inputs: dict) -> tuple:
        for name, value in inputs.items():
            static = self.static[name]
            if torch.is_tensor(value):
                static.copy_(value, non_blocking=True)
            elif static is not None:
                static.fill_(float(value))
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                p.grad = g
        self.graph.replay()
        return self.outputs


class StepPasses:
    """The forward and backward passes of each training step, eager or captured (``cuda_graph``).

    Eager: the gradients are dropped (``optimizer.zero_grad(set_to_none=True)``) and ``passes`` runs. Captured
    (CUDA only, one process): the first call captures ``passes`` (:class:`CapturedPasses`) and every call replays
    it; a capture that fails, or a device that cannot capture, is said once in a warning and the run trains
    eagerly; a batch of other shapes than the captured one runs eagerly that step."""

    def __init__(self, passes: Callable, params: list[torch.nn.Parameter], device: torch.device,
                 cuda_graph: bool = False, why_not: str | None = None):
        self.passes, self.params, self.device = passes, list(params), device
        self.captured: CapturedPasses | None = None
        self.replayed = False  # whether a capture was made (and replayed)
        self.error: str | None = None  # why the step runs eagerly although a graph was asked for
        self.wanted = cuda_graph
        if cuda_graph and device.type != "cuda":
            why_not = why_not or f"it needs a CUDA device and this run trains on {device}"
        if cuda_graph and why_not:
            self._give_up(why_not)

    def _give_up(self, why: str) -> None:
        self.wanted, self.error = False, why
        warnings.warn(f"train.cuda_graph=true: {why}; training eagerly", stacklevel=3)

    def __call__(self, inputs: dict) -> tuple:
        if self.wanted and self.captured is None:
            try:
                self.captured = CapturedPasses(self.passes, inputs, self.params, self.device)
            except Exception as err:  # noqa: BLE001 - any capture failure means: train eagerly
                first = str(err).splitlines()[0] if str(err) else ""
                self._give_up(f"capturing the step failed ({type(err).__name__}: {first})")
        if self.captured is not None and self.captured.fits(inputs):
            self.replayed = True
            return self.captured(inputs)
        _drop_grads(self.params)
        return self.passes(**inputs)

    def close(self) -> None:
        """Drop the graph and the gradients it wrote (its memory pool is freed once nothing else holds them); a
        later call runs eagerly."""
        self.wanted = False
        if self.captured is not None:
            _drop_grads(self.params)
            self.captured = None

    @property
    def mode(self) -> str:
        """``graph`` once a capture was made (also after :meth:`close`), else ``eager``."""
        return "graph" if self.replayed else "eager"


def agreement(eager: StepPasses, captured: StepPasses, inputs: dict) -> dict:
    """How far a captured step's results are from an eager step's on the same parameters and ``inputs`` (both
    ``StepPasses`` over the same parameters, neither followed by an optimizer step): ``{"outputs": r, "grads": r}``,
    each the largest difference over the outputs (gradients) relative to the largest magnitude of the eager
    one; 0 where they agree to the bit."""
    captured_outputs = [o.detach().clone() for o in captured(inputs)]
    captured_grads = [None if p.grad is None else p.grad.detach().clone() for p in captured.params]
    eager_outputs = eager(inputs)

    def gap(pairs) -> float:
        worst = 0.0
        for mine, truth in pairs:
            if mine is None or truth is None:
                if mine is not truth:
                    return float("inf")
                continue
            scale = truth.detach().float().abs().max().clamp_min(1e-30)
            worst = max(worst, float((mine.float() - truth.detach().float()).abs().max() / scale))
        return worst
    return {"outputs": gap(zip(captured_outputs, eager_outputs)),
            "grads": gap(zip(captured_grads, [p.grad for p in eager.params]))}
