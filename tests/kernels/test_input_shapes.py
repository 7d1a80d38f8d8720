"""The kernels' entry points refuse inputs whose shapes disagree, naming the tensor, on every backend: the Triton
kernels index by the sizes of the first inputs, so a mismatched tensor was read out of its bounds (a wrong
answer, no error)."""
import pytest
import torch

from kernels.delta import delta_product
from kernels.gla import gla
from kernels.norm import gated_rms_norm, rms_norm
from kernels.shortconv import causal_conv

B, T, H, K, V = 1, 17, 2, 16, 16


def delta_inputs(n=1):
    q = torch.randn(B, T, H, K)
    return dict(q=q, k=torch.randn(B, T * n, H, K), v=torch.randn(B, T * n, H, V), beta=torch.rand(B, T * n, H),
                g=-torch.rand(B, T, H), initial_state=torch.randn(B, H, K, V))


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("name,shape,says", [
    ("k", (B, T, H, 20), "k of shape (1, 17, 2, 20) must be (B, TN, H, K) with K = 16"),
    ("beta", (B, T, 3), "beta of shape (1, 17, 3) must be (B, TN, H) with H = 2"),
    ("initial_state", (2, H, K, V), "initial_state of shape (2, 2, 16, 16) must be (B, H, K, V) with B = 1"),
    ("g", (B, T + 1, H), "g of shape (1, 18, 2) must be (B, T, H) with T = 17"),
    ("v", (B, T, H), "v must be (B, TN, H, V), got a 3-d tensor"),
])
def test_delta_product_names_the_mismatched_tensor(backend, name, shape, says):
    ins = delta_inputs()
    ins[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=f"delta_product: {__import__('re').escape(says)}"):
        delta_product(**ins, backend=backend)


def test_delta_product_counts_the_sub_steps():
    ins = delta_inputs(n=2)
    delta_product(**ins, num_householder=2, backend="torch")        # T*n_h rows, or (B, T, n_h, H, ...) below
    delta_product(**{**ins, "k": ins["k"].view(B, T, 2, H, K)}, num_householder=2, backend="torch")
    with pytest.raises(ValueError, match=r"must hold T\*n_h = 17\*3"):
        delta_product(**ins, num_householder=3, backend="torch")
    with pytest.raises(ValueError, match=r"beta of shape \(1, 32, 2\) must be \(B, TN, H\) with TN = 34"):
        delta_product(**{**ins, "beta": ins["beta"][:, :-2]}, num_householder=2, backend="torch")
    # k per token; v and beta both two rows short
    with pytest.raises(ValueError, match=r"v \(1, 32, 2, 16\) and beta \(1, 32, 2\) must hold T\*n_h = 17\*2"):
        delta_product(**{**ins, "k": ins["k"].view(B, T, 2, H, K), "v": ins["v"][:, :-2], "beta": ins["beta"][:, :-2]},
                      num_householder=2, backend="torch")


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("name,shape", [("k", (B, T, H, 18)), ("g", (B, T, H + 1)), ("g", (B, T, H, 1)),
                                        ("v", (B, T + 2, H, V)), ("initial_state", (B, H, K + 1, V))])
def test_gla_names_the_mismatched_tensor(backend, name, shape):
    ins = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V), g=-torch.rand(B, T, H),
               initial_state=torch.randn(B, H, V, K))
    gla(**ins, backend=backend)
    ins[name] = torch.randn(shape)
    with pytest.raises(ValueError, match=f"gla: {name} "):
        gla(**ins, backend=backend)


def test_norm_and_convolution_refuse_a_short_weight_or_bias():
    x = torch.randn(1, 17, 24)
    with pytest.raises(ValueError, match=r"rms_norm: weight must be \(24,\)"):
        rms_norm(x, torch.randn(20))
    with pytest.raises(ValueError, match=r"rms_norm: weight is required, a \(24,\) tensor"):
        rms_norm(x, None)
    with pytest.raises(ValueError, match=r"gated_rms_norm: weight must be \(24,\)"):
        gated_rms_norm(x, torch.randn_like(x), torch.randn(20))
    with pytest.raises(ValueError, match=r"gated_rms_norm: the gate z must have x's shape \(1, 17, 24\)"):
        gated_rms_norm(x, torch.randn(1, 16, 24), torch.randn(24))
    with pytest.raises(ValueError, match=r"causal_conv: bias must be \(C,\) = \(24,\)"):
        causal_conv(x, torch.randn(24, 4), torch.randn(20))
