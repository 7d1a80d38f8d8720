"""Small-vocabulary recall tasks and next-token Dyck-1.

The first two follow the memory-decay experiments of
Dadwal, "The Illusion of State: Sharp Memory-Decay Bounds in Linear State Space Models" (OpenReview
8Kg8lL3L58): discrete associative recall over a vocabulary of 20 at lengths 10-60, and next-token
prediction on balanced bracket words scored by exact sequence match.

``assoc_recall`` (vocabulary ``V`` symbols plus one query marker, ids ``[0, V]``)::

    [pad] k1 v1 k2 v2 ... kn vn  Q  q          n = (L - 2) // 2 pairs, L = seq_len

Keys and values are drawn uniformly from the same ``V`` symbols (keys with replacement, so a key can be
bound more than once at long lengths; the answer is the value bound MOST RECENTLY to the query key).
The query key ``q`` is the key of a uniformly drawn pair, so its answer is always in the context. ``Q``
(id ``V``) marks the query; one pad (also id ``V``) leads when ``L`` is odd. The only label is at the
last position (the query key): the answer, one of ``V`` symbols, so chance is ``1/V`` (0.05 at
``V = 20``, the paper's chance level). The paper gives the vocabulary, lengths and chance level but not
the token layout; this layout is our reading.

``dyck1_next`` (ids ``0 = '('``, ``1 = ')'``, ``2 = 'either'``): every sequence is a complete balanced
Dyck-1 word of even length ``L`` (depth >= 0, depth 0 at the end, depth <= ``max_depth``), drawn by a
walk that opens with probability ``p_open`` whenever both brackets are legal. The paper predicts "the
next token" with an exact-match metric; a free next token cannot be predicted, so the label after
each token (but the last) is the SET of legal next tokens: ``0`` when only '(' is legal (depth 0),
``1`` when only ')' is legal (the remaining tokens are all needed to close, or the depth is at
``max_depth``), ``2`` when both are. Read out with ``test_sequence_accuracy`` (every position right) it
is the paper's exact sequence match. It needs the depth (a counter) and, for the forced closes, the
position. The existing ``dyck1`` task differs: its sequences are open prefixes, not balanced words,
and it labels the depth itself (or "balanced"), not the next token.

``mad_recall`` (ids ``[0, V)``): in-context recall in the style of the MAD synthetic suite (Poli et al.,
"Mechanistic Design and Scaling of Hybrid Architectures", arXiv:2403.17844), used by the BD-LRU paper
(arXiv:2602.12021). Each sequence draws its own random map from the ``V/2`` keys ``[0, V/2)`` to the
values ``[V/2, V)`` and is a stream of ``L/2`` pairs ``k v`` with keys drawn uniformly with
repetition; the same key always carries the same value within a sequence. The label at a key position
is the value that follows it, supervised only when that key already occurred earlier in the sequence
(its answer is in the context; a first occurrence cannot be predicted). Unlike MQAR, there is no
separate query region: every repeated pair is a query, at every distance, and the map is dense (few
keys, many repetitions).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.options import opt

from .base import Task, TaskData, register_task

IGNORE = -100
OPEN, CLOSE, EITHER = 0, 1, 2


@register_task
class AssocRecall(Task):
    name = "assoc_recall"
    description = "single-query associative recall over a small vocabulary (V=20, latest binding wins)"

    @dataclass
    class Options:
        vocab_size: int = opt(20, "symbols V for keys and values (the model sees V + 1 ids: + the query marker)",
                              at_least=2, at_most=1 << 24)
        seq_len: int = opt(40, "training sequence length L (>= 4)", at_least=1, at_most=1 << 22)
        num_train: int = opt(20_000, "training examples", at_least=1, at_most=10_000_000)
        num_test: int = opt(1_000, "test examples", at_least=1, at_most=10_000_000)

        def __post_init__(self):
            if self.vocab_size < 2:
                raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
            if self.seq_len < 4:
                raise ValueError(f"seq_len must be >= 4 (one key-value pair, marker, query), got {self.seq_len}")

    @property
    def vocab_size(self) -> int:
        return self.options.vocab_size + 1

    def check_length(self, seq_len: int) -> None:
        if seq_len < 4:
            raise ValueError(f"assoc_recall: seq_len must be >= 4, got {seq_len}")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.check_length(seq_len)
        V, n = self.options.vocab_size, (seq_len - 2) // 2
        keys = torch.randint(V, (num_examples, n), generator=generator)
        values = torch.randint(V, (num_examples, n), generator=generator)
        pick = torch.randint(n, (num_examples,), generator=generator)
        query = keys.gather(1, pick[:, None])[:, 0]
        # the answer is the value of the LAST pair whose key is the query
        match = keys == query[:, None]
        last = torch.where(match, torch.arange(n), -1).amax(1)
        answer = values.gather(1, last[:, None])[:, 0]
        kv = torch.stack([keys, values], dim=2).flatten(1)
        marker = torch.full((num_examples, 1), V, dtype=torch.long)
        pad = marker[:, :0] if seq_len % 2 == 0 else marker
        inputs = torch.cat([pad, kv, marker, query[:, None]], dim=1)
        labels = torch.full_like(inputs, IGNORE)
        labels[:, -1] = answer
        return TaskData(inputs, labels)


@register_task
class Dyck1Next(Task):
    name = "dyck1_next"
    description = "next-token Dyck-1 on balanced words: label = legal next bracket(s); exact sequence match"

    @dataclass
    class Options:
        seq_len: int = opt(20, "training sequence length L (even: the words are balanced)", at_least=1, at_most=1 << 22)
        num_train: int = opt(20_000, "training examples", at_least=1, at_most=10_000_000)
        num_test: int = opt(1_000, "test examples", at_least=1, at_most=10_000_000)
        p_open: float = opt(0.5, "probability of '(' when both brackets are legal", above=0.0, below=1.0)
        max_depth: int = opt(16, "the depth never exceeds this", at_least=1)

        def __post_init__(self):
            if self.seq_len < 2 or self.seq_len % 2:
                raise ValueError(f"dyck1_next: seq_len must be even and >= 2 (balanced words), got {self.seq_len}")

    @property
    def vocab_size(self) -> int:
        return 3

    @staticmethod
    def legal_next(depth: torch.Tensor, remaining: int, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(can_open, can_close)`` for a word at ``depth`` with ``remaining`` tokens still to come."""
        can_open = (depth + 1 <= remaining - 1) & (depth < max_depth)
        can_close = depth > 0
        return can_open, can_close

    def check_length(self, seq_len: int) -> None:
        if seq_len < 2 or seq_len % 2:
            raise ValueError(f"dyck1_next: seq_len must be even and >= 2, got {seq_len}")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.check_length(seq_len)
        o = self.options
        coins = torch.rand(num_examples, seq_len, generator=generator) < o.p_open
        inputs = torch.empty(num_examples, seq_len, dtype=torch.long)
        labels = torch.full_like(inputs, IGNORE)
        depth = torch.zeros(num_examples, dtype=torch.long)
        for t in range(seq_len):
            can_open, can_close = self.legal_next(depth, seq_len - t, o.max_depth)
            opens = can_open & (coins[:, t] | ~can_close)
            inputs[:, t] = torch.where(opens, OPEN, CLOSE)
            depth = depth + torch.where(opens, 1, -1)
            if t < seq_len - 1:
                nxt_open, nxt_close = self.legal_next(depth, seq_len - t - 1, o.max_depth)
                labels[:, t] = torch.where(nxt_open & nxt_close, EITHER, torch.where(nxt_open, OPEN, CLOSE))
        return TaskData(inputs, labels)


