"""Steady-state training throughput: the rate after the warm-up, the warm-up's time beside it.

The first steps of a training process pay one-off costs that say nothing about the model's speed:
Triton compilation and autotuning, ``torch.compile``, the CUDA context and library handles, the
optimizer's state allocation. A rate taken over the whole run mixes them in (a Gated DeltaNet language
model measured at 291k tokens/s in steady state reported 38.7k over a 40-step run). So a run keeps two
clocks:

- **warm-up**: the first :func:`warmup_steps` optimizer steps of each training process (a resumed run
  compiles again, so each process warms up anew), compile included; ``warmup_seconds`` is their time,
  summed over the processes of the run;
- **steady**: every later step; ``steady_tokens_per_second`` is their tokens over their time.

Periodic evaluation and checkpoint writing stop both clocks (:meth:`Throughput.paused`). On CUDA the
clock reads wait for the device (``torch.cuda.synchronize``) only where a window opens or closes — the
warm-up's end, around a pause, the run's end — never at an ordinary step, so the measurement adds no
synchronisation to the steady steps it times.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

#: the warm-up is this fraction of the run's steps, and at least MIN_WARMUP_STEPS
WARMUP_FRACTION = 0.1
MIN_WARMUP_STEPS = 2
#: the clock both phases read (seconds); tests replace it with one they advance by hand
clock = time.perf_counter
#: the metrics :meth:`Throughput.metrics` adds to a run's metrics (they measure the machine, not the model)
METRICS = ("steady_tokens_per_second", "steady_steps", "warmup_seconds")


def warmup_steps(total_steps: int) -> int:
    """How many of a process's first steps are warm-up: ``max(2, ceil(10 % of the run's steps))``."""
    return max(MIN_WARMUP_STEPS, math.ceil(WARMUP_FRACTION * total_steps))


@dataclass
class Throughput:
    """The two clocks of a run. Saved with a checkpoint: ``warmup_seconds``, ``steady_seconds``,
    ``steady_steps`` (over every process so far); the rest belongs to the current process."""

    warmup_seconds: float = 0.0
    steady_seconds: float = 0.0
    steady_steps: int = 0
    warmup: int = MIN_WARMUP_STEPS           # warm-up steps of this process
    done_here: int = 0                       # steps this process has finished
    device: torch.device | None = None
    since: float | None = field(default=None, repr=False)  # when the running lap began; None: stopped

    def start(self, device: torch.device, warmup: int) -> None:
        """This process starts training on ``device``; its first ``warmup`` steps are warm-up."""
        self.device, self.warmup, self.done_here = device, warmup, 0
        self.since = self._now()

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return clock()

    def _lap(self) -> None:
        """Add the running lap to the phase it belongs to (steady once the warm-up's last step is done)."""
        now = self._now()
        if self.done_here < self.warmup:
            self.warmup_seconds += now - self.since
        else:
            self.steady_seconds += now - self.since
        self.since = now

    def step(self) -> None:
        """One optimizer step finished (a clock read only at the last warm-up step)."""
        if self.since is None:
            return
        self.done_here += 1
        if self.done_here > self.warmup:
            self.steady_steps += 1
        elif self.done_here == self.warmup:  # the warm-up ends: close its lap, open the steady one
            now = self._now()
            self.warmup_seconds += now - self.since
            self.since = now

    def stop(self) -> None:
        """Stop the clocks (the lap so far is kept); :meth:`start` or :meth:`resume` runs them again."""
        if self.since is not None:
            self._lap()
            self.since = None

    def resume(self) -> None:
        if self.since is None and self.device is not None:
            self.since = self._now()

    @contextlib.contextmanager
    def paused(self):
        """Neither clock runs inside (evaluation, checkpoints)."""
        running = self.since is not None
        self.stop()
        try:
            yield
        finally:
            if running:
                self.resume()

    def metrics(self, tokens_per_step: int = 0) -> dict:
        """``warmup_seconds``, ``steady_steps`` and, when there were steady steps and tokens to count,
        ``steady_tokens_per_second``."""
        out = {"warmup_seconds": self.warmup_seconds, "steady_steps": self.steady_steps}
        if tokens_per_step and self.steady_steps and self.steady_seconds > 0:
            out["steady_tokens_per_second"] = self.steady_steps * tokens_per_step / self.steady_seconds
        return out

    def state_dict(self) -> dict:
        """The totals so far (a running lap is closed first and a new one opened, so nothing is lost)."""
        if self.since is not None:
            self._lap()
        return {"warmup_seconds": self.warmup_seconds, "steady_seconds": self.steady_seconds,
                "steady_steps": self.steady_steps}

    def load_state_dict(self, state: dict | None) -> None:
        """``None`` (a checkpoint written before these clocks existed): nothing measured yet."""
        state = state or {}
        self.warmup_seconds = state.get("warmup_seconds", 0.0)
        self.steady_seconds = state.get("steady_seconds", 0.0)
        self.steady_steps = state.get("steady_steps", 0)


def describe(metrics: dict, steps: int) -> str:
    """One line that says which rate is which, from a run's metrics (``steps`` optimizer steps)."""
    warm = steps - metrics.get("steady_steps", 0)
    parts = []
    if metrics.get("steady_tokens_per_second"):
        parts.append(f"steady {metrics['steady_tokens_per_second']:,.0f} tokens/s (over "
                     f"{metrics['steady_steps']} steady steps, evaluation and checkpoints excluded)")
    else:
        parts.append(f"no steady rate (all {steps} steps were warm-up)")
    parts.append(f"warm-up {metrics.get('warmup_seconds', 0.0):.1f} s ({warm} steps, compile included)")
    if metrics.get("train_tokens_per_second"):
        parts.append(f"overall {metrics['train_tokens_per_second']:,.0f} tokens/s (all steps over train_seconds, "
                     f"warm-up and periodic evaluation included)")
    return "throughput: " + "; ".join(parts)
