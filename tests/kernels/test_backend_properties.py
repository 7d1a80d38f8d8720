"""kernels.backend and kernels.device: which backend can take which tensor, and the contexts that change it
(the GPU plan on CPU tensors, Triton on ``meta`` tensors) end where their block ends, even when it raises."""
from __future__ import annotations

import pytest
import torch

from kernels import backend as kb
from kernels.device import CPU, GPU, gpu_path_on_cpu, plan_for


def test_the_gpu_plan_on_cpu_tensors_ends_with_its_block_even_when_it_raises():
    x = torch.zeros(1)
    assert plan_for(x) is CPU
    with pytest.raises(RuntimeError, match="inside"):
        with gpu_path_on_cpu():
            assert plan_for(x) is GPU and plan_for("cpu") is GPU
            with gpu_path_on_cpu():
                assert plan_for(x) is GPU
            assert plan_for(x) is GPU                  # the outer block still holds
            raise RuntimeError("inside")
    assert plan_for(x) is CPU and plan_for("cpu") is CPU
    assert CPU.chunk_size("never registered") == 64 and CPU.chunk_size("never registered", 16) == 16


def test_triton_takes_meta_tensors_only_inside_meta_takes_triton():
    meta = torch.empty(2, device="meta")
    assert kb.triton_refusal(meta) is not None
    with pytest.raises(kb.BackendUnavailable, match="backend 'triton'"):
        kb.resolve_backend("triton", meta, op="x", available=("torch", "triton"))
    with pytest.raises(RuntimeError, match="inside"):
        with kb.meta_takes_triton():
            if kb.triton_importable():
                assert kb.resolve_backend("triton", meta, op="x", available=("torch", "triton")) == "triton"
            raise RuntimeError("inside")
    assert kb.triton_refusal(meta) is not None
    with pytest.raises(kb.BackendUnavailable, match="backend 'triton'"):
        kb.resolve_backend("triton", meta, op="x", available=("torch", "triton"))


def test_the_fused_triton_pieces_are_taken_on_the_gpu_plan_only(monkeypatch):
    monkeypatch.setattr(kb, "triton_refusal", lambda tensor: None)    # as where Triton runs on these tensors
    x = torch.zeros(1)
    assert not kb.triton_pieces_for(x)
    with gpu_path_on_cpu():
        assert kb.triton_pieces_for(x)
    monkeypatch.setattr(kb, "triton_refusal", lambda tensor: "cannot")
    with gpu_path_on_cpu():
        assert not kb.triton_pieces_for(x)


@pytest.mark.parametrize("name", sorted(kb.OUTSIDE_BACKENDS))
def test_an_outside_backend_on_cpu_tensors_is_refused_with_the_fix_even_when_installed(name, monkeypatch):
    monkeypatch.setattr(kb, "package_importable", lambda module: True)
    with pytest.raises(kb.BackendUnavailable, match=rf"op: backend '{name}' runs CUDA kernels only .* on cpu; "
                                                     r"use backend='torch'"):
        kb.resolve_backend(name, torch.zeros(1), op="op", available=("reference", "torch", name))
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of auto, reference"):
        kb.resolve_backend("cuda", torch.zeros(1), op="op")
