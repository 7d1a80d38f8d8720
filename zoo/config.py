"""Typed recipe configuration (one dataclass per section), validated strictly.

A recipe has the sections ``model``, ``task``, ``train``, ``eval`` plus ``seed``, ``name``,
``description`` and, for ablations, ``grid``. Per-mixer options (``model.mixer_options.<mixer>``) and
task options (``task.*`` besides ``name``) are validated against the option dataclasses of the
registered mixer / task, so a typo anywhere is caught before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixers.options import opt


@dataclass
class ModelConfig:
    d_model: int = opt(64, "residual stream width")
    layers: list[str] | None = opt(None, "the sequence mixer of every layer, e.g. [mamba2, attention]")
    pattern: list[str] | None = opt(None, "a short list of mixers repeated to n_layers (used when layers is not set)")
    n_layers: int | None = opt(None, "number of layers when expanding pattern")
    state_mixer: str = opt("swiglu", "state mixer after every sequence mixer (swiglu, koopman_mlp, none)")
    mixer_options: dict[str, dict[str, Any]] = opt(None, "options per mixer name, e.g. {attention: {n_heads: 2}}",
                                                   default_factory=dict)
    state_mixer_options: dict[str, Any] = opt(None, "options of the state mixer", default_factory=dict)
    use_mask: bool = opt(True, "pass the task's prefix mask (if any) to mixers that use one")
    norm_eps: float = opt(1e-5, "epsilon of the pre-norms")

    def resolved_layers(self) -> list[str]:
        if self.layers is not None:
            return list(self.layers)
        if self.pattern is None or self.n_layers is None:
            raise ValueError("set model.layers, or model.pattern together with model.n_layers")
        return [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]

    def __post_init__(self):
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("model.layers is empty; name at least one mixer")
        if self.layers is None and (self.pattern is None or self.n_layers is None):
            raise ValueError("set model.layers, or model.pattern together with model.n_layers")
        if self.pattern is not None and len(self.pattern) == 0:
            raise ValueError("model.pattern is empty")


@dataclass
class TrainConfig:
    steps: int = opt(1000, "optimizer steps")
    batch_size: int = opt(64, "examples per step")
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms, biases and gains)")
    betas: list[float] = opt(None, "AdamW betas", default_factory=lambda: [0.9, 0.98])
    warmup_steps: int = opt(50, "linear warm-up steps before the cosine decay")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr")
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 disables)")
    eval_every: int = opt(0, "evaluate on the test set every N steps (0: only at the end)")
    device: str = opt("auto", "auto (cuda if available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "torch CPU threads (0 keeps torch's default)")
    early_stop_acc: float = opt(0.0, "stop once a periodic evaluation reaches this accuracy (0 disables)")


@dataclass
class EvalConfig:
    batch_size: int = opt(128, "examples per evaluation batch")
    seq_lens: list[int] = opt(None, "extra test lengths for length generalisation, e.g. [128, 256]",
                              default_factory=list)
    num_iter: int | None = opt(None, "solver iterations at evaluation for mixers with an eval_num_iter knob "
                                     "(None: the mixer's own setting)")
    num_iter_sweep: list[int] = opt(None, "test-time-compute table: also evaluate the trained model at each of "
                                          "these solver iteration counts, e.g. [0, 5, 10, 30]", default_factory=list)


@dataclass
class RecipeConfig:
    model: ModelConfig = opt(None, "the hybrid model", default_factory=ModelConfig)
    task: dict[str, Any] = opt(None, "the task: name plus its options", default_factory=lambda: {"name": "mqar"})
    train: TrainConfig = opt(None, "optimisation", default_factory=TrainConfig)
    eval: EvalConfig = opt(None, "evaluation", default_factory=EvalConfig)
    seed: int = opt(0, "seed for the model, the data and the batch order")
    name: str = opt("", "a short name for tables")
    description: str = opt("", "what the recipe is for")
    grid: Any = opt(None, "ablation grid: a mapping key.path -> list of values (product), or a list of "
                          "override mappings (explicit cells, optional 'label')")
