"""The hybrid stack: embedding -> N blocks -> RMSNorm -> tied LM head.

A block is ``x + mixer(norm(x))`` then ``x + state_mixer(norm(x))`` (pre-norm, residual). Every layer
is a :class:`zoo.config.Spec` (a mixer name and its validated options) from the resolved recipe, so
swapping one mixer for another, or giving two layers of one type different options, is one edit. The
model also exposes the recurrent form of its mixers (``prefill`` / ``step``) for decoding, an honest
``state_size`` summed over layers, and :meth:`HybridLM.test_time` to set the test-time knobs the
mixers declare.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import nn

from kernels.common import autocast_off
from mixers import MIXERS, STATE_MIXERS
from mixers.layers import RMSNorm, no_weight_decay
from mixers.options import OptionError, failed_assertion

from .config import Recipe, Spec


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, state_mixer: nn.Module | None, d_model: int, eps: float):
        super().__init__()
        self.mixer_norm = RMSNorm(d_model, eps, to_linear=mixer.input_to_linear)
        self.mixer = mixer
        self.state_norm = None if state_mixer is None else RMSNorm(d_model, eps, to_linear=state_mixer.input_to_linear)
        self.state_mixer = state_mixer

    def _ffn(self, x):
        return x if self.state_mixer is None else x + self.state_mixer(self.state_norm(x))

    def forward(self, x, mask=None):
        return self._ffn(x + self.mixer(self.mixer_norm(x), mask=mask))

    def prefill(self, x, mask=None):
        y, state = self.mixer.prefill(self.mixer_norm(x), mask=mask)
        return self._ffn(x + y), state

    def step(self, x_t, state):
        # a mixer steps in fp32 with autocast off (mixers.boundary): its input is not rounded for it
        with autocast_off(x_t.device.type):
            normed = self.mixer_norm(x_t)
        y, state = self.mixer.step(normed, state)
        return self._ffn(x_t + y), state


def _build(registry, spec: Spec, d_model: int, where: str, context: str = ""):
    """Build ``spec``; a refusal is an :class:`OptionError` at ``where``, the recipe key that holds the options to
    change (``context``: where else they come from, said after the name)."""
    try:
        return registry.get(spec.name)(d_model, spec.options)
    except (ValueError, TypeError) as err:  # constructor checks that need d_model (divisibility, ...)
        raise OptionError(where, f"{spec.name}{context}: {err}") from None
    except AssertionError as err:  # research code checks its options with assert
        raise OptionError(where, f"{spec.name}{context}: {failed_assertion(err)}") from None
    except (ArithmeticError, RuntimeError, MemoryError) as err:  # sizes no constructor checks (e.g. 10**18)
        raise OptionError(where, f"{spec.name}{context}: cannot be built with these options ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''}); check its sizes") from None


#: the recipe key of the state mixer's options (``model.state_mixer`` only names it)
STATE_MIXER_OPTIONS = "model.state_mixer_options"


class HybridLM(nn.Module):
    def __init__(self, layers: list[Spec], vocab_size: int, d_model: int, state_mixer: Spec | None = None,
                 norm_eps: float = 1e-5, use_mask: bool = True, *,
                 option_keys: list[tuple[str, str]] | None = None):
        """``option_keys``: for every layer, the recipe key a refusal of its options names and a note (see
        :meth:`zoo.config.ModelConfig.layer_option_keys`; by default ``model.layers.<i>``)."""
        super().__init__()
        state_mixer = state_mixer or Spec("swiglu", STATE_MIXERS.get("swiglu").Options())
        for spec in [*layers, state_mixer]:
            if not isinstance(spec, Spec):
                raise TypeError(f"HybridLM: layers and state_mixer are Specs (a name and validated options), got "
                                f"{type(spec).__name__} {spec!r}; build a model from a recipe with "
                                f"zoo.build_model(zoo.load(path_or_mapping))")
        self.layer_specs = list(layers)
        self.layer_names = [spec.name for spec in layers]
        self.use_mask = use_mask
        self.embed = nn.Embedding(vocab_size, d_model)
        blocks = []
        for i, spec in enumerate(layers):
            mixer = _build(MIXERS, spec, d_model, *(option_keys[i] if option_keys else (f"model.layers.{i}",)))
            sm = None if STATE_MIXERS.get(state_mixer.name).is_identity else \
                _build(STATE_MIXERS, state_mixer, d_model, STATE_MIXER_OPTIONS)
            blocks.append(Block(mixer, sm, d_model, norm_eps))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d_model, norm_eps, to_linear=True)    # feeds the head
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)
        no_weight_decay(self.embed, "weight")  # the (tied) embedding is not decayed

    @classmethod
    def from_recipe(cls, recipe: Recipe, vocab_size: int) -> "HybridLM":
        m = recipe.model
        return cls(recipe.layers, vocab_size, m.d_model, recipe.state_mixer, m.norm_eps, m.use_mask,
                   option_keys=m.layer_option_keys())

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        mask = mask if self.use_mask else None
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(self.norm(x))

    @torch.no_grad()
    def prefill(self, ids, mask=None):
        x = self.embed(ids)
        mask = mask if self.use_mask else None
        states = []
        for block in self.blocks:
            x, state = block.prefill(x, mask=mask)
            states.append(state)
        return self.head(self.norm(x)), states

    @torch.no_grad()
    def step(self, token: torch.Tensor, states):
        if not isinstance(states, (list, tuple)) or len(states) != len(self.blocks):
            got = f"{len(states)} states" if isinstance(states, (list, tuple)) else type(states).__name__
            raise ValueError(f"HybridLM.step: states must be the list of {len(self.blocks)} per-layer states that "
                             f"prefill or step returned, got {got}")
        x = self.embed(token)
        new_states = []
        for block, state in zip(self.blocks, states):
            x, state = block.step(x, state)
            new_states.append(state)
        return self.head(self.norm(x)), new_states

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def state_size(self, seq_len: int) -> int:
        """Decode-state elements per sequence, summed over every layer's mixer."""
        return sum(block.mixer.state_size(seq_len) for block in self.blocks)

    def active_state_size(self, seq_len: int) -> int:
        """State elements one decode step touches, summed over layers (= state_size unless a mixer is sparse)."""
        return sum(block.mixer.active_state_size(seq_len) for block in self.blocks)

    def test_time_knobs(self) -> set[str]:
        """Every test-time knob some layer of this model declares."""
        return {k for block in self.blocks for k in block.mixer.test_time_knobs}

    @contextlib.contextmanager
    def test_time(self, values: Mapping[str, Any] | None = None):
        """Inside this context, evaluation uses ``values`` for the test-time knobs: each mixer takes the
        knobs it declares and ignores the others (a mixed stack shares one mapping). A value one layer refuses
        leaves every layer as it was, the layers set before it included."""
        saved = self.set_test_time(values)
        try:
            yield self
        finally:
            for block, previous in zip(self.blocks, saved):
                block.mixer.restore_test_time(previous)

    def set_test_time(self, values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Use ``values`` for the test-time knobs from now on (in eval mode; each mixer takes the knobs it
        declares), and return every layer's previous knobs. A value one layer refuses leaves every layer as it
        was, the layers set before it included."""
        saved = []
        try:
            for block in self.blocks:
                saved.append(block.mixer.set_test_time(values or {}))
        except BaseException:
            for block, previous in zip(self.blocks, saved):
                block.mixer.restore_test_time(previous)
            raise
        return saved
