"""``backend="auto"``: on CUDA the fastest correct backend (outside kernels, then Triton, then PyTorch); on a CPU
the PyTorch path. Package availability is faked, so the rule is checked without a GPU or the extras."""
import pytest
import torch

from kernels import backend as kb


@pytest.fixture
def installed(monkeypatch):
    present = set()
    monkeypatch.setattr(kb, "package_importable", lambda module: module in present)
    return present


def test_cuda_prefers_outside_then_triton_then_torch(installed):
    fam = ("reference", "torch", "triton", "fla")
    assert kb.auto_choice(fam, cuda=True) == ("triton", ["fla: not installed (pip install flash-linear-attention)"])
    installed.add("fla")
    assert kb.auto_choice(fam, cuda=True) == ("fla", [])
    assert kb.auto_choice(("reference", "torch", "fla"), cuda=True, unsupported={"fla": "no"}) == ("torch", ["fla: no"])
    assert kb.auto_choice(("reference",), cuda=True) == ("reference", [])


def test_cpu_never_picks_cuda_backends(installed):
    installed.update({"fla", "flash_attn", "mamba_ssm"})
    for fam in (("reference", "torch", "triton", "fla"), ("reference", "triton", "mamba_ssm")):
        choice, _ = kb.auto_choice(fam, cuda=False)
        assert choice == ("torch" if "torch" in fam else "reference")
    assert kb.resolve_backend("auto", torch.zeros(1), op="x", available=("reference", "torch", "triton", "fla")) == "torch"


def test_auto_follows_the_device_plan_on_cpu_tensors(installed, monkeypatch):
    """The GPU path on CPU tensors (``gpu_path_on_cpu``): auto takes the CUDA order, passes over the outside
    backends even when installed (they run on CUDA tensors only) and takes Triton only under the interpreter."""
    from kernels.device import gpu_path_on_cpu

    installed.update({"fla", "flash_attn", "mamba_ssm"})
    fam = ("reference", "torch", "triton", "fla", "mamba_ssm")
    x = torch.zeros(1)
    for interpreting, want in ((True, "triton"), (False, "torch")):
        monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreting else "0")
        assert kb.resolve_backend("auto", x, op="x", available=fam) == "torch"          # the CPU plan
        with gpu_path_on_cpu():
            assert kb.resolve_backend("auto", x, op="x", available=fam) == want
            assert kb.resolve_backend("auto", x, op="x", available=("reference", "fla")) == "reference"


def test_attention_passes_over_flash_attn_for_fp32_and_prefers_sdpa_to_triton(installed, monkeypatch):
    """The family marks flash-attn unsupported for fp32, so auto on CUDA falls to PyTorch's SDPA, which the
    family's own order puts before our Triton kernel (checked on a fake CUDA tensor)."""
    import kernels.attention as att
    installed.add("flash_attn")
    seen = {}

    def fake_resolve(backend, tensor, op, available, unsupported=None, order=None):
        seen["unsupported"] = unsupported
        return kb.auto_choice(available, True, unsupported, order)[0]
    monkeypatch.setattr(att, "resolve_backend", fake_resolve)
    monkeypatch.setattr(att, "_sdpa", lambda *a: "torch")
    monkeypatch.setattr(att, "attention_reference", lambda *a, **k: "reference")
    import kernels.attention.triton as att_triton
    monkeypatch.setattr(att_triton, "attention_triton", lambda *a, **k: "triton")
    q = torch.zeros(1, 4, 1, 8)
    assert att.attention(q, q, q) == "torch" and "flash_attn" in seen["unsupported"]
    assert kb.auto_choice(att.BACKENDS, True, order=att.AUTO_ORDER_CUDA) == ("flash_attn", [])
    installed.clear()
    assert kb.auto_choice(att.BACKENDS, True, order=att.AUTO_ORDER_CUDA)[0] == "torch"
    assert kb.auto_choice(("reference", "torch", "triton"), True)[0] == "triton"  # the default order elsewhere


def test_fp32_attention_above_head_dim_128_is_refused_and_auto_passes_over_triton():
    import kernels.attention as att
    from kernels.attention.triton import attention_triton
    q = torch.zeros(1, 4, 1, 256)
    with pytest.raises(ValueError, match="head dim <= 128"):
        attention_triton(q, q, q)
    assert "triton" in att._unsupported(q, q, q) and "triton" not in att._unsupported(*[q[..., :128]] * 3)
    assert "flash_attn" not in att._unsupported(*[q.half()] * 3)


