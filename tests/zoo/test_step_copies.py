"""zoo.benchmark.step_copies: the copies, casts and concatenations of gpu_speed's language-model step under bf16
autocast on the GPU path, counted without running a kernel."""
import pytest
import torch

from kernels.backend import triton_interpreting
from zoo.benchmark import gpu_speed, step_copies

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="the tool runs the launchers through the interpreter")


def test_the_counter_adds_the_bytes_each_copy_reads_and_writes():
    a, b = torch.randn(3, 5), torch.randn(3, 7)
    x = torch.randn(4, 6)
    with step_copies.CopyCounter() as spy:
        torch.cat([a, b], dim=1)                     # reads 36 fp32, writes 36
        x.to(torch.bfloat16)                         # reads 24 fp32, writes 24 bf16
        x.t().contiguous()                           # a clone: reads 24 fp32, writes 24
        x.mul(2)                                     # computes: not counted
    assert dict(spy.launches) == {"aten::cat": 1, "aten::_to_copy": 1, "aten::clone": 1}
    assert dict(spy.bytes) == {"aten::cat": 2 * 36 * 4, "aten::_to_copy": 24 * 4 + 24 * 2,
                               "aten::clone": 2 * 24 * 4}


def _slope_and_intercept(name: str, op: str) -> tuple[float, float]:
    """Bytes of ``op`` a step: per token, and at zero tokens (the two lengths' line)."""
    short, long = (step_copies.step_copies(name, T) for T in step_copies.LENGTHS)
    slope = (long.bytes[op] - short.bytes[op]) / (step_copies.LENGTHS[1] - step_copies.LENGTHS[0])
    return slope, short.bytes[op] - slope * step_copies.LENGTHS[0]


def test_rows_extrapolate_the_step_linearly_in_the_tokens(capsys):
    """The table's row is the two lengths' line at the benchmark's tokens. The Kronecker slots concatenate their
    projections before the short convolution (they grow with the tokens); Gated DeltaNet's parts are written in
    place, so its only
    concatenations are of the fp32 weights of the fused projection and of the short convolutions, once a step in
    every layer (read and written), which do not grow."""
    assert step_copies.main(["kronecker_slots", "gated_deltanet"]) == 0
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in capsys.readouterr().out.splitlines()[2:])}
    assert set(rows) == {"kronecker_slots", "gated_deltanet"}
    row = step_copies.measure("kronecker_slots")
    assert int(rows["kronecker_slots"][1]) == row["launches"] > 0
    slope, intercept = _slope_and_intercept("kronecker_slots", "aten::cat")
    assert slope > 0 and row["mb"]["aten::cat"] == pytest.approx((intercept + slope * row["tokens"]) / 1e6, abs=0.1)

    slope, intercept = _slope_and_intercept("gated_deltanet", "aten::cat")
    model = gpu_speed.lm_model(gpu_speed.FULL, "gated_deltanet")[1]
    mixer = model.blocks[0].mixer
    fused = [mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.b_proj, mixer.z_proj, mixer.gate.proj]
    rows_padded = -(-sum(m.out_features for m in fused) // 16) * 16
    convs = [p.numel() for c in (mixer.q_conv, mixer.k_conv, mixer.v_conv) for p in c.parameters()]
    assert slope == 0 and intercept == 2 * len(model.blocks) * (rows_padded * mixer.d_model + sum(convs)) * 4


def test_bad_arguments_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        step_copies.main(["no_such_mixer"])
    assert "unknown mixers ['no_such_mixer']" in capsys.readouterr().err
