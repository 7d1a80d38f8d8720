"""The configuration of an exported zoo language model: its resolved recipe, as a transformers config.

``config.json`` holds the whole resolved recipe (every layer's mixer and validated options, the state
mixer, the task and its tokenizer, training and evaluation), the key it was trained under and the modules
that define out-of-tree components, so any stack the zoo can train round-trips; ``vocab_size``,
``hidden_size`` and ``num_hidden_layers`` are derived from it for tools that read those names.

``test_time`` holds the test-time knob values the model computes with in eval mode (``{knob: value}``): ``zoo
export`` writes the recipe's ``eval.test_time`` (the values its metrics were measured under) with any ``zoo
export --test-time`` over it, so the loaded model's logits are the zoo model's under them. They stay out of
``recipe`` (whose key names the trained model); edit ``config.test_time`` to compute with other values. A
config written before this field (``test_time`` null) takes the recipe's ``eval.test_time``.

``kernel_backend`` (null: each layer's own) sets the kernel backend of every layer whose mixer has one
(``from_pretrained(DIR, kernel_backend="torch")``: a model trained with ``backend: triton`` on a GPU runs on a CPU).
The backends compute the same function with the same weights, so it stays out of ``recipe`` too.
"""
from __future__ import annotations

from transformers import PretrainedConfig

#: the ``model_type`` of exported models (``AutoConfig`` finds the class by it once :mod:`zoo.hf` is imported)
MODEL_TYPE = "mixer_zoo"


class ZooConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, recipe: dict | None = None, recipe_key: str = "", imports: list[str] | None = None,
                 vocab_size: int = 257, tie_word_embeddings: bool = True, test_time: dict | None = None,
                 kernel_backend: str | None = None, **kwargs):
        for derived in ("hidden_size", "num_hidden_layers", "mixers"):
            kwargs.pop(derived, None)
        self.recipe = dict(recipe or {})
        self.recipe_key = recipe_key
        self.imports = list(imports or [])
        self.vocab_size = vocab_size
        self.tie_word_embeddings = tie_word_embeddings
        self.test_time = dict(test_time) if test_time is not None else None
        self.kernel_backend = kernel_backend
        model = self.recipe.get("model") or {}
        self.hidden_size = model.get("d_model")
        self.num_hidden_layers = len(model.get("layers") or [])
        self.mixers = [layer if isinstance(layer, str) else next(iter(layer)) for layer in model.get("layers") or []]
        super().__init__(**kwargs)

    def test_time_values(self) -> dict:
        """The test-time knob values the model computes with: ``test_time``, or, where a config written before it
        has none, the recipe's ``eval.test_time``."""
        if self.test_time is not None:
            return dict(self.test_time)
        return dict((self.recipe.get("eval") or {}).get("test_time") or {})
