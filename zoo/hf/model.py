"""A zoo language model as a ``transformers`` causal LM: :class:`ZooForCausalLM`.

The model wraps the zoo's own :class:`zoo.model.HybridLM`, built from the resolved recipe in its config
(:class:`zoo.hf.config.ZooConfig`), so it computes what the zoo computes: the same modules, the same
kernels, the same weights (``model.safetensors``, the tied embedding stored once).

``forward`` runs in one of three ways:

- no cache (scoring, training with ``labels``): the parallel form of every layer, as the zoo's forward;
- an empty :class:`zoo.hf.cache.ZooCache` (``use_cache=True``, the prompt in ``generate``): every layer's
  ``prefill``, which also returns its decode state into the cache;
- a cache that has consumed tokens (each new token in ``generate``): every layer's ``step`` from its state,
  one position after another, so a linear-state layer costs the same per token at any context length. Such a
  cache is continued (and advanced) with ``use_cache=False`` too, which only leaves it out of the output.

``attention_mask`` is not an input of the zoo's mixers: a recurrent state would read padding, so a mask
with a zero before a one (left padding), or any zero with a cache, is refused; right padding is harmless
when scoring (every layer is causal). An empty prompt where a cache starts is refused too (it gives no logits to
draw the first token from; ``generate()`` without ``input_ids`` starts from EOS, as ``zoo generate`` does), and
so is assisted decoding (``_is_stateful``: the states cannot be rolled back to a draft's start). With ``labels``
the loss is the mean over the supervised next tokens, or their sum divided by ``num_items_in_batch`` where it is
given: the Trainer passes it under gradient accumulation to any ``forward`` taking ``**kwargs``, and then leaves
the loss unscaled. Loading runs no code named by a file:
the modules that define out-of-tree components (``config.imports``) must be imported first.

The test-time knobs of the config (``config.test_time``: the recipe's ``eval.test_time`` unless ``zoo export
--test-time`` changed it) are set on every layer when the model is made, as :func:`zoo.generate.load_lm` sets
them, and again by the next ``forward`` after ``config.test_time`` is edited (the values ``save_pretrained``
writes), so in eval mode (``from_pretrained`` returns it so) every form above computes with them and the logits
are the zoo model's under ``model.test_time(recipe.eval.test_time)``; in train mode the layers use their options,
as the zoo's training does. A knob no layer declares, or a value its option refuses, is refused.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import UserError
from ..generate import apply_test_time, check_test_time, parse_test_time
from ..model import HybridLM
from ..recipes import resolve
from ..recipes.plain import recipe_mapping
from .cache import ZooCache
from .config import ZooConfig

#: what transformers calls the cache in model inputs and outputs: ``cache`` since 5.24, ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def build_hybrid(config: ZooConfig) -> HybridLM:
    """The untrained zoo model of ``config``'s recipe (the weights come from the checkpoint)."""
    missing = [m for m in config.imports if m not in sys.modules]
    if missing:
        raise ValueError(f"this model uses components defined in {missing}; import them before loading it (loading "
                         f"imports no module a file names)")
    mapping = recipe_mapping(config.recipe, config.imports)
    recipe = resolve(mapping)
    if config.recipe_key and recipe.key != config.recipe_key:
        raise ValueError(f"the recipe in config.json resolves to key {recipe.key}, not {config.recipe_key} as it "
                         f"was trained: a default of this mixer-zoo version differs from the one that trained it")
    if config.kernel_backend is not None:   # after the key check: the same model, computed by other kernels
        overrides = [f"model.layers.{i}.{spec.name}.backend={config.kernel_backend}"
                     for i, spec in enumerate(recipe.layers) if hasattr(spec.options, "backend")]
        try:
            recipe = resolve(mapping, overrides)
        except UserError as err:
            raise ValueError(f"kernel_backend={config.kernel_backend!r}: {err}") from None
    return HybridLM.from_recipe(recipe, config.vocab_size)


def set_test_time(hybrid: HybridLM, config: ZooConfig) -> dict:
    """Set the config's test-time knob values on every layer of ``hybrid`` in place of any it had, checked as a
    recipe's ``eval.test_time`` is (a ``ValueError`` naming the knob and the layers that declare knobs, which
    changes no layer); returns the config's values it set."""
    given = values = config.test_time_values()
    if config.test_time is None:  # the recipe's eval.test_time, where a grid's knob may reach a layer without it
        values = {k: v for k, v in values.items() if k in hybrid.test_time_knobs()}
    try:
        values = check_test_time(hybrid, parse_test_time(values, "config.test_time.{}"))
    except UserError as err:
        raise ValueError(str(err)) from None
    for block in hybrid.blocks:  # a knob left out of an edited config.test_time computes with its option again
        block.mixer.restore_test_time({})
    apply_test_time(hybrid, values)
    return given


