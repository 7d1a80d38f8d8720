"""The delta rule's gate is taken by name: flash-linear-attention's gated functions take ``(q, k, v, g, beta)`` and
ours ``beta`` fourth, so a positional call in either order would swap two ``(B, T, H)`` tensors; both are refused
in one line saying how to call, and the call by name computes fla's naive gated delta rule."""
import pytest
import torch
import torch.nn.functional as F

from kernels.delta import delta_product, delta_rule


def _inputs(B=1, T=9, H=2, K=8, V=4):
    q, k = (F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    beta, g = torch.rand(B, T, H, dtype=torch.float64), F.logsigmoid(torch.randn(B, T, H, dtype=torch.float64))
    return q, k, v, beta, g


@pytest.mark.parametrize("order", ["ours", "fla's"])
def test_a_gate_given_by_position_is_refused_in_either_order(order):
    q, k, v, beta, g = _inputs()
    fourth, fifth = (beta, g) if order == "ours" else (g, beta)
    with pytest.raises(TypeError, match=r"delta_rule: .*pass the gate as g=.*\(q, k, v, g, beta\)"):
        delta_rule(q, k, v, fourth, fifth, backend="torch")
    with pytest.raises(TypeError, match=r"delta_product: .*e\.g\. delta_product\(q, k, v, beta, g=g, num_householder=n\)"):
        delta_product(q, k, v, fourth, fifth, 1, backend="torch")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_the_gate_by_name_computes_fla_naive_gated_delta_rule(backend):
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    q, k, v, beta, g = _inputs()
    scale = float(torch.rand(())) + 0.1
    o, S = delta_rule(q, k, v, beta, g=g, scale=scale, chunk_size=4, backend=backend)
    o_fla, S_fla = naive.naive_recurrent_gated_delta_product(q, k, v, g, beta, scale, output_final_state=True)
    torch.testing.assert_close(o, o_fla, rtol=1e-6, atol=1e-6)   # fla computes in fp32
    torch.testing.assert_close(S, S_fla, rtol=1e-6, atol=1e-6)   # fla computes in fp32
