"""The configuration of an exported zoo language model: its resolved recipe, as a transformers config.

``config.json`` holds the whole resolved recipe (every layer's mixer and validated options, the state
mixer, the task and its tokenizer, training and evaluation), the key it was trained under and the modules
that define out-of-tree components, so any stack the zoo can train round-trips; ``vocab_size``,
``hidden_size`` and ``num_hidden_layers`` are derived from it for tools that read those names.
"""
from __future__ import annotations

from transformers import PretrainedConfig

#: the ``model_type`` of exported models (``AutoConfig`` finds the class by it once :mod:`zoo.hf` is imported)
MODEL_TYPE = "mixer_zoo"


class ZooConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, recipe: dict | None = None, recipe_key: str = "", imports: list[str] | None = None,
                 vocab_size: int = 257, tie_word_embeddings: bool = True, **kwargs):
        for derived in ("hidden_size", "num_hidden_layers", "mixers"):
            kwargs.pop(derived, None)
        self.recipe = dict(recipe or {})
        self.recipe_key = recipe_key
        self.imports = list(imports or [])
        self.vocab_size = vocab_size
        self.tie_word_embeddings = tie_word_embeddings
        model = self.recipe.get("model") or {}
        self.hidden_size = model.get("d_model")
        self.num_hidden_layers = len(model.get("layers") or [])
        self.mixers = [layer if isinstance(layer, str) else next(iter(layer)) for layer in model.get("layers") or []]
        super().__init__(**kwargs)
