"""``zoo doctor`` lists every registered mixer with the backend auto picks here and on CUDA, and the extras."""
import pytest
import torch

from kernels.backend import auto_choice
from mixers import MIXERS
from zoo import doctor
from zoo.cli import main


def test_doctor_reports_every_mixer(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "extras:" in out and "flash-attn" in out and "mamba-ssm" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[out.splitlines().index(
        next(line for line in out.splitlines() if line.startswith("mixer"))) + 1:] if line.strip()}
    assert set(rows) == set(MIXERS.names())
    cuda = torch.cuda.is_available()
    problem = doctor.cuda_fla_problem()
    for name, fields in rows.items():
        family = fields[1]
        if family == "-":
            continue
        available = doctor.family_backends(family)
        unsupported = doctor._fla_unsupported(name, family, problem)
        order = doctor.family_order(family)
        assert fields[2] == auto_choice(available, cuda, unsupported, order)[0], fields
        assert fields[3] == auto_choice(available, True, unsupported, order)[0], fields


def test_doctor_reports_where_fla_refuses_its_gated_backward(monkeypatch):
    """On a GPU where fla refuses its gated backward (kernels.backend.fla_gated_refusal), the report says
    that auto runs our kernels for GLA and the gated delta rules, and still fla for the ungated one."""
    import kernels.backend as kb
    monkeypatch.setattr(kb, "package_importable", lambda module: module == "fla")
    monkeypatch.setattr(doctor, "cuda_fla_problem", lambda: "fla refuses here")
    rows = {(name, family): (on_cuda, why) for name, family, _, on_cuda, why in doctor.mixer_rows(cuda=True)}
    assert rows["gated_deltanet", "delta"] == ("triton", "fla: fla refuses here")
    assert rows["deltaproduct", "delta"][0] == "triton" and rows["gla", "gla"][0] == "triton"
    assert rows["deltanet", "delta"][0] == "fla"
    monkeypatch.setattr(doctor, "cuda_fla_problem", lambda: None)
    rows = {(name, family): on_cuda for name, family, _, on_cuda, _ in doctor.mixer_rows(cuda=True)}
    assert rows["gated_deltanet", "delta"] == rows["gla", "gla"] == "fla"


def test_mixer_families_found_from_imports():
    assert doctor.mixer_families(MIXERS.get("mamba2")) == ["ssd"]
    assert doctor.mixer_families(MIXERS.get("jordan")) == ["blockscan"]
    assert doctor.mixer_families(MIXERS.get("attention")) == ["attention", "rope"]   # not kernels.device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report has the interpreter line on a CPU only")
def test_doctor_says_whether_the_triton_interpreter_can_run(capsys, monkeypatch):
    """On a CPU the report has one line for the interpreter: that it works, or why not and the fix."""
    why = "the Triton 3.6.0 interpreter cannot run with NumPy 2.4.6 (...); pip install 'numpy<2.4'"
    for problem, want in ((None, "works"), (why, f"cannot run: {why}")):
        monkeypatch.setattr(doctor, "triton_interpreter_problem", lambda problem=problem: problem)
        assert main(["doctor"]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if "triton interpreter" in line)
        assert line.split("triton interpreter")[1].strip().startswith(want), line


def test_doctor_says_what_the_launch_tables_hold(monkeypatch, tmp_path):
    from kernels import launch_table
    monkeypatch.setattr(launch_table, "TABLE_DIR", tmp_path)
    assert doctor.launch_table_lines(cuda=False) == [
        "launch tables: none (every Triton kernel launches with its launcher's warps and stages)"]
    measured = {"card": "NVIDIA H200", "commit": "0000000", "mixer": "jordan", "T": 64, "d_model": 32,
                "head_dim": 16, "dtype": "bf16", "launcher_ms": 1.0, "ms": 0.5}
    launch_table.merge(90, [{"kernel": f"x.k{i}", "sixteen_bit": True, "constexprs": {"B": 64}, "num_warps": 8,
                             "num_stages": 2, "measured": measured} for i in range(3)])
    (launch_table.TABLE_DIR / "sm_80.json").write_text("{broken")
    lines = doctor.launch_table_lines(cuda=False)
    assert lines[1].startswith("  sm_80.json: unreadable: ") and "not a readable JSON launch table" in lines[1]
    assert lines[2] == "  sm_90: 3 launch configurations measured on NVIDIA H200"
