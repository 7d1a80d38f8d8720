"""Typed recipe configuration: one dataclass per section, and the resolved specs the builder consumes.

A recipe has the sections ``model``, ``task``, ``train``, ``eval`` plus ``seed``, ``name``,
``description``, ``imports`` and, for ablations, ``grid`` and ``seeds`` (every grid cell once per seed).
Every numeric field carries its valid range,
checked at validation time. :func:`zoo.recipes.resolve` turns a recipe into a :class:`Recipe` exactly
once: the typed sections plus a :class:`Spec` (mixer name + validated options) for every layer, the
state mixer's and the task's validated options, the plain resolved dict and its stable hash.

Layers are written as a list of mixer names or one-key mappings with per-layer options, e.g.
``layers: [a, {b: {option: 16}}, a, {b: {option: 64}}]``; per-layer options override
``mixer_options.<name>`` (the defaults for every layer of that type). Or ``pattern`` with ``n_layers``: the
pattern repeated (and cut at the end) to ``n_layers`` layers, never shorter than the pattern itself; a model
gives its layers one of these two ways, never both.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from mixers.options import opt

from .threads import MAX_THREADS


@dataclass
class ModelConfig:
    d_model: int = opt(64, "residual stream width", at_least=1, at_most=65536)
    layers: list[Any] | None = opt(None, "the sequence mixer of every layer: names or {name: {options}}, "
                                         "e.g. [name, {name: {option: value}}]")
    pattern: list[Any] | None = opt(None, "a short list of layers (same syntax as layers) repeated to n_layers "
                                          "(instead of layers: a recipe gives one or the other)")
    n_layers: int | None = opt(None, "number of layers when expanding pattern (at least its length)", at_least=1,
                               at_most=1024)
    state_mixer: str = opt("swiglu", "state mixer after every sequence mixer (see `zoo list`)")
    mixer_options: dict[str, dict[str, Any]] = opt(None, "default options per mixer type: "
                                                         "{<mixer>: {<option>: value}}", default_factory=dict)
    state_mixer_options: dict[str, Any] = opt(None, "options of the state mixer", default_factory=dict)
    use_mask: bool = opt(True, "pass the task's prefix mask (if any) to mixers that use one")
    norm_eps: float = opt(1e-5, "epsilon of the pre-norms", above=0.0, at_most=1.0)

    def layer_entries(self) -> list[Any]:
        """The written layer entries, ``pattern`` expanded to ``n_layers``."""
        if self.layers is not None:
            return list(self.layers)
        return [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]

    def named_layer_entries(self) -> list[tuple[str, dict]]:
        """``(mixer name, the options written on the layer itself)`` of every layer entry (``{}`` for a bare name)."""
        return [(entry, {}) if isinstance(entry, str) else (next(iter(entry)), next(iter(entry.values())) or {})
                for entry in self.layer_entries()]

    def layer_option_keys(self) -> list[tuple[str, str]]:
        """For every layer, the recipe key that holds the options it is built with and, when other keys add to them,
        a note naming those: the layer's own options (``model.layers.<i>.<name>``, or ``model.pattern.<j>.<name>``)
        over its type's defaults (``model.mixer_options.<name>``); a layer with neither is named by its place."""
        written = "model.layers" if self.layers is not None else "model.pattern"
        keys = []
        for i, (name, own) in enumerate(self.named_layer_entries()):
            at = f"{written}.{i if self.layers is not None else i % len(self.pattern)}"
            defaults = f"model.mixer_options.{name}" if (self.mixer_options or {}).get(name) else ""
            if own:
                keys.append((f"{at}.{name}", f" (over the defaults of {defaults})" if defaults else ""))
            elif defaults:
                keys.append((defaults, f" ({at})"))
            else:
                keys.append((at, ""))
        return keys

    def __post_init__(self):
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("model.layers is empty; name at least one mixer")
        if self.layers is None and (self.pattern is None or self.n_layers is None):
            if self.pattern is not None:
                raise ValueError("model.pattern is set without model.n_layers, the number of layers it is repeated "
                                 "to; set model.n_layers (or give model.layers instead)")
            if self.n_layers is not None:
                raise ValueError("model.n_layers is set without model.pattern, the layers it repeats; set "
                                 "model.pattern (or give model.layers instead)")
            raise ValueError("set model.layers, or model.pattern together with model.n_layers")
        if self.pattern is not None and len(self.pattern) == 0:
            raise ValueError("model.pattern is empty")
        if self.layers is not None and (self.pattern is not None or self.n_layers is not None):
            raise ValueError("model.layers is set together with model.pattern or model.n_layers; give the layers "
                             "one way: model.layers, or model.pattern with model.n_layers")
        if self.layers is None and len(self.pattern) > self.n_layers:
            raise ValueError(f"model.pattern has {len(self.pattern)} layers but model.n_layers is {self.n_layers}, "
                             f"so the pattern would be cut short; raise model.n_layers to {len(self.pattern)} or more "
                             f"(a multiple of the pattern's length repeats it), or shorten model.pattern")


