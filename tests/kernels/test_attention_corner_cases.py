"""Attention with a value head dim other than the query's: the flash kernels (ours in Triton, flash-attn's) hold
one head dim for ``q``, ``k`` and ``v``, so they refuse such inputs by name, ``auto`` passes over them, and the
backends that take them agree with an explicit softmax computed here."""
import pytest
import torch

from kernels.attention import _unsupported, attention
from kernels.backend import BackendUnavailable
from tests.kernels.harness import DEVICE, assert_rel_close, needs_triton


def _qkv(D, E, dtype=torch.float32, T=5, H=2, Hkv=1):
    q = torch.randn(2, T, H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(2, T, Hkv, D, device=DEVICE, dtype=dtype)
    v = torch.randn(2, T, Hkv, E, device=DEVICE, dtype=dtype)
    return q, k, v


def _explicit_softmax(q, k, v):
    """Causal softmax attention written out in fp64, key/value head ``h // (H / Hkv)`` for query head ``h``."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    T = q.shape[1]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("bhts,bshe->bthe", s.softmax(-1), v)


@needs_triton
def test_triton_refuses_another_value_head_dim_and_names_the_fix():
    from kernels.attention.triton import attention_triton
    q, k, v = _qkv(D=8, E=4)
    with pytest.raises(BackendUnavailable, match=r"head dim.*backend='torch'"):
        attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match=r"head dim.*backend='torch'"):     # the launcher alone, as well
        attention_triton(q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_auto_passes_over_the_flash_kernels_for_another_value_head_dim(dtype):
    q, k, v = _qkv(D=8, E=4, dtype=dtype)
    unsupported = _unsupported(q, k, v)
    assert "flash_attn" in unsupported and "triton" in unsupported
    assert not {"flash_attn", "triton"} & set(_unsupported(*_qkv(D=8, E=8, dtype=torch.float16)))


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_another_value_head_dim_matches_an_explicit_softmax(backend):
    q, k, v = _qkv(D=6, E=3, T=7, H=4, Hkv=2)
    assert_rel_close(attention(q, k, v, backend=backend), _explicit_softmax(q, k, v).float(), 1e-5, backend)
