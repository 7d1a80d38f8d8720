"""An explicit ``backend='triton'`` is refused when the layer is built, not at its first forward, wherever the other
options make the Triton kernels refuse the inputs (a recipe is then stopped before training, with the option
and the fix named), and every ``backend='triton'`` configuration the constructor accepts runs.

- gla: the chunk stages need ``chunk_size`` a power of two >= 16 (as gka already checked at construction);
- deltaproduct / deltanet / gated_deltanet: the kernels take head dims up to 128;
- mamba2: the SSD kernels take ``d_state`` and ``headdim`` up to 128.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.backend import triton_usable_for
from mixers import MIXERS, build_mixer
from mixers.options import OptionError
from tests.kernels.harness import rel_err

D_MODEL = 32
needs_triton = pytest.mark.skipif(not triton_usable_for(torch.empty(0)), reason="needs Triton (interpreter)")


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 24, 48])
def test_gla_refuses_a_triton_chunk_size_its_kernels_cannot_take(chunk_size):
    with pytest.raises(OptionError) as err:
        build_mixer("gla", D_MODEL, {"backend": "triton", "chunk_size": chunk_size})
    message = str(err.value)
    assert "backend='triton'" in message and f"got {chunk_size}" in message and "chunk_size=" in message, message
    build_mixer("gla", D_MODEL, {"backend": "torch", "chunk_size": chunk_size})   # the chunked path takes any


@pytest.mark.parametrize("name", ["deltaproduct", "deltanet", "gated_deltanet"])
def test_delta_rule_refuses_triton_head_dims_above_128(name):
    for options in ({"n_heads": 1, "head_dim": 136}, {"n_heads": 1}):   # given, or d_model / n_heads
        with pytest.raises(ValueError, match=r"backend='triton' needs head_dim <= 128.*head_dim=136"):
            build_mixer(name, 136, {**options, "backend": "triton"})
        build_mixer(name, 136, options)   # auto falls back to the chunked path there
    build_mixer(name, D_MODEL, {"n_heads": 1, "head_dim": 128, "backend": "triton"})


@pytest.mark.parametrize("options", [{"d_state": 136, "headdim": 8}, {"d_state": 8, "headdim": 136, "expand": 17}])
def test_mamba2_refuses_triton_dims_above_128(options):
    with pytest.raises(OptionError, match=r"backend='triton' needs d_state and headdim <= 128"):
        build_mixer("mamba2", 8, {**options, "backend": "triton"})
    build_mixer("mamba2", 8, options)
    build_mixer("mamba2", 8, {"d_state": 128, "headdim": 8, "backend": "triton"})


def _triton_cases():
    cases = []
    for name in MIXERS.names():
        fields = {f.name: f for f in dataclasses.fields(MIXERS.get(name).Options)}
        if "backend" not in fields or "triton" not in (fields["backend"].metadata.get("choices") or ()):
            continue
        for chunk in ([None, 5, 8, 16] if "chunk_size" in fields else [None]):
            cases.append((name, {} if chunk is None else {"chunk_size": chunk}))
    return cases


@needs_triton
@pytest.mark.parametrize("name, extra", _triton_cases(), ids=[f"{n}-{e}" for n, e in _triton_cases()])
def test_a_triton_configuration_the_constructor_accepts_runs(name, extra):
    """Either the constructor refuses the configuration, or its forward runs on the Triton kernels and gives the
    chunked PyTorch path's output."""
    options = {**MIXERS.get(name).contract_options, **extra}
    try:
        layer = build_mixer(name, D_MODEL, {**options, "backend": "triton"})
    except (OptionError, ValueError):
        return
    reference = build_mixer(name, D_MODEL, {**options, "backend": "reference"})
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for p in layer.parameters():   # zero-initialised output projections would make both outputs 0
            p.add_(0.1 * torch.randn_like(p))
        reference.load_state_dict(layer.state_dict())
        x = torch.randn(2, 19, D_MODEL)
        assert rel_err(layer(x), reference(x)) < 1e-3, f"{name} {extra}"