@dataclass
class TrainConfig:
    steps: int = opt(1000, "optimizer steps", at_least=1)
    batch_size: int = opt(64, "examples per step (the global batch under torchrun)", at_least=1, at_most=1 << 20)
    lr: float = opt(1e-3, "peak learning rate (AdamW)", above=0.0, at_most=10.0)
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms, biases and gains)", at_least=0.0)
    betas: list[float] = opt(None, "AdamW betas", default_factory=lambda: [0.9, 0.98], at_least=0.0, at_most=0.99999)
    warmup_steps: int = opt(50, "linear warm-up steps before the cosine decay", at_least=0)
    min_lr_ratio: float = opt(0.1, "the floor of the cosine decay as a fraction of lr (reached at step `steps`, "
                                   "one past the last update)", at_least=0.0, at_most=1.0)
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 disables)", at_least=0.0)
    eval_every: int = opt(0, "evaluate on the test set every N steps (0: only at the end)", at_least=0)
    device: str = opt("auto", "auto (cuda if available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "torch CPU threads (0 keeps torch's default)", at_least=0, at_most=MAX_THREADS)
    early_stop_acc: float = opt(0.0, "stop once a periodic evaluation reaches this accuracy (0 disables)",
                                at_least=0.0, at_most=1.0)
    checkpoint_every: int = opt(500, "with a checkpoint folder (zoo train --out, every zoo ablate cell), also "
                                     "save every N steps, so a killed run resumes there (0: only at the end)",
                                at_least=0)
    # precision and compile came after the first recorded results: left out of the resolved recipe
    # (and so of its hash) while at their defaults
    precision: str = opt("auto", "autocast precision: auto (fp32 on CPU, bf16 on CUDA), fp32, bf16 or fp16 "
                                 "(fp16 uses a gradient scaler)", choices=("auto", "fp32", "bf16", "fp16"),
                         omit_at_default=True)
    compile: bool = opt(False, "torch.compile the model for training (falls back to eager with a warning "
                               "where compilation fails)", omit_at_default=True)
    cuda_graph: bool = opt(False, "on CUDA, capture each step's forward and backward passes once as a CUDA graph "
                                  "and replay it (the host issues one launch a step instead of every kernel; "
                                  "falls back to eager with a warning on a CPU, under torchrun or where capture "
                                  "fails)", omit_at_default=True)
    tokens: int = opt(0, "train on this many tokens instead of train.steps: steps = ceil(tokens / (batch_size * "
                         "task seq_len)) (0: use steps)", at_least=0, omit_at_default=True)
    grad_accum: int = opt(1, "split each step's batch into this many micro-batches whose gradients add up (the "
                             "same step in less memory)", at_least=1, at_most=1 << 16, omit_at_default=True)
    tracking: str = opt("none", "also log the training curve to tensorboard or wandb (pip install "
                                "'mixer-zoo[tracking]'); results.jsonl stays the record",
                        choices=("none", "tensorboard", "wandb"))
    tracking_dir: str = opt("", "folder for tracking logs (default: <checkpoint folder>/tracking, else "
                                "runs/<recipe name or key>)")

    def __post_init__(self):
        if self.early_stop_acc > 0 and self.eval_every == 0:
            raise ValueError(f"train.early_stop_acc={self.early_stop_acc:g} stops at a periodic evaluation, and "
                             f"train.eval_every=0 runs none; set train.eval_every (e.g. 100) or set train.early_stop_acc=0")
        if self.compile and self.cuda_graph:
            raise ValueError("train.compile and train.cuda_graph are both true: torch.compile and the captured step "
                             "each take the whole training forward; choose one")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"train.batch_size ({self.batch_size}) is not a multiple of train.grad_accum "
                             f"({self.grad_accum}); make it one")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas needs two values (beta1, beta2), got {self.betas}")
        if self.warmup_steps > self.steps and not self.tokens:  # with tokens, checked once steps are known
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) exceeds train.steps ({self.steps}): the "
                             f"learning rate would never reach its peak; lower warmup_steps or raise steps")


