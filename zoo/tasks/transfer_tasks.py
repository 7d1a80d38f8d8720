"""The five transfer-retrieval tasks of Echo's transfer benchmark (arXiv 2605.06997, section 4.1).

All share the vocabulary and the facts / distractors / queries structure of
:mod:`zoo.tasks.transfer_base`: the label is at the last key token of each ``Q <key...> <answer>``
query and the mask is 1 on the fact tokens. What differs is where the facts sit, what they look like
and what a query asks:

- ``system_prompt``: the facts open the sequence as ``k1 v1 ... kn vn`` (the system variables), a
  scratchpad of filler follows, the queries ``Q k v`` close it.
- ``tool_trace``: a history of tool calls ``agent tool result``, each followed by a random-length span of
  filler (the tool's output); queries ``Q agent tool result``. Tools are distinct within a sequence and
  agents come from a small pool (``num_agents``), so the agent is part of the surface form, not needed
  to disambiguate.
- ``niah``: a haystack of filler with the facts ``k v`` (the needles) inserted at uniformly random,
  non-overlapping positions; queries ``Q k v`` at the end.
- ``multi_hop``: chains ``k0 -> k1 -> ... -> v`` written as ``hops`` separate pair facts, all chains'
  pairs shuffled together at the start; the query ``Q k0 v`` asks for the end of a chain, so the answer
  is never written next to the queried key.
- ``common_word``: ``k v`` facts at the start in which one value (the common word) is bound to
  ``num_common`` different keys and every other value appears once; queries ask for keys bound to the
  common word (or, with ``query_common_only: false``, for any key), so the answer can be found by key
  or by picking the context's most frequent value.

The paper names these five tasks and trains on system-prompt + tool-trace sequences only; the layouts
above are our reading and stay options where a choice was made.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixers.options import opt

from .base import register_task
from .transfer_base import OneLayoutTask, TransferOptions, assemble, queries_block


@register_task
class SystemPrompt(OneLayoutTask):
    name = "system_prompt"
    description = "transfer: system variables k v at the start, a filler scratchpad, then queries Q k v"

    Options = TransferOptions  # k v facts, Q k v queries

    def row(self, rng, pairs, seq_len):
        keys, values = self.draw(rng, "keys", pairs), self.draw(rng, "values", pairs)
        facts = np.stack([keys, values], axis=1).reshape(-1)
        asked = rng.choice(pairs, size=self.options.queries(pairs), replace=False)
        q_tokens, q_labels = queries_block(list(keys[asked]), values[asked])
        return self.facts_first(rng, facts, q_tokens, q_labels, seq_len)


@register_task
class ToolTrace(OneLayoutTask):
    name = "tool_trace"
    description = "transfer: tool calls 'agent tool result' each followed by filler output, then Q agent tool result"

    @dataclass
    class Options(TransferOptions):
        num_agents: int = opt(3, "agents that make the calls (ids from the key range, disjoint from the tools)",
                              at_least=1, at_most=64)

        def keys_needed(self) -> int:
            return self.num_kv_pairs + self.num_agents

        def keys_for(self) -> str:
            return f"num_kv_pairs {self.num_kv_pairs} tools + num_agents {self.num_agents} agents"

        def key_knobs(self) -> str:
            return "num_kv_pairs or num_agents"

        def min_seq_len(self) -> int:
            return 3 * self.num_kv_pairs + 4 * self.queries(self.num_kv_pairs)

    def row(self, rng, pairs, seq_len):
        ids = self.draw(rng, "keys", pairs + self.options.num_agents)
        tools, agent_pool = ids[:pairs], ids[pairs:]
        agents = rng.choice(agent_pool, size=pairs)
        results = self.draw(rng, "values", pairs)
        asked = rng.choice(pairs, size=self.options.queries(pairs), replace=False)
        q_tokens, q_labels = queries_block([np.array([agents[i], tools[i]]) for i in asked], results[asked])
        gap = seq_len - 3 * pairs - len(q_tokens)
        # a random composition of the gap into one output span after each call
        cuts = np.sort(rng.integers(0, gap + 1, size=pairs - 1))
        spans = np.diff(np.concatenate([[0], cuts, [gap]]))
        body, mask = [], []
        for i in range(pairs):
            body += [agents[i], tools[i], results[i], *self.filler(rng, spans[i]).tolist()]
            mask += [1.0] * 3 + [0.0] * int(spans[i])
        return assemble(np.array(body, dtype=np.int64), np.array(mask), q_tokens, q_labels)


@register_task
class NeedleInHaystack(OneLayoutTask):
    name = "niah"
    description = "transfer: needles k v at random depths of a filler haystack, then queries Q k v"

    Options = TransferOptions  # k v facts, Q k v queries

    def row(self, rng, pairs, seq_len):
        keys, values = self.draw(rng, "keys", pairs), self.draw(rng, "values", pairs)
        asked = rng.choice(pairs, size=self.options.queries(pairs), replace=False)
        q_tokens, q_labels = queries_block(list(keys[asked]), values[asked])
        hay = seq_len - len(q_tokens)
        # needles are items among the hay - 2 * pairs filler tokens: choose their item slots, then
        # each earlier needle shifts the later ones by one extra token
        slots = np.sort(rng.choice(hay - pairs, size=pairs, replace=False)) + np.arange(pairs)
        body, mask = self.filler(rng, hay), np.zeros(hay)
        order = rng.permutation(pairs)
        for slot, i in zip(slots, order):
            body[slot], body[slot + 1] = keys[i], values[i]
            mask[slot:slot + 2] = 1.0
        return assemble(body, mask, q_tokens, q_labels)


@register_task
class MultiHop(OneLayoutTask):
    name = "multi_hop"
    description = "transfer: chains k0 -> k1 -> ... -> v as shuffled pair facts, then Q k0 v (answer = chain end)"

    @dataclass
    class Options(TransferOptions):
        hops: int = opt(2, "facts per chain (1 = plain recall)", at_least=1, at_most=8)

        def keys_needed(self) -> int:
            return self.num_kv_pairs * self.hops

        def keys_for(self) -> str:
            return f"num_kv_pairs {self.num_kv_pairs} chains x hops {self.hops}"

        def key_knobs(self) -> str:
            return "num_kv_pairs or hops"

        def min_seq_len(self) -> int:
            return 2 * self.hops * self.num_kv_pairs + 3 * self.queries(self.num_kv_pairs)

    def row(self, rng, pairs, seq_len):
        h = self.options.hops
        chains = self.draw(rng, "keys", pairs * h).reshape(pairs, h)
        ends = self.draw(rng, "values", pairs)
        nodes = np.concatenate([chains, ends[:, None]], axis=1)  # (pairs, h + 1): k0 .. k_{h-1}, v
        facts = np.stack([nodes[:, :-1].reshape(-1), nodes[:, 1:].reshape(-1)], axis=1)  # (pairs * h, 2)
        facts = facts[rng.permutation(len(facts))].reshape(-1)
        asked = rng.choice(pairs, size=self.options.queries(pairs), replace=False)
        q_tokens, q_labels = queries_block(list(chains[asked, 0]), ends[asked])
        return self.facts_first(rng, facts, q_tokens, q_labels, seq_len)


@register_task
class CommonWord(OneLayoutTask):
    name = "common_word"
    description = "transfer: k v facts where one value (the common word) is bound to several keys; Q k -> it"

    @dataclass
    class Options(TransferOptions):
        num_common: int = opt(3, "keys bound to the common word (capped by the facts of a sequence)", at_least=2)
        query_common_only: bool = opt(True, "query only keys bound to the common word (false: any key); the "
                                            "queries are then capped by those keys, and num_queries 0 asks each "
                                            "of them once")

        def __post_init__(self):
            if self.num_common > self.num_kv_pairs:
                raise ValueError(f"num_common ({self.num_common}) must be <= num_kv_pairs ({self.num_kv_pairs}); "
                                 f"lower num_common or raise num_kv_pairs")
            super().__post_init__()

        def values_needed(self) -> int:
            return self.num_kv_pairs - self.num_common + 1

    def row(self, rng, pairs, seq_len):
        o = self.options
        common = min(o.num_common, pairs)
        keys = self.draw(rng, "keys", pairs)
        words = self.draw(rng, "values", pairs - common + 1)
        values = np.concatenate([np.full(common, words[0]), words[1:]])
        order = rng.permutation(pairs)
        keys, values = keys[order], values[order]
        facts = np.stack([keys, values], axis=1).reshape(-1)
        pool = np.flatnonzero(values == words[0]) if o.query_common_only else np.arange(pairs)
        asked = rng.choice(pool, size=min(o.queries(pairs), len(pool)), replace=False)
        q_tokens, q_labels = queries_block(list(keys[asked]), values[asked])
        return self.facts_first(rng, facts, q_tokens, q_labels, seq_len)
