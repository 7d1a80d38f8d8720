"""The defective-Jordan SSM ("The Illusion of State", OpenReview 8Kg8lL3L58) against its recurrence written out
with materialised matrices, in the modes the existing checks leave to the parallel-equals-recurrent comparison:
a learned coupling ``c`` away from 0 and 1 (``A_t = lam_t I + c N``, ``(N h)_i = h_{i+1}``), the readout norm
``y_t = C LN(h_t)``, and a learned dense HiPPO block; outputs and the gradients of every parameter, fp64, on the
chunked path with a chunk that does not divide the length."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixers import build_mixer

F64 = torch.float64


def _loop(mixer, x):
    """``h_t = A_t h_{t-1} + B x_t``, ``y_t = C h_t`` (or ``C LN(h_t)``), every matrix built here."""
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
