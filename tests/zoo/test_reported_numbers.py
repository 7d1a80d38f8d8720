"""Numbers the benchmarks and tables report, checked against an independent count: the working memory of one
forward+backward in ``zoo bench`` and the decode state a sparse mixer reports as touched per step. (No timing is
asserted.)"""
from __future__ import annotations

import torch
from torch import nn

from mixers import build_mixer
from zoo.benchmark import measure as measure_mod
from zoo.host_memory import PeakRSS


class _Scale(nn.Module):
    """The smallest mixer ``measure`` takes: ``y = x * w``; it keeps every input that needs a gradient."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.w = nn.Parameter(torch.ones(d_model))
        self.inputs: list[torch.Tensor] = []

    def forward(self, x, mask=None):
        if x.requires_grad:
            self.inputs.append(x)
        return x * self.w

    def prefill(self, x, mask=None):
        return x * self.w, {}


def test_the_peak_of_a_forward_backward_starts_without_the_timed_calls_input_gradient(monkeypatch):
    """``peak_mib`` is the working memory of one forward+backward above what was allocated before it. The input
    gradient the timed calls left behind is freed by the measured call as it starts; were it still allocated
    when the base is taken, the peak would leave out one input-sized buffer (the input gradient the backward
    writes): on CUDA exactly ``batch * T * d_model`` elements too little."""
    mixer = _Scale(8)
    stale: list[bool] = []

    class Base(PeakRSS):    # the CPU path's base; the CUDA path reads memory_allocated at the same point
        def __enter__(self):
            stale.append(any(x.grad is not None for x in mixer.inputs))
            return super().__enter__()

    monkeypatch.setattr(measure_mod, "PeakRSS", Base)
    row = measure_mod.measure(mixer, 16, 2, torch.device("cpu"), torch.float32, warmup=1, repeats=2, decode=False)
    assert row["error"] is None
    assert mixer.inputs and len(stale) == 2, "the prefill and the forward+backward are measured"
    assert not any(stale), "an input gradient of the timed calls was still allocated when the base was taken"


def test_kronecker_slots_touches_no_more_rows_than_it_has():
    """A step writes ``top_k`` slot rows and reads ``top_k`` per head: at most ``2 top_k`` distinct rows, and never
    more than the ``M = d_p^U`` rows there are. With ``2 top_k > M`` every row may be touched, so the active state
    is the whole memory, not more than the state."""
    d_v, heads = 4, 2
    for top_k, rows in ((4, 4), (3, 4), (2, 4), (1, 2)):
        m = build_mixer("kronecker_slots", 16, {"n_heads": heads, "d_v": d_v, "d_p": 2, "U": 2, "top_k": top_k})
        assert m.num_slots == 4
        with torch.no_grad():
            _, state = m.prefill(torch.randn(2, 5, 16))
        held = sum(t.numel() for t in state.values()) // 2
        assert m.state_size(5) == held
        assert m.active_state_size(5) <= m.state_size(5)
        assert m.active_state_size(5) == heads * rows * (d_v + 1) + m._conv_state_size()
