"""The worked example of CONTRIBUTING.md ("Adding a mixer"): a cumulative-mean mixer.

    v_t = W_v x_t,   y_t = W_o (1/t) sum_{s<=t} v_s

Decode state: the running sum of v (width ``d_inner``) and the token count, ``d_inner + 1`` elements per
sequence, constant in T. ``tests/mixers/test_contract_catches.py`` registers it and runs the whole
contract suite on it, so the guide cannot rot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixers.base import Mixer
from mixers.options import opt


class CumulativeMean(Mixer):
    name = "cumulative_mean"
    description = "running mean of a value projection (the contributing guide's example)"
    state_formula = "d_inner + 1  (constant in T)"
    contract_options = {"d_inner": 8}

    @dataclass
    class Options:
        d_inner: int = opt(16, "width of the value projection", at_least=1)

    def __init__(self, d_model: int, options: "CumulativeMean.Options"):
        super().__init__(d_model, options)
        self.v_proj = nn.Linear(d_model, options.d_inner, bias=False)
        self.o_proj = nn.Linear(options.d_inner, d_model, bias=False)

    def prefill(self, x, mask=None):
        v = self.v_proj(x)
        total = v.cumsum(dim=1)
        count = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=v.dtype)[None, :, None]
        state = {"sum": total[:, -1], "count": torch.full((x.shape[0], 1), x.shape[1], device=x.device, dtype=v.dtype)}
        return self.o_proj(total / count), state

    def init_state(self, batch_size, device=None, dtype=None):
        return {"sum": torch.zeros(batch_size, self.options.d_inner, device=device, dtype=dtype),
                "count": torch.zeros(batch_size, 1, device=device, dtype=dtype)}

    def step(self, x_t, state):
        total, count = state["sum"] + self.v_proj(x_t), state["count"] + 1
        return self.o_proj(total / count), {"sum": total, "count": count}

    def state_size(self, seq_len: int) -> int:
        return self.options.d_inner + 1
