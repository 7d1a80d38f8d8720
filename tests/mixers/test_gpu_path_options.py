"""The GPU path equals the CPU path at option values the default-option checks of tests/mixers/test_gpu_path.py
do not reach (each quantity judged against the fp64 CPU path, tests/mixers/gpu_path.py says how).

- GKA with ``num_iter = 0`` (no solve: q~ = q, the alpha gate is read by nothing): the GPU path's one fused
  projection gave the unread gate's weight a zero gradient where the CPU path gives none, so AdamW decayed
  it on a GPU only (it matters again as soon as evaluation raises the ``num_iter`` knob).
"""
from __future__ import annotations

import pytest
import torch

from kernels.backend import triton_usable_for
from mixers import build_mixer
from tests.mixers.contract import unzero
from tests.mixers.gpu_path import assert_gpu_path_matches

pytestmark = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")
D_MODEL = 32


def test_gka_without_a_solve_gives_the_unread_alpha_gate_no_gradient():
    layer = unzero(build_mixer("gka", D_MODEL, {"n_heads": 2, "head_dim": 8, "num_iter": 0}))
    x, dy = torch.randn(2, 9, D_MODEL), torch.randn(2, 9, D_MODEL)
    assert_gpu_path_matches(layer, x, dy, 3e-4, "gka num_iter=0")
    assert layer.alpha_proj.weight.grad is None and layer.alpha_proj.bias.grad is None
