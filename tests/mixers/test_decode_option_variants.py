"""``prefill`` then ``step`` token by token equals ``forward`` for the options that change a mixer's decode state
and that its ``contract_options`` (the only options the contract's decode checks build) leave at one value: grouped
KV heads, short convolutions off or one tap wide, n_h Householder steps, every GKA solver and a test-time
``num_iter``, SKA's key lifts and power 0, Jordan's state norms and fixed/HiPPO blocks, the slot memory's shifted
write address, position address and sparse layout, Mamba-2 without its convolution, BD-LRU's diagonal blocks.

Each variant runs in fp64 on a batch of three at lengths that are no multiple of its chunk size (1, chunk - 1,
chunk + 1, 2 chunks + 3), split at 0, 1, the middle and the end."""
from __future__ import annotations

import pytest
import torch

from mixers import build_mixer

from .contract import D_MODEL, rel, unzero

CHUNK = 8

#: (mixer, options, test-time knobs) beyond the contract's options; every chunked one uses chunk_size CHUNK
VARIANTS = [
    ("attention", {"n_heads": 4, "n_kv_heads": 2}, None),
    ("attention", {"n_heads": 4, "n_kv_heads": 1, "backend": "reference"}, None),
    ("attention", {"n_heads": 2, "head_dim": 6, "rope_base": 50.0}, None),
    ("mamba2", {"d_state": 8, "headdim": 16, "d_conv": 1}, None),
    ("mamba2", {"d_state": 4, "headdim": 8, "d_conv": 2, "expand": 1}, None),
    ("mamba2", {"d_state": 4, "headdim": 8, "norm_before_gate": False}, None),
    ("deltanet", {"n_heads": 2, "head_dim": 8, "use_short_conv": False}, None),
    ("deltanet", {"n_heads": 2, "head_dim": 8, "conv_size": 1, "allow_neg_eigval": False}, None),
    ("gated_deltanet", {"n_heads": 2, "head_dim": 8, "num_householder": 3, "conv_size": 2}, None),
    ("deltaproduct", {"n_heads": 2, "head_dim": 8, "num_householder": 3}, None),
    ("deltaproduct", {"n_heads": 2, "head_dim": 8, "num_householder": 4, "use_short_conv": False,
                      "use_forget_gate": False}, None),
    ("deltaproduct", {"n_heads": 3, "head_dim": 5, "num_householder": 2, "backend": "reference"}, None),
    ("gka", {"n_heads": 2, "head_dim": 8, "conv_size": 1}, None),
    ("gka", {"n_heads": 2, "head_dim": 8, "solver": "exact"}, None),
    ("gka", {"n_heads": 2, "head_dim": 8, "solver": "cg"}, None),
    ("gka", {"n_heads": 2, "head_dim": 8, "alpha_connection": False, "beta_gate": False, "forget_gate": False}, None),
    ("gka", {"n_heads": 2, "head_dim": 8}, {"num_iter": 3}),
    ("gla", {"n_heads": 2, "head_dim": 8, "conv_size": 1, "beta_gate": False, "forget_gate": False}, None),
    ("bdlru", {"n_blocks": 4, "block_size": 1}, None),
    ("bdlru", {"n_blocks": 2, "block_size": 5, "selective": False}, None),
    ("jordan", {"block_size": 4, "n_blocks": 4, "state_norm": "step"}, None),
    ("jordan", {"block_size": 4, "n_blocks": 4, "state_norm": "readout", "decay": "fixed", "init": "diagonal"}, None),
    ("jordan", {"block_size": 3, "n_blocks": 2, "decay": "fixed", "init": "hippo"}, None),
    ("kronecker_slots", {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "conv_size": 1}, None),
    ("kronecker_slots", {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "shift_write_address": True,
                         "tie_addresses": True}, None),
    ("kronecker_slots", {"n_heads": 2, "d_v": 8, "d_p": 4, "U": 2, "top_k": 3, "pos_address": True}, None),
    ("kronecker_slots", {"n_heads": 2, "d_v": 8, "d_p": 3, "U": 2, "top_k": 9, "memory_layout": "sparse",
                         "renormalize": False}, None),
    ("ska", {"n_heads": 2, "rank": 4, "chunk_size": 1, "normalisation": "running_max", "ridge": 0.1,
             "key_lift": "cg", "value_dim": 5}, None),
    ("ska", {"n_heads": 2, "rank": 4, "chunk_size": 1, "normalisation": "running_max", "ridge": 0.1}, {"power": 0}),
]


def _build(name, options, knobs):
    full = {"chunk_size": CHUNK, **options} if name not in ("attention", "ska") else dict(options)
    m = unzero(build_mixer(name, D_MODEL, full).double()).eval()
    with torch.no_grad():  # zero-initialised maps that only an option switches on would compare 0 with 0
        for pname, p in m.named_parameters():
            if "pos" in pname and p.abs().sum() == 0:
                p.normal_(0, 0.3)
    if knobs:
        m.set_test_time(knobs)
    return m


@pytest.mark.parametrize("name,options,knobs", VARIANTS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in {**o, **(k or {})}.items())}"
                              for n, o, k in VARIANTS])
def test_prefill_then_step_equals_forward_under_a_state_changing_option(name, options, knobs):
    m = _build(name, options, knobs)
    for T in (1, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 3):
        x = torch.randn(3, T, D_MODEL, dtype=torch.float64)
        with torch.no_grad():
            y = m(x)
            for split in sorted({0, 1, T // 2, T}):
                y_pre, state = m.prefill(x[:, :split])
                assert sum(v.numel() for v in state.values()) == 3 * m.state_size(split), (name, options, split)
                ys = [y_pre]
                for t in range(split, T):
                    y_t, state = m.step(x[:, t], state)
                    ys.append(y_t[:, None])
                err = rel(torch.cat(ys, 1), y)
                assert err < 1e-9, f"{name} {options} {knobs}: T={T}, prefill of {split} then steps: rel err {err:.2e}"