@dataclass
class EvalConfig:
    batch_size: int = opt(128, "examples per evaluation batch", at_least=1, at_most=1 << 20)
    seq_lens: list[int] = opt(None, "extra test lengths for length generalisation, e.g. [128, 256]",
                              default_factory=list, at_least=1, at_most=1 << 22)
    test_time: dict[str, Any] = opt(None, "test-time knob values used at evaluation, e.g. {<knob>: value}; applied "
                                          "to every mixer that declares the knob (see `zoo list --options`)",
                                    default_factory=dict)
    test_time_sweep: dict[str, list] = opt(None, "also evaluate the trained model at each value of a test-time "
                                                 "knob, e.g. {<knob>: [0, 5, 10]} (columns "
                                                 "test_accuracy@<knob>=value)", default_factory=dict)
    tasks: list[dict[str, Any]] = opt(None, "also evaluate the trained model zero-shot on other tasks: entries "
                                            "{label: <short name>, name: <task>, <option>: value}; options left out "
                                            "come from the training task where it has them (columns "
                                            "test_accuracy@task=<label>, @task=<label>@<L>)", default_factory=list,
                                     omit_at_default=True)


@dataclass
class RecipeConfig:
    model: ModelConfig = opt(None, "the hybrid model", default_factory=ModelConfig)
    task: dict[str, Any] = opt(None, "the task: name plus its options", default_factory=lambda: {"name": "mqar"})
    train: TrainConfig = opt(None, "optimisation", default_factory=TrainConfig)
    eval: EvalConfig = opt(None, "evaluation", default_factory=EvalConfig)
    seed: int = opt(0, "seed for the model, the data and the batch order", at_least=0, at_most=2**31 - 1)
    name: str = opt("", "a short name for tables")
    description: str = opt("", "what the recipe is for")
    grid: Any = opt(None, "ablation grid: a mapping key.path -> list of values (product), or a list of "
                          "override mappings (explicit cells, optional 'label'); never inherited through extends")
    seeds: list[int] | None = opt(None, "run every grid cell once per seed, e.g. [0, 1, 2]: the same seeds for every "
                                        "cell, each cell keeping its label (rows differ by their seed)",
                                  at_least=0, at_most=2**31 - 1)

    def __post_init__(self):
        if self.seeds is not None:
            if not self.seeds:
                raise ValueError("seeds is empty; list the seeds every cell runs with, e.g. [0, 1, 2], or remove it")
            repeated = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
            if repeated:
                raise ValueError(f"seeds lists {repeated} more than once; give each seed once")


@dataclass(frozen=True)
class Spec:
    """A registered component (mixer, state mixer or task) with its validated options."""
    name: str
    options: Any



#: recipe keys that name or describe a run without changing what it computes (left out of the hash)
COSMETIC_KEYS = ("name", "description", "grid", "seeds")
#: train options that never change what a run computes (left out of the hash, so e.g. a checkpoint
#: interval may change between a killed run and its resumption)
COSMETIC_TRAIN_KEYS = ("checkpoint_every", "tracking", "tracking_dir")


@dataclass
class Recipe:
    """A recipe resolved exactly once: typed sections, validated component specs, plain dict, hash."""
    config: RecipeConfig
    layers: list[Spec]
    state_mixer: Spec
    task: Spec
    plain: dict
    source: str = ""
    cells: list = field(default_factory=list)  # [Cell] of the grid, each a resolved Recipe
    imports: tuple = ()  # the recipe's `imports`, for a process that runs it elsewhere (a Ray worker)
    eval_tasks: list = field(default_factory=list)  # [(label, Spec)] of eval.tasks

    # the typed sections, for reading convenience
    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def eval(self) -> EvalConfig:
        return self.config.eval

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def key(self) -> str:
        """Stable hash of everything that changes what the recipe computes."""
        content = {k: v for k, v in self.plain.items() if k not in COSMETIC_KEYS}
        if isinstance(content.get("train"), dict):
            content["train"] = {k: v for k, v in content["train"].items() if k not in COSMETIC_TRAIN_KEYS}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Cell:
    """One cell of an ablation grid: its label, the overrides that define it, and its resolved recipe."""
    label: str
    overrides: dict
    recipe: Recipe
