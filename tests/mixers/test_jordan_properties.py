"""The defective-Jordan SSM ("The Illusion of State", OpenReview 8Kg8lL3L58) against its recurrence written out
with materialised matrices, in the modes the existing checks leave to the parallel-equals-recurrent comparison:
a learned coupling ``c`` away from 0 and 1 (``A_t = lam_t I + c N``, ``(N h)_i = h_{i+1}``), the readout norm
``y_t = C LN(h_t)``, and a learned dense HiPPO block; outputs and the gradients of every parameter, fp64, on the
chunked path with a chunk that does not divide the length; and the LayerNorm's ``norm_eps`` in both norm modes,
forward and decode, which the checks at the default epsilon could not tell from it; the refusal of a block norm
over one component in both norm modes, and the default number of blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

F64 = torch.float64


def _loop(mixer, x):
    """``h_t = A_t h_{t-1} + B x_t`` (or ``LN`` of it), ``y_t = C h_t`` (or ``C LN(h_t)``), every matrix built
    here."""
    o, m, N = mixer.options, mixer.m, mixer.N
    eye, shift = torch.eye(m, dtype=F64), torch.diag(torch.ones(m - 1, dtype=F64), 1)
    h, ys = torch.zeros(x.shape[0], N, m, dtype=F64), []
    for t in range(x.shape[1]):
        xt = x[:, t]
        if o.decay == "selective":
            gate = mixer.gate
            lam = torch.exp(-gate.A_log.exp() * F.softplus(xt @ gate.proj.weight.T + gate.dt_bias))
        else:
            lam = torch.full((x.shape[0], N), o.rho, dtype=F64)
        if o.init == "hippo":
            A = mixer.transition.expand(x.shape[0], N, m, m)
        else:
            A = lam[..., None, None] * eye + mixer.coupling[:, None, None] * shift
        h = torch.einsum("bnij,bnj->bni", A, h) + (xt @ mixer.in_proj.weight.T).view(-1, N, m)
        if o.state_norm == "step":       # the paper's LayerNorm of the state at every step
            h = F.layer_norm(h, (m,), eps=o.norm_eps) * mixer.norm_weight + mixer.norm_bias
        read = h
        if o.state_norm == "readout":
            read = F.layer_norm(h, (m,), eps=o.norm_eps) * mixer.norm_weight + mixer.norm_bias
        ys.append(read.flatten(1) @ mixer.out_proj.weight.T)
    return torch.stack(ys, 1)


MODES = [
    {"decay": "selective", "init": "defective", "state_norm": "none"},
    {"decay": "fixed", "init": "defective", "state_norm": "readout"},
    {"decay": "selective", "init": "diagonal", "state_norm": "readout"},
    {"decay": "fixed", "init": "hippo", "state_norm": "none"},
    {"decay": "fixed", "init": "hippo", "state_norm": "readout"},
]


@pytest.mark.parametrize("mode", MODES, ids=lambda o: "-".join(o.values()))
def test_outputs_and_gradients_follow_the_materialised_recurrence(mode):
    N, m, d = 2, int(torch.randint(2, 5, ())), 7
    T = int(torch.randint(9, 20, ()))
    mixer = build_mixer("jordan", d, {"block_size": m, "n_blocks": N, "rho": 0.85, "chunk_size": 4, **mode}).to(F64)
    with torch.no_grad():
        if mode["init"] == "hippo":
            mixer.transition.add_(torch.randn_like(mixer.transition) * 0.05)
        else:
            mixer.coupling.copy_(torch.rand(N, dtype=F64) * 1.5 - 0.25)
        if mode["state_norm"] == "readout":
            mixer.norm_weight.normal_(1, 0.3)
            mixer.norm_bias.normal_(0, 0.3)
    x = torch.randn(2, T, d, dtype=F64)
    up = torch.randn(2, T, d, dtype=F64)
    params = [p for p in mixer.parameters() if p.requires_grad]
    y = mixer(x)
    want = _loop(mixer, x)
    torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-10)
    got = torch.autograd.grad((y * up).sum(), params)
    exact = torch.autograd.grad((want * up).sum(), params)
    for (name, _), g, e in zip([(n, p) for n, p in mixer.named_parameters() if p.requires_grad], got, exact):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-10, msg=lambda s, n=name: f"d{n}: {s}")


def test_a_fixed_transition_is_a_buffer_and_keeps_its_init():
    mixer = build_mixer("jordan", 8, {"block_size": 4, "decay": "fixed", "init": "defective",
                                      "learn_transition": False}).to(F64)
    names = {n for n, _ in mixer.named_parameters()}
    assert "coupling" not in names and torch.equal(mixer.coupling, torch.ones(2, dtype=F64))
    x = torch.randn(1, 6, 8, dtype=F64)
    torch.testing.assert_close(mixer(x), _loop(mixer, x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode", [{"decay": "fixed", "init": "defective", "state_norm": "readout"},
                                  {"decay": "selective", "init": "defective", "state_norm": "step"}],
                         ids=lambda o: o["state_norm"])
def test_norm_eps_is_the_layer_norms_epsilon(mode):
    """An epsilon drawn from 0.05..1, comparable to the variance of a block's components, so that reading the
    default 1e-5 instead would move the output by far more than rounding: forward, and prefill + step."""
    N, m, d, T, T0 = 2, 3, 6, 13, 7
    eps = float(torch.empty(()).uniform_(0.05, 1.0))
    mixer = build_mixer("jordan", d, {"block_size": m, "n_blocks": N, "chunk_size": 4, "norm_eps": eps, **mode})
    mixer = mixer.to(F64)
    with torch.no_grad():
        mixer.norm_weight.normal_(1, 0.3)
        mixer.norm_bias.normal_(0, 0.3)
    x = torch.randn(2, T, d, dtype=F64)
    with torch.no_grad():
        want = _loop(mixer, x)
        torch.testing.assert_close(mixer(x), want, rtol=1e-9, atol=1e-10)
        y, state = mixer.prefill(x[:, :T0])
        ys = [y]
        for t in range(T0, T):
            y_t, state = mixer.step(x[:, t], state)
            ys.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("norm", ["step", "readout"])
def test_a_block_norm_needs_two_components(norm):
    """A LayerNorm over one component maps every state to its bias: both norm modes refuse block_size 1, by name."""
    with pytest.raises(ValueError, match=f"state_norm={norm} .*block_size >= 2"):
        build_mixer("jordan", 8, {"block_size": 1, "decay": "fixed", "state_norm": norm})
    assert build_mixer("jordan", 8, {"block_size": 2, "decay": "fixed", "state_norm": norm}).N == 4


@pytest.mark.parametrize("d_model, m", [(4, 4), (10, 4), (9, 3), (7, 1)])
def test_default_number_of_blocks_fills_d_model(d_model, m):
    """Unset, n_blocks is d_model // block_size (d_model == block_size: one block), the state N m numbers."""
    mixer = build_mixer("jordan", d_model, {"block_size": m})
    assert mixer.N == d_model // m and mixer.state_size(5) == (d_model // m) * m
    _, state = mixer.prefill(torch.randn(1, 3, d_model))
    assert state["h"].shape == (1, d_model // m, m)
    with pytest.raises(ValueError, match="block_size 5 exceeds d_model 4; set n_blocks"):
        build_mixer("jordan", 4, {"block_size": 5})
    assert build_mixer("jordan", 4, {"block_size": 5, "n_blocks": 2}).N == 2