def test_delta_and_ssd_refuse_sizes_above_a_blocks_shared_memory():
    """Head dims above 128 (delta) and d_state / head dim above 128 (SSD) are refused with one line naming the
    fix; the SSD launcher caps its chunk so that the tiles fit (the result does not depend on the chunk)."""
    from kernels.delta.triton import chunk_gated_delta_rule_triton
    from kernels.ssd.triton import block_chunk, ssd_triton
    x = torch.zeros(1, 4, 1, 256)
    with pytest.raises(ValueError, match="backend='fla' or 'torch'"):
        chunk_gated_delta_rule_triton(x, x, x, torch.zeros(1, 4, 1), None)
    dt, A, B = torch.zeros(1, 4, 1), torch.zeros(1), torch.zeros(1, 4, 1, 256)
    with pytest.raises(ValueError, match="backend='mamba_ssm' or 'torch'"):
        ssd_triton(x[..., :64], dt, A, B, B)
    with pytest.raises(ValueError, match="<= 128"):
        ssd_triton(x, dt, A, B[..., :64], B[..., :64])
    assert block_chunk(256, 128, 128) == 64 and block_chunk(32, 64, 64) == 32
    assert block_chunk(64, 64, 64, low_precision=False) == 32


def test_an_interpreter_that_cannot_run_is_refused_with_the_fix(installed, monkeypatch):
    """Triton's interpreter before 3.7 fails on every kernel with a runtime loop bound under NumPy 2.4 (seen
    with Triton 3.6.0 and NumPy 2.4.6: int() of a one-element array). The versions are judged, auto passes
    over Triton on CPU tensors with the reason, and a request by name is refused with the fix."""
    from kernels.device import gpu_path_on_cpu

    for triton_version, numpy_version in (("3.6.0", "2.4.6"), ("3.2.0", "2.4.0"), ("3.5.1+git12ab", "2.5.0")):
        why = kb.interpreter_refusal(triton_version, numpy_version)
        assert why is not None and "numpy<2.4" in why and triton_version in why and numpy_version in why
    for triton_version, numpy_version in (("3.7.1", "2.4.6"), ("3.6.0", "2.3.5"), ("3.8.0+git1", "3.0.0"),
                                          ("3.2.0", "1.26.4")):
        assert kb.interpreter_refusal(triton_version, numpy_version) is None, (triton_version, numpy_version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = kb.interpreter_refusal("3.6.0", "2.4.6")
    monkeypatch.setattr(kb, "triton_interpreter_problem", lambda: reason)
    x, fam = torch.zeros(1), ("reference", "torch", "triton")
    with gpu_path_on_cpu():
        assert kb.resolve_backend("auto", x, op="x", available=fam) == "torch"
        assert kb.triton_refusal(x) == f"cannot run on CPU tensors: {reason}"   # what auto says it passed over
    refused = r"delta_product: backend 'triton' cannot run on CPU tensors: .*numpy<2\.4"
    with pytest.raises(kb.BackendUnavailable, match=refused):
        kb.resolve_backend("triton", x, op="delta_product", available=fam)
    monkeypatch.setattr(kb, "triton_interpreter_problem", lambda: None)
    assert kb.resolve_backend("triton", x, op="delta_product", available=fam) == "triton"


def test_fla_gated_backward_is_passed_over_on_hopper_with_an_old_triton(installed, monkeypatch):
    """fla 0.6 raises in its gated backward on compute capability 9.x with Triton in [3.4.0, 3.7.1) unless
    tilelang is installed (seen on an H100 with Triton 3.6.0): auto passes over fla there and a request by
    name is refused with the fix, so a training step never reaches fla's error in its backward."""
    assert kb.fla_gated_refusal(9, "3.6.0", tilelang=False) is not None
    assert "triton>=3.7.1" in kb.fla_gated_refusal(9, "3.4.0", tilelang=False)
    assert kb.fla_gated_refusal(9, "3.4", tilelang=False) is not None      # a version without its patch number
    assert kb.fla_gated_refusal(9, "3.7", tilelang=False) is not None
    for major, version, tilelang in ((9, "3.7.1", False), (9, "3.3.1", False), (8, "3.6.0", False),
                                     (10, "3.6.0", False), (9, "3.6.0", True), (9, "3.9.0+git1234", False)):
        assert kb.fla_gated_refusal(major, version, tilelang) is None, (major, version, tilelang)
    installed.add("fla")
    monkeypatch.setattr(kb, "outside_usable_for", lambda backend, tensor: True)  # as on a CUDA tensor
    fam = ("reference", "torch", "triton", "fla")
    why = {"fla": kb.fla_gated_refusal(9, "3.6.0", False)}
    assert kb.auto_choice(fam, cuda=True, unsupported=why)[0] == "triton"
    with pytest.raises(kb.BackendUnavailable, match="fla.*Hopper.*use backend='auto'"):
        kb.resolve_backend("fla", torch.zeros(1), op="delta_product", available=fam, unsupported=why)
    assert kb.resolve_backend("fla", torch.zeros(1), op="delta_product", available=fam, unsupported=None) == "fla"
    # which inputs run fla's gated kernels: each family's own rule, which zoo doctor reads too
    import kernels.delta as delta
    import kernels.gla as gla
    assert not delta.fla_runs_gated(torch.bfloat16, gated=False) and delta.fla_runs_gated(torch.float32, gated=False)
    assert delta.fla_runs_gated(torch.bfloat16, gated=True) and gla.fla_runs_gated(torch.bfloat16, gated=False)
    assert kb.fla_unsupported(torch.zeros(1), runs_gated=True) == {}  # off CUDA fla is refused elsewhere