@register_task
class MADRecall(Task):
    name = "mad_recall"
    description = "MAD-style in-context recall: a stream of k v pairs from a per-sequence map; predict repeated keys' values"

    @dataclass
    class Options:
        vocab_size: int = opt(16, "V: keys [0, V/2), values [V/2, V)", at_least=2, at_most=1 << 24)
        seq_len: int = opt(64, "training sequence length L (even)", at_least=1, at_most=1 << 22)
        num_train: int = opt(20_000, "training examples", at_least=1, at_most=10_000_000)
        num_test: int = opt(1_000, "test examples", at_least=1, at_most=10_000_000)

        def __post_init__(self):
            if self.vocab_size < 4 or self.vocab_size % 2:
                raise ValueError(f"mad_recall: vocab_size must be even and >= 4, got {self.vocab_size}")
            if self.seq_len < 4 or self.seq_len % 2:
                raise ValueError(f"mad_recall: seq_len must be even and >= 4 (pairs), got {self.seq_len}")

    @property
    def vocab_size(self) -> int:
        return self.options.vocab_size

    def check_length(self, seq_len: int) -> None:
        if seq_len < 4 or seq_len % 2:
            raise ValueError(f"mad_recall: seq_len must be even and >= 4, got {seq_len}")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.check_length(seq_len)
        half, n = self.options.vocab_size // 2, seq_len // 2
        table = torch.randint(half, (num_examples, half), generator=generator) + half
        keys = torch.randint(half, (num_examples, n), generator=generator)
        values = table.gather(1, keys)
        inputs = torch.stack([keys, values], dim=2).flatten(1)
        seen = torch.zeros(num_examples, half, dtype=torch.bool)
        repeated = torch.empty(num_examples, n, dtype=torch.bool)
        for i in range(n):
            repeated[:, i] = seen.gather(1, keys[:, i:i + 1])[:, 0]
            seen.scatter_(1, keys[:, i:i + 1], True)
        labels = torch.full_like(inputs, IGNORE)
        labels[:, 0::2] = torch.where(repeated, values, IGNORE)
        return TaskData(inputs, labels)
