"""``transfer_mix``: the training curriculum of Echo's transfer benchmark (arXiv 2605.06997, section 4.1).

Each sequence is a ``system_prompt`` sequence or, with probability ``tool_trace_fraction``, a
``tool_trace`` sequence (both from :mod:`zoo.tasks.transfer_tasks`, same vocabulary, options and
mask convention). The paper trains on "a mixed dataset of system-prompt and tool-trace examples"
without giving the proportion; an even mix is our default.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from mixers.options import opt

from .base import register_task
from .transfer_base import TransferOptions, TransferTask
from .transfer_tasks import SystemPrompt, ToolTrace


@register_task
class TransferMix(TransferTask):
    name = "transfer_mix"
    description = "transfer training mix: system_prompt and tool_trace sequences (tool_trace_fraction of them)"

    @dataclass
    class Options(ToolTrace.Options):  # the tool_trace options (num_agents and the length rules) plus the mix
        tool_trace_fraction: float = opt(0.5, "probability that a sequence is a tool_trace one (else system_prompt)",
                                         at_least=0.0, at_most=1.0)

    def __init__(self, options):
        super().__init__(options)
        shared = {f.name: getattr(options, f.name) for f in fields(TransferOptions)}
        self.parts = (SystemPrompt(SystemPrompt.Options(**shared)),
                      ToolTrace(ToolTrace.Options(**shared, num_agents=options.num_agents)))

    def rows(self, rng, pairs, seq_len):
        tool = rng.random(len(pairs)) < self.options.tool_trace_fraction
        return [self.parts[int(t)].row(rng, int(p), seq_len) for p, t in zip(pairs, tool)]
