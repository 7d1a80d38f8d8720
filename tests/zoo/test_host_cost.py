"""zoo.benchmark.host_cost: the host's share of gpu_speed's language-model step and layer, on the GPU path with no
kernel run. Timing values are not checked (tests do not time things); what each row counts is."""
import pytest
import torch

from kernels.backend import triton_interpreting
from kernels.device import gpu_path_on_cpu
from kernels.launch import counting
from zoo.benchmark import gpu_speed, host_cost

pytestmark = pytest.mark.skipif(not triton_interpreting(), reason="the tool runs the launchers through the interpreter")


def test_rows_count_the_lm_steps_operations_and_launches(capsys):
    assert host_cost.main(["--steps", "1", "jordan"]) == 0
    table = capsys.readouterr().out
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in table.splitlines()[2:])}
    assert set(rows) == {"attention", "jordan"}          # attention is always measured: the ratios' baseline
    assert rows["attention"][2] == "1.00"
    # the Triton launches column is a counted step of the same model (jordan's scan, norms, gates, SwiGLU)
    model = gpu_speed.lm_model(host_cost.SMALL, "jordan")[1]
    step = host_cost.lm_pass(model, host_cost.SMALL, host_cost.SMALL.lm_lengths[0])
    with gpu_path_on_cpu(), counting(execute=False) as launched:
        step()
    assert int(rows["jordan"][5]) == sum(launched.values()) > 0
    assert all(p.grad is None for p in model.parameters())  # each step clears what it accumulated


def test_the_timed_step_runs_no_kernel():
    step = host_cost.lm_pass(gpu_speed.lm_model(host_cost.SMALL, "jordan")[1], host_cost.SMALL, 32)
    with counting(timed=True) as timed:
        host_cost.host_ms(step, 1)
    assert sum(timed.values()) > 0 and timed.timed == []   # launched (counted), never called


def test_bad_arguments_name_the_fix(capsys):
    with pytest.raises(SystemExit):
        host_cost.main(["no_such_mixer"])
    assert "unknown mixers ['no_such_mixer']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_cost.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_threads_below_one_are_refused_before_torch_sees_them(capsys):
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit):
        host_cost.main(["--threads", "0", "jordan"])
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err and torch.get_num_threads() == threads
