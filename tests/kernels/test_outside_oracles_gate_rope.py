"""The Mamba-2 log-decay gate (``kernels.gate.log_decay``) and rotary position embeddings (``kernels.rope.rotary``)
against flash-linear-attention's own PyTorch functions (oracles nobody here wrote), values and gradients, on the
reference and the Triton backend (the interpreter on a CPU).

fla 0.6.0, read from its source: ``fla.ops.gated_delta_rule.gate.naive_gdn_gate(g, A_log, dt_bias)`` is
``-exp(A_log) softplus(g + dt_bias)`` computed and returned in fp32; ``fla.modules.rotary.rotary_embedding_ref(x,
cos, sin)`` rotates the first ``2 cos.shape[-1]`` channels of ``x (B, T, H, D)`` in the rotate-half convention (the
pair ``(x_i, x_{i + D/2})``, ours) by the given ``cos, sin (T, D/2)``, computed here in fp64 from the positions
and ``base`` (RoFormer, arXiv:2104.09864), and keeps the rest.

Tolerances (relative Frobenius error): the gate in fp32 against the oracle in fp32: the reference is the same
formula (equal to the bit), the Triton kernel's own softplus measured up to 4.7e-7 over ten draws for the value
and the gradients (those of ``A_log`` and ``dt_bias`` are sums over every token: the harness scales their
tolerance by the sum's cancellation); tolerance 2e-6. RoPE in fp32 against the oracle in fp64: the angle
``p base^(-i/h)`` is rounded to fp32 at position ``p``, an error of about ``p 2^-24`` radians that any fp32
implementation shares (tests/kernels/test_rope.py), so the tolerance is ``(start + T) 2^-24``, at least 1e-6;
measured 8-15x below it.
"""
from __future__ import annotations

import pytest
import torch

from kernels.gate import log_decay
from kernels.rope import rotary
from tests.kernels.harness import TRITON_ON_CPU, compare_backends


@pytest.mark.parametrize("backend", ["reference", TRITON_ON_CPU])
def test_log_decay_matches_fla_naive_gdn_gate(backend):
    """Pre-activations over both tails of the softplus (-20..16), a per-head ``A_log`` and ``dt_bias``."""
    gate = pytest.importorskip("fla.ops.gated_delta_rule.gate")
    H = 6
    raw = torch.randn(3, 40, H) * 6
    raw[0, 0] = torch.linspace(-16, 12, H)
    A_log, dt_bias = torch.randn(H), torch.randn(H) - 4
    compare_backends(lambda raw, A_log, dt_bias: log_decay(raw, A_log, dt_bias, backend=backend),
                     gate.naive_gdn_gate, [raw, A_log, dt_bias], tol=2e-6, ref_dtype=torch.float32,
                     shared={1: tuple(raw.shape), 2: tuple(raw.shape)})


@pytest.mark.parametrize("backend", ["reference", TRITON_ON_CPU])
@pytest.mark.parametrize("rotated", [None, 2])
def test_rotary_matches_fla_rotary_embedding_ref(backend, rotated):
    """Positions from a random ``start``, a random ``base``; the first ``rotated`` groups of a ``q | k | v``-like
    tensor rotated, the others copied."""
    rotary_ref = pytest.importorskip("fla.modules.rotary")
    B, T, G, D = 2, 23, 3, 16
    start, base = int(torch.randint(0, 2000, ())), float(torch.rand(())) * 1e4 + 100
    x = torch.randn(B, T, G, D)
    n = G if rotated is None else rotated

    def oracle(x):
        half = D // 2
        angles = torch.arange(start, start + T, dtype=x.dtype)[:, None] * base ** (-torch.arange(half, dtype=x.dtype) / half)
        return torch.cat([rotary_ref.rotary_embedding_ref(x[:, :, :n], angles.cos(), angles.sin()), x[:, :, n:]], dim=2)

    compare_backends(lambda x: rotary(x, start=start, base=base, rotated=rotated, backend=backend), oracle, [x],
                     tol=max(1e-6, (start + T) * 2.0 ** -24))
