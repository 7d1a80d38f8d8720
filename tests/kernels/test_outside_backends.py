"""Outside CUDA backends (other projects' kernels) against our fp64 references.

- ``ssd`` backend ``mamba_ssm`` (mamba-ssm's ``mamba_chunk_scan_combined``), ``gla`` backend ``fla``
  (``chunk_simple_gla``), ``delta_product`` / ``delta_rule`` backend ``fla`` (``chunk_gated_delta_rule``,
  ``chunk_delta_rule``, ``chunk_gated_delta_product``): outputs, final states and input gradients in fp32
  and bf16 on CUDA (skipped without a GPU or the package);
- on any machine: asking for an outside backend on CPU tensors, or an unknown one, fails with a clear
  :class:`BackendUnavailable` / ``ValueError``, and ``auto`` never picks an outside backend.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import delta as delta_family
from kernels import gla as gla_family
from kernels.backend import BackendUnavailable, fla_gated_problem, package_importable
from kernels.delta import delta_product
from kernels.delta.reference import delta_product_reference
from kernels.gla import gla, gla_reference
from kernels.ssd import ssd, ssd_reference
from tests.kernels.harness import compare_backends

# (output, gradient) tolerances relative to an fp64 reference
TOL = {torch.float32: (2e-3, 5e-3), torch.bfloat16: (3e-2, 6e-2)}
# fla's Triton kernels take fp32 dot products in TF32 on a GPU: its fp32 delta rule measured 2.7e-3 and 3.2e-3
# on an H100 (T = 150, through the chunk's triangular solve)
TOL_FLA_DELTA = {torch.float32: (1e-2, 2e-2), torch.bfloat16: TOL[torch.bfloat16]}


def _ssd_inputs(b, T, H, P, N, dtype, device):
    x = torch.randn(b, T, H, P, device=device)
    dt = F.softplus(torch.randn(b, T, H, device=device) - 1)
    A = -torch.rand(H, device=device) - 0.5
    B, C = torch.randn(2, b, T, H, N, device=device)
    h0 = torch.randn(b, H, N, P, device=device)
    return [t.to(dtype) if t is not A else t for t in (x, dt, A, B, C, h0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not package_importable("mamba_ssm"), reason="mamba-ssm not installed")
def test_ssd_mamba_ssm_matches_reference(dtype):
    tol, gtol = TOL[dtype]
    ins = _ssd_inputs(2, 200, 4, 32, 32, dtype, "cuda")
    compare_backends(lambda *a: ssd(*a[:5], chunk_size=64, initial_state=a[5], backend="mamba_ssm"),
                     lambda *a: ssd_reference(*a[:5], initial_state=a[5]), ins, tol=tol, grad_tol=gtol)


def _skip_where_fla_refuses(runs_gated: bool):
    """fla itself refuses its gated backward on some GPU / Triton pairs (kernels.backend.fla_gated_refusal);
    the zoo then refuses the backend by name, which test_backend_auto checks on any machine. ``runs_gated``:
    the family's own ``fla_runs_gated`` for the test's inputs."""
    problem = fla_gated_problem(torch.empty(0, device="cuda"))
    if runs_gated and problem:
        with pytest.raises(BackendUnavailable, match="Hopper"):
            gla(*[torch.zeros(1, 2, 1, 4, device="cuda")] * 3, torch.zeros(1, 2, 1, device="cuda"), backend="fla")
        pytest.skip(problem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not package_importable("fla"), reason="flash-linear-attention not installed")
def test_gla_fla_matches_reference(dtype):
    _skip_where_fla_refuses(gla_family.fla_runs_gated(dtype, gated=True))
    tol, gtol = TOL[dtype]
    b, T, H, dk, dv = 2, 200, 4, 32, 48
    q, k = torch.randn(2, b, T, H, dk, device="cuda")
    v = torch.randn(b, T, H, dv, device="cuda")
    g = F.logsigmoid(torch.randn(b, T, H, device="cuda") + 3)
    U0 = torch.randn(b, H, dv, dk, device="cuda")
    ins = [t.to(dtype) for t in (q, k, v)] + [g, U0]
    compare_backends(lambda q, k, v, g, U0: gla(q, k, v, g, initial_state=U0, backend="fla"),
                     lambda q, k, v, g, U0: gla_reference(q, k, v, g, initial_state=U0), ins, tol=tol, grad_tol=gtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,gate", [(1, False), (1, True), (2, True), (3, False)])
@pytest.mark.gpu
@pytest.mark.skipif(not package_importable("fla"), reason="flash-linear-attention not installed")
def test_delta_fla_matches_reference(dtype, n, gate):
    _skip_where_fla_refuses(delta_family.fla_runs_gated(dtype, gated=gate))
    tol, gtol = TOL_FLA_DELTA[dtype]
    b, T, H, K, V = 2, 150, 4, 32, 32
    q = torch.randn(b, T, H, K, device="cuda")
    k = F.normalize(torch.randn(b, T * n, H, K, device="cuda"), dim=-1)
    v = torch.randn(b, T * n, H, V, device="cuda")
    beta = 2 * torch.rand(b, T * n, H, device="cuda")
    g = F.logsigmoid(torch.randn(b, T, H, device="cuda") + 2) if gate else None
    s0 = torch.randn(b, H, K, V, device="cuda")
    ins = [t.to(dtype) for t in (q, k, v, beta)] + [g, s0]
    compare_backends(
        lambda q, k, v, beta, g, s0: delta_product(q, k, v, beta, g=g, num_householder=n, initial_state=s0, backend="fla"),
        lambda q, k, v, beta, g, s0: delta_product_reference(q, k, v, beta, g, n, initial_state=s0),
        ins, tol=tol, grad_tol=gtol)


# ------------------------------------------------------------------------- any machine: clear refusals
@pytest.mark.parametrize("call", ["ssd", "gla", "delta"])
def test_outside_backend_on_cpu_is_a_clear_error(call):
    if call == "ssd":
        x, dt, A, B, C, _ = _ssd_inputs(1, 8, 2, 4, 4, torch.float32, "cpu")
        run = lambda: ssd(x, dt, A, B, C, backend="mamba_ssm")  # noqa: E731
        name = "mamba_ssm"
    elif call == "gla":
        q = torch.randn(1, 8, 2, 4)
        run = lambda: gla(q, q, q, -torch.rand(1, 8, 2), backend="fla")  # noqa: E731
        name = "fla"
    else:
        q = torch.randn(1, 8, 2, 4)
        run = lambda: delta_product(q, q, q, torch.rand(1, 8, 2), backend="fla")  # noqa: E731
        name = "fla"
    with pytest.raises(BackendUnavailable, match=f"backend '{name}'.*(CUDA|pip install)"):
        run()


def test_auto_never_picks_an_outside_backend_and_unknown_names_fail():
    x, dt, A, B, C, _ = _ssd_inputs(1, 8, 2, 4, 4, torch.float64, "cpu")
    y_auto, _ = ssd(x, dt, A, B, C, chunk_size=4)
    y_ref, _ = ssd_reference(x, dt, A, B, C)
    assert torch.allclose(y_auto, y_ref, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="unknown backend 'flash_linear'"):
        ssd(x, dt, A, B, C, backend="flash_linear")
    with pytest.raises(BackendUnavailable, match="not implemented"):
        gla(x[..., :4], x[..., :4], x[..., :4], dt, backend="mamba_ssm")
