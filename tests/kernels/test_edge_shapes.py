"""Inputs whose shapes disagree are refused at the public op, in one line naming the tensor, on every backend.

The Triton kernels index every tensor by the sizes of the first ones, so a tensor of the wrong shape that
reaches them is read out of its bounds (garbage or NaN outputs, an output of the wrong shape) instead of
failing. Checked here for :func:`kernels.gka.gka` (every tensor of the core and its initial state) and for the
query/key heads :func:`kernels.gla.gla` takes (one per value head, or one shared by all). Causal attention
with more queries than keys, whose first queries precede every key, is refused by every backend alike (the
explicit formula gave NaN rows, SDPA zero rows); with as many or fewer queries the backends still agree.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import attention, attention_reference
from kernels.gka import gka
from kernels.gla import gla
from tests.kernels.harness import assert_rel_close, needs_triton

B, T, H, K, V = 2, 5, 2, 8, 6

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]


def _gka_inputs():
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H), alpha=torch.rand(B, T, H), H0=torch.zeros(B, H, K, K),
                U0=torch.randn(B, H, V, K))


#: (tensor, wrong shape, the dimension the message names)
GKA_MISMATCHES = [
    ("k", (B, T, 1, K), "H = 2"),
    ("v", (B, T - 1, H, V), "T = 5"),
    ("v", (1, T, H, V), "B = 2"),
    ("g", (B, T, 1), "H = 2"),
    ("alpha", (B, T, 1), "H = 2"),
    ("U0", (B, H, V, K + 1), "K = 8"),
    ("H0", (B, H, K, V), "K = 8"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,shape,says", GKA_MISMATCHES)
def test_gka_names_the_mismatched_tensor(backend, name, shape, says):
    x = _gka_inputs()
    x[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"gka: {name} of shape .*{says}"):
        gka(x["q"], x["k"], x["v"], x["g"], x["alpha"], num_iter=3, chunk_size=16,
            initial_state=(x["H0"], x["U0"]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gka_refuses_an_initial_state_that_is_not_a_pair(backend):
    x = _gka_inputs()
    with pytest.raises(ValueError, match="initial_state must be a pair"):
        gka(x["q"], x["k"], x["v"], x["g"], x["alpha"], num_iter=3, chunk_size=16, initial_state=x["U0"],
            backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_query_key_heads_one_per_value_head_or_one_shared(backend):
    """Two query/key heads for four value heads divide evenly but no backend has a grouping for them: refused up
    front, saying what is taken."""
    q, k = torch.randn(1, T, 2, K), torch.randn(1, T, 2, K)
    v, g = torch.randn(1, T, 4, V), -torch.rand(1, T, 4)
    with pytest.raises(ValueError, match="one head per value head"):
        gla(q, k, v, g, chunk_size=16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_attention_with_more_queries_than_keys_is_refused(backend):
    q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        attention(q, k, v, causal=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_q", [1, 3])
def test_causal_attention_with_fewer_queries_than_keys_matches_the_formula(backend, n_q):
    q, k, v = torch.randn(2, n_q, 2, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)
    expected = attention_reference(q.double(), k.double(), v.double(), causal=True)
    assert_rel_close(attention(q, k, v, causal=True, backend=backend), expected, 1e-5, backend)
