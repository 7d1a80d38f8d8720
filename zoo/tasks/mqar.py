"""Multi-query associative recall (MQAR), after the Zoology generator (Arora et al. 2023).

A sequence starts with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys drawn without
replacement from ``[1, V/2)``, values from ``[V/2, V)``); the rest holds every key once more as a
query, at positions drawn without replacement with power-law probability ``p(g) ~ g^(a-1)`` over the
even offsets ``g`` of the query region (short gaps are likelier). The label at a query position is
the value that followed that key; every other label is -100. Positions that are not queries hold 0,
or random tokens when ``random_fill`` is on. The prefix mask marks the key-value context.

``value_gap`` (default 0, Zoology's layout) puts that many filler positions between a key and its
value in the context, ``k1 _ v1 k2 _ v2 ...`` for a gap of 1; queries keep the ``key -> next token is its
value`` form. It moves the value away from the position right after its key, which is what a lag-p
readout such as SKA's power filter reaches (p = 1 reads one position on, p = 2 two). The fillers are 0,
or with ``random_fill`` random tokens uniform over the vocabulary less the sequence's own keys and values:
every key and every value occurs once in the context, as in Zoology's layout, so that no filler repeats a
key with another token ``value_gap + 1`` positions on (a second binding that a query could read) or puts a
value between a key and its own. (The non-query positions after the context are random over the whole
vocabulary, as Zoology's are: none is supervised, and a query's key and value stay those of the context.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.options import opt

from .base import Task, TaskData, register_task

#: uniform draws per block of rows in :func:`first_of_permutations` (16 MiB of them, 32 MiB of their order)
DRAW_BLOCK_ELEMENTS = 2 ** 22


def first_of_permutations(rows: int, size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``(rows, count)`` distinct values of ``[0, size)`` per row, without replacement: the first ``count``
    entries of a random permutation per row (the order of ``size`` uniform draws). The draws are made a block
    of rows at a time, which gives the same numbers as one draw of all rows in the same order, so memory stays
    at a block's whatever the vocabulary (one draw of 20,000 rows at a vocabulary of 65,536 took 8 GB)."""
    block = max(1, DRAW_BLOCK_ELEMENTS // max(size, 1))
    parts = [torch.argsort(torch.rand(min(block, rows - start), size, generator=generator), dim=1)[:, :count].clone()
             for start in range(0, rows, block)]  # clone: a slice would keep its block's whole order alive
    return torch.cat(parts) if parts else torch.zeros(0, count, dtype=torch.long)


def other_tokens(drawn: torch.Tensor, taken: torch.Tensor, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """``drawn`` (rows, m), uniform over ``[0, vocab_size)``, with every entry that is one of its row's ``taken``
    tokens (rows, c; distinct within a row) drawn again, uniformly among the ``vocab_size - c`` tokens not taken:
    the result is uniform over those tokens, and an entry that was not taken is kept. One draw of shape
    ``drawn.shape`` is made whatever the entries."""
    taken = taken.sort(dim=1).values
    others = torch.randint(vocab_size - taken.shape[1], drawn.shape, generator=generator)
    # the r-th token not taken is r + #{j: taken_j - j <= r} (taken_j - j: the tokens not taken below taken_j)
    below = (taken - torch.arange(taken.shape[1])).contiguous()
    others = others + torch.searchsorted(below, others, right=True)
    at = torch.searchsorted(taken, drawn.contiguous()).clamp(max=taken.shape[1] - 1)
    return torch.where(taken.gather(1, at) == drawn, others, drawn)


@register_task
class MQAR(Task):
    name = "mqar"
    description = "multi-query associative recall (Zoology generator): kv pairs, then queries with power-law gaps"

    @dataclass
    class Options:
        vocab_size: int = opt(256, "vocabulary size V (keys from [1, V/2), values from [V/2, V))", at_least=2,
                              at_most=1 << 24)
        seq_len: int = opt(64, "training sequence length", at_least=1, at_most=1 << 22)
        num_kv_pairs: int = opt(8, "key-value pairs per sequence", at_least=1)
        num_train: int = opt(20_000, "training examples", at_least=1, at_most=10_000_000)
        num_test: int = opt(1_000, "test examples", at_least=1, at_most=10_000_000)
        power_a: float = opt(0.01, "power-law exponent a of the query gaps, p(g) ~ g^(a-1)", above=0.0)
        random_fill: bool = opt(True, "fill non-query positions with random tokens instead of 0")
        value_gap: int = opt(0, "filler positions between a key and its value in the context (0: k v k v ...)",
                             at_least=0, at_most=1 << 10, omit_at_default=True)

        def min_seq_len(self) -> int:
            """The context (``2 + value_gap`` tokens a pair) and two query-region tokens a pair (queries
            sit at even offsets)."""
            return self.num_kv_pairs * (4 + self.value_gap)

        def __post_init__(self):
            if self.min_seq_len() > self.seq_len:
                gap = f" + value_gap ({self.value_gap})" if self.value_gap else ""
                raise ValueError(f"num_kv_pairs * (4{gap}) must be <= seq_len (got {self.num_kv_pairs} pairs for "
                                 f"seq_len {self.seq_len}); lower num_kv_pairs or raise seq_len")
            if self.num_kv_pairs >= self.vocab_size // 2:
                raise ValueError(f"vocab_size {self.vocab_size} holds {max(self.vocab_size // 2 - 1, 0)} key ids "
                                 f"([1, vocab_size // 2)), fewer than the num_kv_pairs ({self.num_kv_pairs}) distinct "
                                 f"keys a sequence needs; raise vocab_size to at least {2 * self.num_kv_pairs + 2} or "
                                 f"lower num_kv_pairs")

    @property
    def vocab_size(self) -> int:
        return self.options.vocab_size

    def check_length(self, seq_len: int) -> None:
        need = self.options.min_seq_len()
        if seq_len < need:
            raise ValueError(f"mqar: seq_len {seq_len} is too short for {self.options.num_kv_pairs} pairs "
                             f"(needs >= {need})")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.check_length(seq_len)
        o = self.options
        stride = 2 + o.value_gap  # context positions per pair
        n, pairs, V = num_examples, o.num_kv_pairs, o.vocab_size
        half = V // 2
        keys = first_of_permutations(n, half - 1, pairs, generator) + 1
        values = first_of_permutations(n, V - half, pairs, generator) + half
        context = stride * pairs
        kv = torch.zeros(n, context, dtype=torch.long)  # fillers stay 0 (random_fill replaces them)
        kv[:, 0::stride], kv[:, stride - 1::stride] = keys, values
        space = (seq_len - context) // 2
        weights = o.power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (o.power_a - 1)
        gaps = torch.multinomial(weights.expand(n, space), pairs, replacement=False, generator=generator)
        queries = torch.zeros(n, seq_len - context + 1, dtype=torch.long)
        queries.scatter_(1, 2 * gaps, keys)
        full = torch.cat([kv, queries], dim=1)  # one longer, then shift into (input, next-token label)
        labels = torch.full((n, seq_len + 1), -100, dtype=torch.long)
        labels.scatter_(1, 2 * gaps + context + 1, values)
        inputs, labels = full[:, :-1].clone(), labels[:, 1:].clone()
        if o.random_fill:
            noise = torch.randint(V, inputs.shape, generator=generator)
            inputs = torch.where(inputs == 0, noise, inputs)
            if o.value_gap:  # the context's fillers: not the sequence's own keys and values
                fillers = torch.tensor([t for t in range(context) if t % stride not in (0, stride - 1)])
                inputs[:, fillers] = other_tokens(inputs[:, fillers], torch.cat([keys, values], dim=1), V, generator)
        mask = torch.zeros(n, seq_len)
        mask[:, :context] = 1.0
        return TaskData(inputs, labels, mask)
