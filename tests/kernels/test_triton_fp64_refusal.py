"""The Triton kernels compute in fp32 and 16 bits. fp64 inputs asked of them by name are refused with the reason
(the delta rule and SKA ran them in fp32 behind the caller's back, or failed inside), and ``auto`` on the GPU code
path gives them to a backend that keeps fp64: the results match the fp64 references to fp64 accuracy."""
import pytest
import torch

from kernels.attention import attention, attention_reference
from kernels.backend import BackendUnavailable
from kernels.delta import delta_rule
from kernels.delta.reference import delta_product_reference
from kernels.device import gpu_path_on_cpu
from kernels.ska import ska
from kernels.ska.reference import ska_reference
from tests.kernels.harness import assert_rel_close, needs_triton


def _inputs():
    B, T, H, D = 2, int(torch.randint(3, 24, ())), 2, 8
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for _ in range(3))
    return q, torch.nn.functional.normalize(k, dim=-1), v, torch.rand(B, T, H, dtype=torch.float64)


CASES = {
    "delta_rule": (lambda q, k, v, b, backend: delta_rule(q, k, v, b, g=-b, backend=backend)[0],
                   lambda q, k, v, b: delta_product_reference(q, k, v, b, -b, 1)[0]),
    "ska": (lambda q, k, v, b, backend: ska(q, k, v, chunk_size=4, backend=backend),
            lambda q, k, v, b: ska_reference(q, k, v, chunk_size=4)),
    "attention": (lambda q, k, v, b, backend: attention(q, k, v, backend=backend),
                  lambda q, k, v, b: attention_reference(q, k, v)),
}


@needs_triton
@pytest.mark.parametrize("op", sorted(CASES))
def test_triton_refuses_fp64_by_name_and_auto_keeps_fp64(op):
    run, reference = CASES[op]
    q, k, v, b = _inputs()
    with pytest.raises(BackendUnavailable, match="not fp64"):
        run(q, k, v, b, "triton")
    with gpu_path_on_cpu():
        out = run(q, k, v, b, "auto")
    assert out.dtype == torch.float64
    assert_rel_close(out, reference(q, k, v, b), 1e-10, op)
