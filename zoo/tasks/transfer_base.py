"""Shared vocabulary, options and row assembly of the transfer-retrieval tasks.

The transfer benchmark of Echo (Sridhar & Johansen, "Echo: KV-Cache-Free Associative Recall with
Spectral Koopman Operators", arXiv 2605.06997, section 4.1 and Table 3) trains a model once on a mix of
system-prompt and tool-trace sequences and evaluates it zero-shot on five retrieval tasks. Zero-shot
evaluation only makes sense if every task speaks the same vocabulary, so all of them share one token
layout (``V = vocab_size``, ``n = V - 4``)::

    0 pad (unused)   1 Q (query marker)   2, 3 reserved
    keys    [4, 4 + 3n/8)            names, variables, agents, tools
    values  [4 + 3n/8, 4 + 6n/8)     what a fact binds a key to
    filler  [4 + 6n/8, V)            distractor tokens (scratchpad, tool output, haystack)

Every sequence has the same three parts: **facts** (the key-value bindings, where the task puts them),
**distractors** (filler tokens filling the rest of the length) and **queries** at the end, each
``Q <key ...> <answer>``. The label sits at the last key token of a query (the next token is the
answer, fed in as input after it, as in ``?Agent:Tool=Result``); every other label is -100. The mask
(``TaskData.mask``, SKA's prefix / action mask) is 1 exactly on the fact tokens, like MQAR's mask on
its key-value context (``mask: facts``, the default: the generator tells where the facts are); with
``mask: body`` it is 1 on every token before the queries, facts and distractors alike, the prefix over
which Echo's prefix mode accumulates its statistics (section 3.2.2), so that nothing but the layout of a
sequence (context, then queries) marks it.

The paper names the tasks and their fact/distractor/query structure but not their token layouts, the
number of queries or the vocabulary; those are our choices, documented in each task's docstring and
kept as options. Generation runs row by row with NumPy (the layouts vary per row), seeded from the
torch generator that :meth:`Task.make` derives from the recipe seed, split and length.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from mixers.options import opt

from .base import Task, TaskData

IGNORE = -100
QUERY = 1
NUM_SPECIAL = 4
#: what the mask of a transfer task marks (see the module docstring)
MASKS = ("facts", "body")


@dataclass
class Vocab:
    """The id ranges of one vocabulary size (see the module docstring)."""
    size: int

    @property
    def keys(self) -> tuple[int, int]:
        n = self.size - NUM_SPECIAL
        return NUM_SPECIAL, NUM_SPECIAL + 3 * n // 8

    @property
    def values(self) -> tuple[int, int]:
        n = self.size - NUM_SPECIAL
        return NUM_SPECIAL + 3 * n // 8, NUM_SPECIAL + 6 * n // 8

    @property
    def filler(self) -> tuple[int, int]:
        return self.values[1], self.size


@dataclass
class TransferOptions:
    """Options every transfer task has (a recipe's ``eval.tasks`` entry inherits them from the training
    task when it leaves them out)."""
    vocab_size: int = opt(128, "vocabulary size V shared by all transfer tasks (keys, values, filler; see "
                               "zoo/tasks/transfer_base.py)", at_least=32, at_most=1 << 20)
    seq_len: int = opt(64, "training sequence length", at_least=8, at_most=1 << 22)
    num_kv_pairs: int = opt(4, "facts per sequence (the most, when min_kv_pairs is set)", at_least=1)
    min_kv_pairs: int = opt(0, "if > 0, each sequence draws its number of facts uniformly from "
                               "[min_kv_pairs, num_kv_pairs]; 0 = always num_kv_pairs", at_least=0)
    num_queries: int = opt(2, "queries per sequence, each on a different fact (capped by the facts; "
                              "0 = one per fact)", at_least=0)
    num_train: int = opt(10_000, "training examples", at_least=1, at_most=10_000_000)
    num_test: int = opt(300, "test examples", at_least=1, at_most=10_000_000)
    mask: str = opt("facts", "which tokens the mask marks: facts (exactly the fact tokens) or body (every token "
                             "before the queries, distractors included)", choices=MASKS, omit_at_default=True)

    def __post_init__(self):
        if self.min_kv_pairs > self.num_kv_pairs:
            raise ValueError(f"min_kv_pairs ({self.min_kv_pairs}) must be <= num_kv_pairs ({self.num_kv_pairs}); "
                             f"lower min_kv_pairs or set it to 0 for a fixed count")
        vocab = Vocab(self.vocab_size)
        if self.keys_needed() > vocab.keys[1] - vocab.keys[0]:
            least = max(32, NUM_SPECIAL + -(-8 * self.keys_needed() // 3))  # the smallest V with 3 (V - 4) // 8 keys
            raise ValueError(f"vocab_size {self.vocab_size} has {vocab.keys[1] - vocab.keys[0]} key ids but "
                             f"{self.keys_needed()} distinct keys are needed ({self.keys_for()}); raise vocab_size to "
                             f"at least {least} or lower {self.key_knobs()}")
        if self.values_needed() > vocab.values[1] - vocab.values[0]:
            raise ValueError(f"vocab_size {self.vocab_size} has {vocab.values[1] - vocab.values[0]} value ids but "
                             f"{self.values_needed()} distinct values are needed; raise vocab_size or lower "
                             f"num_kv_pairs")
        if self.min_seq_len() > self.seq_len:
            raise ValueError(f"seq_len {self.seq_len} is shorter than the {self.min_seq_len()} tokens that "
                             f"{self.num_kv_pairs} facts and their queries need; raise seq_len or lower "
                             f"num_kv_pairs / num_queries")

    def queries(self, pairs: int) -> int:
        return pairs if self.num_queries == 0 else min(self.num_queries, pairs)

    # per task: distinct ids and tokens that the most facts need
    def keys_needed(self) -> int:
        return self.num_kv_pairs

    def keys_for(self) -> str:
        """What the keys are needed for, in the options that set their number (a refusal names it)."""
        return f"num_kv_pairs {self.num_kv_pairs}"

    def key_knobs(self) -> str:
        """The options that set how many keys are needed."""
        return "num_kv_pairs"

    def values_needed(self) -> int:
        return self.num_kv_pairs

    def min_seq_len(self) -> int:
        """Tokens the most facts and their queries need; the default is ``k v`` facts and ``Q k v`` queries."""
        return 2 * self.num_kv_pairs + 3 * self.queries(self.num_kv_pairs)


class TransferTask(Task):
    """A transfer task: :meth:`rows` lays out the sequences; :meth:`generate` seeds, sizes and stacks them."""

    @property
    def vocab_size(self) -> int:
        return self.options.vocab_size

    @property
    def vocab(self) -> Vocab:
        return Vocab(self.options.vocab_size)

    @abc.abstractmethod
    def rows(self, rng: np.random.Generator, pairs: np.ndarray,
             seq_len: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """One ``(inputs, labels, mask)`` row per entry of ``pairs`` (the number of facts of each sequence)."""

    def pair_counts(self, rng: np.random.Generator, num_examples: int) -> np.ndarray:
        o = self.options
        if o.min_kv_pairs:
            return rng.integers(o.min_kv_pairs, o.num_kv_pairs + 1, size=num_examples)
        return np.full(num_examples, o.num_kv_pairs)

    def check_length(self, seq_len: int) -> None:
        need = self.options.min_seq_len()
        if seq_len < need:
            raise ValueError(f"{self.name}: seq_len {seq_len} is too short for {self.options.num_kv_pairs} facts "
                             f"and their queries (needs >= {need})")

    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        self.check_length(seq_len)
        rng = np.random.default_rng(int(torch.randint(1 << 62, (1,), generator=generator)))
        rows = self.rows(rng, self.pair_counts(rng, num_examples), seq_len)
        if self.options.mask == "body":
            rows = [(inputs, labels, body_mask(inputs)) for inputs, labels, _ in rows]
        return stack(rows)


class OneLayoutTask(TransferTask):
    """A transfer task whose sequences all follow one layout, written by :meth:`row`."""

    @abc.abstractmethod
    def row(self, rng: np.random.Generator, pairs: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(inputs, labels, mask)`` of one sequence with ``pairs`` facts."""

    def rows(self, rng, pairs, seq_len):
        return [self.row(rng, int(p), seq_len) for p in pairs]

    # --- helpers for rows --------------------------------------------------------------------------
    def draw(self, rng: np.random.Generator, which: str, count: int) -> np.ndarray:
        """``count`` distinct ids of the ``keys`` or ``values`` range."""
        lo, hi = getattr(self.vocab, which)
        return rng.choice(np.arange(lo, hi), size=count, replace=False)

    def filler(self, rng: np.random.Generator, count: int) -> np.ndarray:
        lo, hi = self.vocab.filler
        return rng.integers(lo, hi, size=count)

    def facts_first(self, rng: np.random.Generator, facts: np.ndarray, query_tokens: np.ndarray,
                    query_labels: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One row: the ``facts`` (masked in) open it, filler runs up to the queries at its end."""
        gap = seq_len - len(facts) - len(query_tokens)
        body = np.concatenate([facts, self.filler(rng, gap)])
        mask = np.concatenate([np.ones(len(facts)), np.zeros(gap)])
        return assemble(body, mask, query_tokens, query_labels)


def queries_block(keys: list[np.ndarray], answers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Q <key tokens> <answer>`` per query; labels the last key token with the answer."""
    tokens, labels = [], []
    for key, answer in zip(keys, answers):
        key = np.atleast_1d(key)
        tokens += [QUERY, *key.tolist(), int(answer)]
        labels += [IGNORE] * len(key) + [int(answer), IGNORE]
    return np.array(tokens, dtype=np.int64), np.array(labels, dtype=np.int64)


def assemble(body: np.ndarray, body_mask: np.ndarray, query_tokens: np.ndarray,
             query_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Facts and distractors (``body``, its mask), then the queries: one full row."""
    inputs = np.concatenate([body, query_tokens])
    labels = np.concatenate([np.full(len(body), IGNORE, dtype=np.int64), query_labels])
    mask = np.concatenate([body_mask, np.zeros(len(query_tokens))])
    return inputs, labels, mask


def body_mask(inputs: np.ndarray) -> np.ndarray:
    """1 on every token before the first query marker (the body: facts and distractors), 0 from it on."""
    first = int(np.argmax(inputs == QUERY))  # every row ends with its queries, and no body token is QUERY
    return (np.arange(len(inputs)) < first).astype(np.float64)


def stack(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> TaskData:
    inputs = torch.from_numpy(np.stack([r[0] for r in rows])).long()
    labels = torch.from_numpy(np.stack([r[1] for r in rows])).long()
    mask = torch.from_numpy(np.stack([r[2] for r in rows])).float()
    return TaskData(inputs, labels, mask)
