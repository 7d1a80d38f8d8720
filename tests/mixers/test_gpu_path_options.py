"""The GPU path equals the CPU path at option values the default-option checks of tests/mixers/test_gpu_path.py
do not reach (each quantity judged against the fp64 CPU path, tests/mixers/gpu_path.py says how).

- GKA with ``num_iter = 0`` (no solve: q~ = q, the alpha gate is read by nothing): the GPU path's one fused
  projection gave the unread gate's weight a zero gradient where the CPU path gives none, so AdamW decayed
  it on a GPU only (it matters again as soon as evaluation raises the ``num_iter`` knob).
- Kronecker slots with the shifted, tied write address (the capacity table's addressing): a first token's
  write address is all-zero logits, a tie among every slot; the GPU path's top-K kernel and the CPU path's
  search took different slots for it, and every later read of those slots differed.
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


@pytest.mark.parametrize("U", [2, 3])
def test_kronecker_slots_with_a_shifted_write_address_selects_the_same_slots(U):
    options = {"n_heads": 2, "d_v": 8, "d_p": 4, "U": U, "top_k": 4, "shift_write_address": True,
               "tie_addresses": True, "conv_size": 1, "chunk_size": 8}
    layer = unzero(build_mixer("kronecker_slots", D_MODEL, options))
    x, dy = torch.randn(2, 12, D_MODEL), torch.randn(2, 12, D_MODEL)
    assert_gpu_path_matches(layer, x, dy, 3e-4, f"kronecker_slots shifted U={U}")
