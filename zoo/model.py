"""The hybrid stack: embedding -> N blocks -> RMSNorm -> tied LM head.

A block is ``x + mixer(norm(x))`` then ``x + state_mixer(norm(x))`` (pre-norm, residual). The mixer
of every layer comes from the recipe (``model.layers`` or an expanded ``model.pattern``), so swapping
one mixer for another is one edit. The model also exposes the recurrent form of its mixers
(``prefill`` / ``step``) for decoding, and an honest ``state_size`` summed over layers.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from mixers import build_mixer, build_state_mixer
from mixers.layers import RMSNorm

from .config import ModelConfig


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, state_mixer: nn.Module | None, d_model: int, eps: float):
        super().__init__()
        self.mixer_norm = RMSNorm(d_model, eps)
        self.mixer = mixer
        self.state_norm = RMSNorm(d_model, eps) if state_mixer is not None else None
        self.state_mixer = state_mixer

    def _ffn(self, x):
        return x if self.state_mixer is None else x + self.state_mixer(self.state_norm(x))

    def forward(self, x, mask=None):
        return self._ffn(x + self.mixer(self.mixer_norm(x), mask=mask))

    def prefill(self, x, mask=None):
        y, state = self.mixer.prefill(self.mixer_norm(x), mask=mask)
        return self._ffn(x + y), state

    def step(self, x_t, state):
        y, state = self.mixer.step(self.mixer_norm(x_t), state)
        return self._ffn(x_t + y), state


class HybridLM(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int):
        super().__init__()
        self.config = config
        self.layer_names = config.resolved_layers()
        d = config.d_model
        self.embed = nn.Embedding(vocab_size, d)
        blocks = []
        for i, name in enumerate(self.layer_names):
            mixer = build_mixer(name, d, config.mixer_options.get(name), path=f"model.mixer_options.{name}")
            sm = build_state_mixer(config.state_mixer, d, config.state_mixer_options, path="model.state_mixer_options")
            blocks.append(Block(mixer, None if getattr(sm, "is_identity", False) else sm, d, config.norm_eps))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(d, config.norm_eps)
        self.head = nn.Linear(d, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        mask = mask if self.config.use_mask else None
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(self.norm(x))

    @torch.no_grad()
    def prefill(self, ids, mask=None):
        x = self.embed(ids)
        mask = mask if self.config.use_mask else None
        states = []
        for block in self.blocks:
            x, state = block.prefill(x, mask=mask)
            states.append(state)
        return self.head(self.norm(x)), states

    @torch.no_grad()
    def step(self, token: torch.Tensor, states):
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

    def has_num_iter_knob(self) -> bool:
        return any(hasattr(block.mixer.options, "eval_num_iter") for block in self.blocks)

    @contextlib.contextmanager
    def eval_num_iter(self, num_iter: int | None):
        """Test-time compute knob: mixers with an ``eval_num_iter`` option use ``num_iter`` at evaluation
        inside this context (``None`` leaves every mixer's own setting)."""
        options = [b.mixer.options for b in self.blocks if hasattr(b.mixer.options, "eval_num_iter")]
        saved = [o.eval_num_iter for o in options]
        if num_iter is not None:
            for o in options:
                o.eval_num_iter = num_iter
        try:
            yield
        finally:
            for o, value in zip(options, saved):
                o.eval_num_iter = value