def check_padding(attention_mask: torch.Tensor | None, decoding: bool) -> None:
    """Refuse padding the states would read: any zero while decoding (a cache), a zero before a one otherwise."""
    if attention_mask is None or attention_mask.ndim != 2 or bool(attention_mask.all()):
        return
    mask = attention_mask.bool()
    if decoding or bool((~mask[:, :-1] & mask[:, 1:]).any()):
        raise ValueError("mixer-zoo models carry a recurrent state, which padding would enter: give prompts one at "
                         "a time or of equal length (right padding is fine when scoring without a cache)")


def check_prompt_length(length: int, cache: ZooCache) -> None:
    """Refuse an empty prompt where a cache starts: it leaves no position whose logits give the first new token."""
    if length == 0 and cache.seen == 0:
        raise ValueError("an empty prompt (0 tokens) gives no logits to draw the first new token from: start from "
                         "the EOS token (input_ids=[[tokenizer.eos_token_id]], as zoo generate starts an empty "
                         "prompt), or call generate() without input_ids")


class ZooForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ZooConfig
    base_model_prefix = "zoo"
    main_input_name = "input_ids"
    _tied_weights_keys = {"zoo.head.weight": "zoo.embed.weight"}
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False
    _is_stateful = True  # a recurrent state cannot be rolled back: generate refuses assisted decoding up front

    def __init__(self, config: ZooConfig, hybrid: HybridLM | None = None):
        super().__init__(config)
        self.zoo = hybrid if hybrid is not None else build_hybrid(config)
        self._test_time_set = set_test_time(self.zoo, config)
        self.post_init()

    def _follow_config_test_time(self) -> None:
        """Set ``config.test_time`` again where it was edited since it was set: ``save_pretrained`` writes the
        edited values, so the model computes with what a reload of it computes with."""
        if self.config.test_time_values() != self._test_time_set:
            self._test_time_set = set_test_time(self.zoo, self.config)

    def _init_weights(self, module):
        """Nothing: the zoo's constructors initialise every weight, and a loaded model takes the checkpoint's."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own ZooCache on the first forward with use_cache

    def get_input_embeddings(self):
        return self.zoo.embed

    def set_input_embeddings(self, value):
        self.zoo.embed = value

    def get_output_embeddings(self):
        return self.zoo.head

    def set_output_embeddings(self, value):
        self.zoo.head = value

    def forward(self, input_ids=None, attention_mask=None, cache=None, inputs_embeds=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, logits_to_keep=0, past_key_values=None,
                **kwargs):
        self._follow_config_test_time()
        cache = cache if cache is not None else past_key_values
        returns_cache = cache is not None if use_cache is None else use_cache
        # a cache that has consumed tokens is continued whatever use_cache says, as transformers' own models read
        # their past: the parallel form would start the input at position 0, the logits of another text
        use_cache = returns_cache or _consumed(cache) > 0
        if use_cache and not isinstance(cache, ZooCache):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(f"a zoo model decodes from a ZooCache, not a {type(cache).__name__}")
            cache = ZooCache()
        check_padding(attention_mask, use_cache)
        x = self.zoo.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache:
            check_prompt_length(x.shape[1], cache)
        hidden = [x]
        if not use_cache:
            for block in self.zoo.blocks:
                hidden.append(block(x))
                x = hidden[-1]
        elif cache.seen == 0:
            cache.states = []
            for block in self.zoo.blocks:
                x, state = block.prefill(x)
                hidden.append(x)
                cache.states.append(state)
        else:
            hidden = self._steps(x, cache)
            x = hidden[-1]
        if use_cache:
            cache.seen += x.shape[1]
        if output_hidden_states:  # the last hidden state after the final norm, as transformers' models give it
            x = hidden[-1] = self.zoo.norm(x)
        if isinstance(logits_to_keep, int):
            kept = x[:, -logits_to_keep:] if logits_to_keep > 0 else x
        else:
            kept = x[:, logits_to_keep]
        logits = self.zoo.head(kept if output_hidden_states else self.zoo.norm(kept))
        loss = None
        if labels is not None:  # given num_items_in_batch (the Trainer's under gradient accumulation), summed over it
            items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100, reduction="mean" if items is None else "sum")
            if items is not None:
                loss = loss / (items.to(loss.device) if torch.is_tensor(items) else items)
        hidden = tuple(hidden) if output_hidden_states else None
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden,
                                     **{CACHE_FIELD: cache if returns_cache else None})
        return out.to_tuple() if return_dict is False else out

    def _steps(self, x: torch.Tensor, cache: ZooCache) -> list[torch.Tensor]:
        """Every layer's ``step`` over the positions of ``x``, from and into the cache's states; the input and
        each layer's output, ``(batch, T, d_model)`` each."""
        per_position = []
        for t in range(x.shape[1]):
            h, outs = x[:, t], [x[:, t]]
            for i, block in enumerate(self.zoo.blocks):
                h, cache.states[i] = block.step(h, cache.states[i])
                outs.append(h)
            per_position.append(outs)
        return [torch.stack(layer, dim=1) for layer in zip(*per_position)]


def _consumed(cache) -> int:
    """The tokens a cache given to ``forward`` has consumed (0 for none)."""
    if cache is None:
        return 0
    return cache.seen if isinstance(cache, ZooCache) else cache.get_seq_length()
