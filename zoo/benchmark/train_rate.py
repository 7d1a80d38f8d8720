"""Steady-state training tokens per second of a model: warm-up steps, then timed steps.

One optimizer step is the training step of ``zoo train`` without its bookkeeping: forward (under
autocast for bf16/fp16 on CUDA, as ``train.precision: auto`` runs it), next-token cross-entropy,
backward, AdamW step. The first ``warmup`` steps carry compilation, autotuning and first allocations
and are left out; the device is synchronised only where the timed window opens and closes, never at a
step, so the window times the device's steady throughput. A time budget can cut either phase short
(after a minimum number of steps); the steps actually taken are reported with the rate.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..training import throughput
from ..training.captured import StepPasses

#: fewest steps of each phase a time budget leaves
MIN_WARMUP_STEPS = 2
MIN_TIMED_STEPS = 3


@dataclass
class Rate:
    tokens_per_second: float
    warmup_steps: int
    warmup_seconds: float
    timed_steps: int
    timed_seconds: float

    def as_dict(self) -> dict:
        return dict(vars(self))


def lm_passes(model, autocast: torch.dtype | None = None):
    """The forward (under autocast for bf16/fp16), next-token cross-entropy and backward of a language model:
    ``passes(inputs, labels) -> (loss,)``, as :class:`~zoo.training.captured.StepPasses` runs or captures it."""
    def passes(inputs, labels):
        ctx = torch.autocast(inputs.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with ctx:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        return (loss.detach(),)
    return passes


class LMStep:
    """One training step of a language model on fixed ``inputs``/``labels`` ``(batch, T)``: its passes
    (:func:`lm_passes`), eager or captured as a CUDA graph (``cuda_graph``: :class:`StepPasses`, which falls back
    to eager and says why in ``passes.error``), then the optimizer's step."""

    def __init__(self, model, optimizer, inputs: torch.Tensor, labels: torch.Tensor,
                 autocast: torch.dtype | None = None, cuda_graph: bool = False):
        self.optimizer, self.batch = optimizer, {"inputs": inputs, "labels": labels}
        self.passes = StepPasses(lm_passes(model, autocast), list(model.parameters()), inputs.device, cuda_graph)

    def __call__(self) -> None:
        self.passes(self.batch)
        self.optimizer.step()


def lm_step(model, optimizer, inputs: torch.Tensor, labels: torch.Tensor, autocast: torch.dtype | None = None):
    """One eager training step of a language model on ``inputs``/``labels`` ``(batch, T)``."""
    optimizer.zero_grad(set_to_none=True)
    lm_passes(model, autocast)(inputs, labels)
    optimizer.step()


def steady_rate(step, tokens_per_step: int, device: torch.device, warmup: int, steps: int,
                seconds: float | None = None) -> Rate:
    """Run ``step()`` ``warmup`` times, then time up to ``steps`` more. With ``seconds``, each phase also
    stops once it has used half of ``seconds`` (warm-up) or the rest (timed), after its minimum steps
    (:data:`MIN_WARMUP_STEPS`, :data:`MIN_TIMED_STEPS`)."""
    clock = throughput.clock
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = clock()
    done = 0
    while done < warmup and not (seconds and done >= MIN_WARMUP_STEPS and clock() - start > seconds / 2):
        step()
        done += 1
    sync()
    opened = clock()
    timed = 0
    while timed < steps and not (seconds and timed >= MIN_TIMED_STEPS and clock() - start > seconds):
        step()
        timed += 1
    sync()
    closed = clock()
    return Rate(timed * tokens_per_step / max(closed - opened, 1e-9), done, opened - start, timed, closed - opened)
