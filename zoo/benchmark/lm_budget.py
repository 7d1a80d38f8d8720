"""What the language-model speed targets leave a mixer, from one GPU speed run's profiled steps.

Every model of a run's language-model stage shares everything but its mixers: embedding, the SwiGLU blocks,
norms, the loss and the optimizer; attention's layers add their own attention kernels (SDPA's, the rotary
embedding's) to that. So, from the device times of one profiled step each (``step_device_ms``, ``step_kernels``
in ``lm.json``), at each length ``T``:

- ``shared`` = attention's step less its own attention kernels (found by name among its longest kernels);
- ``ceiling`` = attention's step over ``shared``: the ratio to attention's tokens/s that a model whose mixers
  cost nothing beyond attention's projections would reach, the most any mixer can reach at that length;
- a model's ``mixer ms`` = its step less ``shared``: what its mixers (projections included) cost a step;
- its ``budget ms`` = attention's step over the target ratio, less ``shared``: what its mixers may cost for the
  model to meet the target; ``cut`` = the share of ``mixer ms`` above the budget.

A model meets its target exactly when its step is at most attention's over the target (``mixer ms <= budget
ms``), whatever ``shared`` is; ``shared`` only splits the step into the part no mixer change can remove and the
part it can. The targets themselves compare steady-state rates (:mod:`zoo.benchmark.gpu_targets`); a captured
step's time is its device time, so the two agree to within the gaps between steps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: kernel names of attention's own work in its model: PyTorch's SDPA backends (cuDNN, flash, memory-efficient,
#: math; on the CPU the operators' names) and the rotary embedding (``kernels.rope``'s ``_rotate``)
ATTENTION_KERNELS = re.compile(r"sdpa|flash|fmha|attention|efficient_attn|_rotate|rotary", re.IGNORECASE)


@dataclass(frozen=True)
class MixerBudget:
    mixer: str
    step_ms: float
    mixer_ms: float
    budget_ms: float

    @property
    def fits(self) -> bool:
        return self.mixer_ms <= self.budget_ms

    @property
    def cut(self) -> float:
        """The share of the mixers' time a step must lose to meet the target (0 where it fits)."""
        if self.fits:
            return 0.0
        return (self.mixer_ms - max(self.budget_ms, 0.0)) / self.mixer_ms


@dataclass(frozen=True)
class LengthBudget:
    T: int
    target: float
    attention_ms: float
    attention_own_ms: float
    mixers: tuple

    @property
    def shared_ms(self) -> float:
        return self.attention_ms - self.attention_own_ms

    @property
    def ceiling(self) -> float:
        return self.attention_ms / self.shared_ms


def attention_own_ms(kernels: list[dict]) -> float:
    """The summed time of the attention kernels among a step's kernels (``{"name", "ms"}`` rows)."""
    return sum(k["ms"] for k in kernels if ATTENTION_KERNELS.search(k["name"]))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def length_budget(rows: list[dict], T: int, target: float, baseline: str, linear: list[str]) -> LengthBudget | str:
    """The budgets at length ``T`` from ``lm.json``'s rows, or why there are none."""
    base = next((r for r in rows if r.get("mixer") == baseline and r.get("T") == T), None)
    if base is None or not _number(base.get("step_device_ms")) or not base.get("step_kernels"):
        return f"no profiled step of the {baseline} model at T {T}"
    own = attention_own_ms(base["step_kernels"])
    if own <= 0 or own >= base["step_device_ms"]:
        return f"no attention kernel named among the {baseline} model's longest at T {T}"
    shared = base["step_device_ms"] - own
    budget = base["step_device_ms"] / target - shared
    mixers = tuple(MixerBudget(r["mixer"], r["step_device_ms"], r["step_device_ms"] - shared, budget)
                   for name in linear for r in rows
                   if r.get("mixer") == name and r.get("T") == T and _number(r.get("step_device_ms")))
    return LengthBudget(T, target, base["step_device_ms"], own, mixers)
