"""``zoo doctor`` lists every registered mixer with the backend auto picks here and on CUDA, and the extras."""
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
    for fields in rows.values():
        family = fields[1]
        if family == "-":
            continue
        available = doctor.family_backends(family)
        assert fields[2] == auto_choice(available, cuda)[0] and fields[3] == auto_choice(available, True)[0], fields


def test_mixer_families_found_from_imports():
    assert doctor.mixer_families(MIXERS.get("mamba2")) == ["ssd"]
    assert doctor.mixer_families(MIXERS.get("jordan")) == ["blockscan"]
