"""``python -m zoo.benchmark.scaling``'s targets: a target that is not a finite number in its range is refused in
one line naming the flag (a negative ``--growth`` raised to a fractional power of the length ratio made a complex
number and a traceback; NaN made every target miss with exit status 1, as if the mixers had missed them), and a
valid target is applied as documented (``growth ** log4(T ratio)``), checked on rows of known times."""
from __future__ import annotations

import json
import math

import pytest
import torch

from zoo.benchmark import scaling


def _rows(T0: int, factor: int, ms0: float, ms1: float) -> dict:
    """A bench result of one linear-state mixer at two lengths with the given fwd+bwd times."""
    rows = []
    for T, ms in ((T0, ms0), (T0 * factor, ms1)):
        rows.append({"label": "mine", "mixer": "mine", "T": T, "batch": 1, "fwd_bwd_ms": ms,
                     "tok_s_train": T / (ms / 1e3), "fwd_bwd_user_ms": ms, "fwd_bwd_sys_ms": 0.0,
                     "peak_mib": float(T), "state_grows_with_seq_len": False})
    return {"rows": rows}


@pytest.mark.parametrize("flag, value", [("--growth", "-1"), ("--growth", "0"), ("--growth", "nan"),
                                         ("--tok-ratio", "inf"), ("--tok-ratio", "-0.5"), ("--sys-share", "0"),
                                         ("--sys-share", "nan"), ("--memory-slack", "-0.1"), ("--growth", "fast")])
def test_a_target_out_of_its_range_is_refused_in_one_line(tmp_path, capsys, flag, value):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_rows(16, 4, 1.0, 2.0)))
    with pytest.raises(SystemExit) as stopped:
        scaling.main([str(path), flag, value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: expected a finite number" in err and repr(value) in err


def test_the_growth_target_scales_with_the_length_ratio(tmp_path, capsys):
    """At a length ratio r the wall growth is held to growth ** log4(r): a time ratio just under it meets the
    target (exit 0), just over it misses (exit 1)."""
    growth = float(torch.empty(()).uniform_(1.5, 6.0))
    factor = int(torch.randint(2, 9, ()))
    limit = growth ** math.log(factor, 4)
    path = tmp_path / "bench.json"
    for ratio, code in ((limit * 0.99, 0), (limit * 1.01, 1)):
        path.write_text(json.dumps(_rows(16, factor, 1.0, ratio)))
        args = [str(path), "--growth", repr(growth), "--tok-ratio", "0", "--memory-slack", "0.01"]
        assert scaling.main(args) == code
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| mine ")][0]
        assert f"{ratio:.2f}x" in line
        assert ("all met" in line) == (code == 0) and ("missed: growth" in line) == (code == 1)
