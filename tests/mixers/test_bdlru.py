"""BD-LRU's own claims: the m = 1 case is the diagonal convex-gate recurrence, the gates are
L1-normalised rows, and the state is bounded by the inputs (arXiv:2602.12021, stability proposition)."""
import pytest
import torch

from mixers import build_mixer


def make(d_model=12, dtype=torch.float64, std=0.02, **options):
    m = build_mixer("bdlru", d_model, {"chunk_size": int(torch.randint(1, 9, (1,))), "init_std": std, **options})
    return m.to(dtype)


@pytest.mark.parametrize("selective", [True, False])
def test_m1_equals_diagonal_convex_gate_loop(selective):
    d, N = 12, 6
    mixer = make(d, std=0.5, block_size=1, n_blocks=N, selective=selective)
    if selective:
        with torch.no_grad():
            mixer.a_proj.bias.normal_()
    x = torch.randn(3, 37, d, dtype=torch.float64)
    with torch.no_grad():
        y = mixer(x)
    # independent: per channel, logits (l_A, l_0); a0 = e^{l_0} / (e^{l_A} + e^{l_0}), h = (1 - a0) h + a0 v
    Wv, Wo = mixer.v_proj.weight, mixer.out_proj.weight
    h = torch.zeros(3, N, dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        if selective:
            logits = (x[:, t] @ mixer.a_proj.weight.T + mixer.a_proj.bias).reshape(3, N, 2)
        else:
            logits = mixer.a_logits.reshape(1, N, 2).expand(3, N, 2)
        a0 = torch.sigmoid(logits[..., 1] - logits[..., 0])
        h = (1 - a0) * h + a0 * (x[:, t] @ Wv.T)
        ys.append(h @ Wo.T)
    ref = torch.stack(ys, 1).detach()
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-12), (y - ref).abs().max()


@pytest.mark.parametrize("m", [1, 2, 4])
def test_gate_rows_are_l1_normalised(m):
    mixer = make(16, std=1.0, block_size=m, n_blocks=3)
    with torch.no_grad():
        mixer.a_proj.bias.normal_(0, 3.0)
        A, a0 = mixer.gates(torch.randn(4, 9, 16, dtype=torch.float64) * 3)
    assert A.shape == (4, 9, 3, m, m) and a0.shape == (4, 9, 3, m)
    assert (A > 0).all() and (a0 > 0).all()
    assert torch.allclose(A.sum(-1) + a0, torch.ones_like(a0), atol=1e-12)
    # Gershgorin with positive rows: every eigenvalue lies in the disc of radius max_i (1 - a0_i)
    eig = torch.linalg.eigvals(A).abs()
    assert (eig <= (1 - a0).amax(-1, keepdim=True) + 1e-12).all()


@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("selective", [True, False])
def test_state_bounded_by_largest_input(m, selective):
    d = 10
    mixer = make(d, std=1.0, block_size=m, n_blocks=4, selective=selective)
    x = torch.randn(5, 33, d, dtype=torch.float64) * torch.rand(5, 33, 1, dtype=torch.float64) * 4
    v = (x @ mixer.v_proj.weight.T).detach()  # (B, T, N*m)
    with torch.no_grad():
        for T in (1, 7, 33):
            _, state = mixer.prefill(x[:, :T])
            h_inf = state["h"].flatten(1).abs().amax(1)
            bound = v[:, :T].abs().amax((1, 2))
            assert (h_inf <= bound * (1 + 1e-12)).all(), (h_inf, bound)
    # the state is not trivially zero (the check above is not vacuous)
    assert (h_inf > 0).all()


def test_m2_can_flip_sign_m1_cannot():
    # m = 1 transitions are positive reals; m = 2 can approach the swap [[0,1],[1,0]] (eigenvalue -1)
    mixer = make(4, std=0.02, block_size=2, n_blocks=1, selective=False)
    with torch.no_grad():
        mixer.a_logits.copy_(torch.tensor([[[-20.0, 20.0, -20.0], [20.0, -20.0, -20.0]]]))
        A, _ = mixer.gates(torch.zeros(1, 4, dtype=torch.float64))
    eig = torch.linalg.eigvals(A[0, 0]).real.sort().values
    assert eig[0] < -0.999
    m1 = make(4, std=3.0, block_size=1, n_blocks=4)
    A1, _ = m1.gates(torch.randn(50, 4, dtype=torch.float64) * 5)
    assert (A1 > 0).all()


def test_bad_options_raise():
    with pytest.raises(ValueError, match="block_size"):
        build_mixer("bdlru", 8, {"block_size": 0})
    with pytest.raises(ValueError, match="n_blocks"):
        build_mixer("bdlru", 2, {"block_size": 4})
