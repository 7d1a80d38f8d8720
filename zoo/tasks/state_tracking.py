"""State-tracking task generators: parity, permutation-group word problems (S3, S5, A5) and Dyck-1.

Pure functions ``fn(num_examples, seq_len, generator, **options) -> (inputs, labels)``, both
``LongTensor (N, T)``; ``labels`` is ``-100`` where nothing is supervised. One token space covers
inputs and labels (the zoo's models have a tied LM head): :func:`vocab_size` gives its size.

- ``parity``: inputs are bits ``{0, 1}``; the label at position t is the parity of ``x_1..x_t``.
- ``s3`` / ``s5`` / ``a5`` word problems: inputs are group elements as token ids; the label at t is
  the id of the running product ``P_t``. Elements are permutations of ``{0..n-1}`` stored as tuples
  ``p`` (``p[i]`` = image of ``i``); ids enumerate them in lexicographic order
  (``itertools.permutations``; for A5 the even ones, in lexicographic order). **Multiplication
  order:** ``P_t = x_t o P_{t-1}`` as functions, i.e. ``P_t(i) = x_t(P_{t-1}(i))``: apply ``x_1``
  first, then ``x_2``, ..., then ``x_t``; ``P_0`` is the identity, so the label at position 1 is
  ``x_1``. In tuples: ``compose(p, x)[i] = x[p[i]]``.
- ``dyck1``: inputs ``0 = '('`` and ``1 = ')'``; every sequence is a prefix of a valid Dyck-1 word
  (the depth never goes below 0; it never exceeds ``max_depth`` either). The walk opens with
  probability ``p_open`` (always at depth 0, never at ``max_depth``). Labels: ``label="depth"`` (the
  default) is the depth after the token, in ``[0, max_depth]``; ``label="balanced"`` is 1 when the
  prefix is balanced (depth 0) else 0.

Every generator takes ``supervise="all"`` (a label at every position, the default) or ``"last"``
(only the final position; -100 elsewhere).
"""
from __future__ import annotations

import functools
import itertools

import torch

IGNORE = -100


# --------------------------------------------------------------------------------------------------
# permutation groups
# --------------------------------------------------------------------------------------------------
def compose(p: tuple, x: tuple) -> tuple:
    """Apply ``p`` first, then ``x``: ``(x o p)(i) = x[p[i]]``."""
    return tuple(x[p[i]] for i in range(len(p)))


def is_even(p: tuple) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


@functools.lru_cache(maxsize=None)
def group_elements(group: str) -> tuple[tuple, ...]:
    """The elements of ``"s3"``, ``"s4"``, ``"s5"``, ``"a4"`` or ``"a5"`` in token-id order."""
    kind, n = group[0], int(group[1:])
    if kind not in "sa" or n < 2:
        raise ValueError(f"unknown group {group!r}; use s<n> or a<n>, e.g. 's3', 's5', 'a5'")
    perms = list(itertools.permutations(range(n)))      # lexicographic
    if kind == "a":
        perms = [p for p in perms if is_even(p)]
    return tuple(perms)


@functools.lru_cache(maxsize=None)
def multiplication_table(group: str) -> torch.Tensor:
    """``table[a, b]`` = id of ``compose(elem[a], elem[b])`` (apply a, then b), built explicitly."""
    elems = group_elements(group)
    index = {p: i for i, p in enumerate(elems)}
    table = torch.empty(len(elems), len(elems), dtype=torch.long)
    for a, pa in enumerate(elems):
        for b, pb in enumerate(elems):
            table[a, b] = index[compose(pa, pb)]
    return table


def identity_id(group: str) -> int:
    return group_elements(group).index(tuple(range(int(group[1:]))))


def _supervise(labels: torch.Tensor, supervise: str) -> torch.Tensor:
    if supervise == "all":
        return labels
    if supervise == "last":
        out = torch.full_like(labels, IGNORE)
        out[:, -1] = labels[:, -1]
        return out
    raise ValueError(f"supervise must be 'all' or 'last', got {supervise!r}")


def _check(num_examples: int, seq_len: int) -> None:
    if num_examples < 0 or seq_len < 1:
        raise ValueError(f"need num_examples >= 0 and seq_len >= 1, got {num_examples}, {seq_len}")


def word_problem(num_examples: int, seq_len: int, generator: torch.Generator, group: str = "s3",
                 supervise: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random words over ``group``; label = id of the running product (see module docstring)."""
    _check(num_examples, seq_len)
    table = multiplication_table(group)
    inputs = torch.randint(0, table.shape[0], (num_examples, seq_len), generator=generator)
    labels = torch.empty_like(inputs)
    state = torch.full((num_examples,), identity_id(group), dtype=torch.long)
    for t in range(seq_len):
        state = table[state, inputs[:, t]]
        labels[:, t] = state
    return inputs, _supervise(labels, supervise)


def s3(num_examples, seq_len, generator, supervise="all"):
    """S3 word problem (6 elements; non-abelian, solvable)."""
    return word_problem(num_examples, seq_len, generator, "s3", supervise)


def s5(num_examples, seq_len, generator, supervise="all"):
    """S5 word problem (120 elements; not solvable: NC1-complete)."""
    return word_problem(num_examples, seq_len, generator, "s5", supervise)


def a5(num_examples, seq_len, generator, supervise="all"):
    """A5 word problem (60 even permutations of 5; the smallest non-solvable group)."""
    return word_problem(num_examples, seq_len, generator, "a5", supervise)


# --------------------------------------------------------------------------------------------------
# parity and Dyck-1
# --------------------------------------------------------------------------------------------------
def parity(num_examples: int, seq_len: int, generator: torch.Generator, p_one: float = 0.5,
           supervise: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Bits with P(1) = ``p_one``; label at t = (x_1 + ... + x_t) mod 2."""
    _check(num_examples, seq_len)
    if not 0.0 <= p_one <= 1.0:
        raise ValueError(f"p_one must be in [0, 1], got {p_one}")
    inputs = (torch.rand(num_examples, seq_len, generator=generator) < p_one).long()
    labels = inputs.cumsum(dim=1) % 2
    return inputs, _supervise(labels, supervise)


OPEN, CLOSE = 0, 1


def dyck1(num_examples: int, seq_len: int, generator: torch.Generator, p_open: float = 0.5,
          max_depth: int = 16, label: str = "depth", supervise: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Prefixes of Dyck-1 words (0 = '(', 1 = ')'), depth kept in [0, max_depth]; see the module docstring."""
    _check(num_examples, seq_len)
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if label not in ("depth", "balanced"):
        raise ValueError(f"label must be 'depth' or 'balanced', got {label!r}")
    coins = torch.rand(num_examples, seq_len, generator=generator) < p_open
    inputs = torch.empty(num_examples, seq_len, dtype=torch.long)
    depths = torch.empty_like(inputs)
    depth = torch.zeros(num_examples, dtype=torch.long)
    for t in range(seq_len):
        opens = (coins[:, t] | (depth == 0)) & (depth < max_depth)
        inputs[:, t] = torch.where(opens, OPEN, CLOSE)
        depth = depth + torch.where(opens, 1, -1)
        depths[:, t] = depth
    labels = depths if label == "depth" else (depths == 0).long()
    return inputs, _supervise(labels, supervise)


# --------------------------------------------------------------------------------------------------
# token spaces
# --------------------------------------------------------------------------------------------------
def dyck1_vocab_size(max_depth: int = 16, label: str = "depth") -> int:
    """Token ids of :func:`dyck1` with these options (``max(input, label) + 1``)."""
    return 2 if label == "balanced" else max(2, max_depth + 1)
