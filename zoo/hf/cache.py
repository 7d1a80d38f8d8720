"""The decode cache of an exported zoo model: every layer's recurrent state, as its mixer defines it.

A :class:`ZooCache` is a ``transformers`` ``Cache`` whose layers are the zoo mixers' own decode states (a
``dict`` of tensors per layer, batch first: the fixed-size state of a linear mixer, attention's growing
KV cache, a short convolution's last inputs) plus the number of tokens they have consumed. The model
fills it with ``prefill`` on a prompt and advances it with ``step`` one token at a time, so ``generate``
decodes a linear-state model in constant time and memory per token.

What a KV cache allows and a recurrent state does not: rolling back (``crop``, which assisted decoding
needs) is refused with one line; reordering and repeating along the batch (beam search, several returned
sequences) work on every state.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

State = dict[str, torch.Tensor]


class ZooCache(Cache):
    """Per-layer decode states of a zoo model and the number of tokens they have consumed."""

    def __init__(self):
        super().__init__(layers=[])  # the states live in ``self.states``; the base class's layers stay empty
        self.states: list[State] = []
        self.seen = 0

    def __repr__(self):
        return f"ZooCache({len(self.states)} layers, {self.seen} tokens, {self.state_elements()} state elements)"

    def __len__(self):
        return len(self.states)

    def state_elements(self) -> int:
        """Elements held over every layer and sequence (constant in the length for linear-state mixers)."""
        return sum(t.numel() for state in self.states for t in state.values())

    # --- what generate reads ------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length + self.seen, 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.seen > 0

    @property
    def batch_size(self) -> int:
        return next(iter(self.states[0].values())).shape[0] if self.states else -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.states)

    # the cache counts the tokens it has consumed, so generate slices new inputs by get_seq_length as it does
    # for a KV cache: no layer is reported as a length-less linear layer
    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.states)

    # --- batch edits ----------------------------------------------------------------------------------
    def _map(self, fn) -> None:
        self.states = [{k: fn(v) for k, v in state.items()} for state in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda v: v.index_select(0, beam_idx.to(v.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda v: v.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda v: v[indices])

    def reset(self) -> None:
        self.states, self.seen = [], 0

    # --- what a recurrent state cannot do ---------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("ZooCache: a recurrent state cannot be rolled back by tokens (assisted decoding and "
                             "other rollbacks need a KV cache); decode without an assistant model")

    def activate_past_recording(self):
        raise ValueError("ZooCache: a recurrent state keeps no past to roll back to; decode without an assistant model")

    def early_initialization(self, *args, **kwargs) -> None:
        """Nothing to allocate ahead: ``prefill`` returns each layer's state."""

    def update(self, *args, **kwargs):
        raise NotImplementedError("ZooCache holds the zoo mixers' own states; key/value updates of other models do "
                                  "not apply to it")
