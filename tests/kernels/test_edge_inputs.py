"""Edge inputs get one answer from every backend of an op: the same result, or the same one-line refusal.

- Shapes that disagree with an op's layout are refused at the public function, naming the tensor: SKA (the
  reference backend broadcast a one-head ``v``, the Triton kernels read a ``k`` of other heads out of its bounds),
  attention (the explicit formula and SDPA broadcast a one-head or one-batch ``k`` / ``v``, and SDPA took a ``v``
  longer than ``k``, where the Triton kernel refused them) and SSD, whose message for ``B`` / ``C`` of fewer
  groups than heads says how to spread them over the heads. The layouts every backend computes alike stay legal.
- Attention with queries but no key is refused (the explicit formula and SDPA gave zero rows, Triton refused).
- An empty sequence (T = 0) gives the empty output, and the initial state unchanged (zeros without one), from
  every op and backend; at T = 0 an op still refuses what it refuses at T > 0 (SKA returned early, before its
  backend, settings and shapes were checked).
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import attention, attention_reference
from kernels.delta import delta_rule
from kernels.gka import gka
from kernels.gla import gla
from kernels.scan import chunk_scan
from kernels.ska import ska
from kernels.ssd import ssd, ssd_reference
from tests.kernels.harness import assert_rel_close, needs_triton

BACKENDS = ["reference", "torch", pytest.param("triton", marks=needs_triton)]
B, T, H, K, V = 2, 5, 2, 8, 4


# --- shapes that disagree -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,shape,says", [("k", (B, T, 3, K), "H = 2"), ("v", (B, T, 1, V), "H = 2"),
                                             ("k", (B, T, H, K + 1), "R = 8"), ("w", (B, T, H), "3-d"),
                                             ("gamma", (3,), r"\(H,\) with H = 2")])
def test_ska_names_the_mismatched_tensor(backend, name, shape, says):
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V), w=None, gamma=1.2)
    x[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"ska: {name} .*{says}"):
        ska(x["q"], x["k"], x["v"], x["w"], gamma=x["gamma"], chunk_size=4, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ska_one_gain_for_every_head_is_still_taken(backend):
    q, v = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    one = ska(q, q, v, gamma=torch.tensor([1.3]), chunk_size=4, backend=backend)
    assert torch.equal(one, ska(q, q, v, gamma=torch.tensor([1.3, 1.3]), chunk_size=4, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,shape,says", [("k", (B, T, 1, K), "H = 2"), ("k", (1, T, H, K), "B = 2"),
                                             ("v", (B, T + 1, H, K), "S = 5"), ("q", (T, H, K), "3-d")])
def test_attention_names_the_mismatched_tensor(backend, name, shape, says):
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, K))
    x[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"attention: {name} .*{says}"):
        attention(x["q"], x["k"], x["v"], causal=False, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_attention_values_of_another_head_dim_are_still_taken(backend):
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, 2 * K)
    expected = attention_reference(q.double(), k.double(), v.double())
    assert_rel_close(attention(q, k, v, backend=backend), expected, 1e-5, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_with_queries_and_no_key_is_refused(backend):
    q, k = torch.randn(B, 3, H, K), torch.randn(B, 0, H, K)
    with pytest.raises(ValueError, match="every query needs at least one key"):
        attention(q, k, k, causal=False, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_grouped_b_says_how_to_spread_the_groups(backend, groups):
    """B of fewer groups than heads is refused with the call that spreads it; that call then runs as the reference
    of the spread tensor."""
    Hs = 4
    x, dt, A = torch.randn(B, T, Hs, V), torch.rand(B, T, Hs) * 0.5, -torch.rand(Hs) - 0.1
    Bg, C = torch.randn(B, T, groups, K), torch.randn(B, T, Hs, K)
    with pytest.raises(ValueError, match=r"ssd: B of shape .*H = 4.*pass B\.(expand|repeat_interleave)") as err:
        ssd(x, dt, A, Bg, C, chunk_size=4, backend=backend)
    spread = eval(str(err.value).rsplit("pass ", 1)[1], {"B": Bg})  # the call the message gives
    assert torch.equal(spread, Bg.repeat_interleave(Hs // groups, dim=2))
    y, h = ssd(x, dt, A, spread, C, chunk_size=4, backend=backend)
    y_ref, h_ref = ssd_reference(x.double(), dt.double(), A.double(), spread.double(), C.double())
    assert_rel_close(y, y_ref, 1e-5, backend)
    assert_rel_close(h, h_ref, 1e-5, backend)


# --- empty sequences ------------------------------------------------------------------------------------------


def _empty(*rest):
    return torch.randn(B, 0, H, *rest)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_initial", [False, True])
def test_every_op_takes_an_empty_sequence(backend, with_initial):
    q, v, g = _empty(K), _empty(V), -torch.rand(B, 0, H)
    U0 = torch.randn(B, H, V, K) if with_initial else None
    H0 = torch.randn(B, H, K, K) if with_initial else None

    def same(state, initial, shape):
        assert state.shape == shape
        assert torch.equal(state, initial) if initial is not None else not state.any()

    o, U = gla(q, q, v, g, chunk_size=16, initial_state=U0, backend=backend)
    assert o.shape == (B, 0, H, V)
    same(U, U0, (B, H, V, K))
    o, (Hs, U) = gka(q, q, v, g, torch.rand(B, 0, H), num_iter=3, chunk_size=16,
                     initial_state=None if U0 is None else (H0, U0), backend=backend)
    assert o.shape == (B, 0, H, V)
    same(Hs, H0, (B, H, K, K))
    same(U, U0, (B, H, V, K))
    S0 = None if U0 is None else U0.transpose(-1, -2).contiguous()
    o, S = delta_rule(q, q, v, torch.rand(B, 0, H), g=g, initial_state=S0, chunk_size=16, backend=backend)
    assert o.shape == (B, 0, H, V)
    same(S, S0, (B, H, K, V))
    h0 = None if U0 is None else U0.transpose(-1, -2).contiguous()
    y, h = ssd(v, g.neg(), -torch.rand(H), q, q, chunk_size=16, initial_state=h0, D=torch.randn(H), backend=backend)
    assert y.shape == (B, 0, H, V)
    same(h, h0, (B, H, K, V))
    # (values of the queries' head dim: the flash kernels take no other, empty or not)
    assert attention(q, q, q, causal=True, backend=backend).shape == (B, 0, H, K)
    assert attention(q, _empty(K), _empty(K), causal=False, backend=backend).shape == (B, 0, H, K)
    for mode in ("prefix", "chunk_causal"):
        assert ska(q, q, v, torch.ones(B, 0), mode=mode, chunk_size=4, backend=backend).shape == (B, 0, H, V)
    starts, final = chunk_scan(torch.rand(B, 0), torch.randn(B, 0, H, K, V), S0, backend=backend)
    assert starts.shape == (B, 0, H, K, V)
    same(final, S0, (B, H, K, V))


@pytest.mark.parametrize("call,match", [
    (dict(backend="nonsense"), "unknown backend"),
    (dict(mode="recurrent", backend="triton"), "not implemented"),
    (dict(normalisation="max"), "unknown normalisation"),
    (dict(k=torch.randn(B, 0, 3, K)), "ska: k of shape"),
])
def test_ska_refuses_at_t0_what_it_refuses_at_t5(call, match):
    for length in (T, 0):
        x = dict(q=torch.randn(B, length, H, K), k=torch.randn(B, length, H, K), v=torch.randn(B, length, H, V))
        kw = dict(call)
        if "k" in kw:
            x["k"] = torch.randn(B, length, 3, K)
            del kw["k"]
        with pytest.raises(Exception, match=match):
            ska(x["q"], x["k"], x["v"], chunk_size=4, **kw)
