"""A fresh install with only some extras (``pip install -e .``, ``.[test]``, ``.[lm]``...): every optional package
the zoo imports is named, with the extra that installs it, by ``zoo doctor`` and by the one-line refusal of the
command that needs it, before anything runs. A missing package is simulated by ``sys.modules[name] = None`` (its
import raises ImportError, ``importlib.util.find_spec`` finds nothing); a present one by a module with a spec.

- ``zoo check`` refuses a recipe whose ``train.tracking`` package is not installed, as ``zoo train`` and ``zoo
  ablate`` then do, instead of answering ``ok`` for a recipe this machine refuses to train;
- ``zoo doctor`` lists every package of pyproject's optional features (lm, hf, ray, tracking, gpu), installed or
  missing with the extra to install, not only the GPU libraries;
- ``python -m zoo.lm_harness`` without lm-evaluation-harness ends in one line naming the extra, not a traceback;
- ``--address ray://...`` with Ray installed without its client (``.[test]`` installs ``ray``) names the extra
  instead of telling the user to start a cluster.
"""
import importlib.machinery
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

from tests.zoo.cli_errors import one_line_error
from zoo.cli import main

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers [attention, mamba2], 6 steps of batch 16
PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"
#: the extras of pyproject.toml that install an optional feature (``test`` is the developers' bundle)
FEATURE_EXTRAS = ("lm", "hf", "ray", "tracking", "gpu")


def _hide(monkeypatch, module: str) -> None:
    """``module`` not installed: ``import module`` raises ImportError and ``find_spec`` answers None."""
    monkeypatch.setitem(sys.modules, module, None)


def _present(monkeypatch, module: str) -> None:
    """``module`` installed (an empty module with a spec, which nothing here calls into)."""
    fake = types.ModuleType(module)
    fake.__spec__ = importlib.machinery.ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, module, fake)


def _extra_packages() -> dict[str, list[str]]:
    """``{extra: [distribution, ...]}`` for the feature extras, read from pyproject.toml (versions and the
    distributions' own extras left out)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {extra: [re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0] for req in extras[extra]]
            for extra in FEATURE_EXTRAS}


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_check_refuses_a_tracking_package_that_is_not_installed(capsys, monkeypatch, kind):
    _hide(monkeypatch, kind)
    err = one_line_error(capsys, "check", TINY, f"train.tracking={kind}")
    assert f"train.tracking={kind} needs the {kind} package" in err and "mixer-zoo[tracking]" in err, err
    # the same recipe trains nowhere either: zoo train refuses it in the same words
    assert err.split(": ", 2)[2].strip() in one_line_error(capsys, "train", TINY, f"train.tracking={kind}")
    _present(monkeypatch, kind)
    assert main(["check", str(TINY), f"train.tracking={kind}"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {TINY}")


def test_check_names_the_grid_cell_whose_tracking_package_is_missing(capsys, monkeypatch, tmp_path):
    _hide(monkeypatch, "wandb")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"extends: {TINY}\ngrid:\n  - {{label: plain}}\n"
                    "  - {label: logged, train.lr: 0.002, train.tracking: wandb}\n")
    err = one_line_error(capsys, "check", grid)
    assert "grid cell 'logged'" in err and "train.tracking=wandb needs the wandb package" in err, err


def _doctor_extras(capsys) -> dict[str, str]:
    """``{package: its line}`` from the extras section of ``zoo doctor``."""
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("extras:") + 1
    section = lines[start:lines.index("", start)]
    return {line.split()[0]: line for line in section if line.startswith("  ") and not line.startswith("  (")}


def test_doctor_lists_every_package_of_the_optional_features(capsys, monkeypatch):
    packages = _extra_packages()
    hidden = {extra: names[-1] for extra, names in packages.items() if extra != "gpu"}
    for extra, names in packages.items():
        for name in names:
            if extra != "gpu":  # the GPU libraries are imported to see whether their CUDA build loads
                _present(monkeypatch, name.replace("-", "_"))
    for name in hidden.values():
        _hide(monkeypatch, name.replace("-", "_"))
    rows = _doctor_extras(capsys)
    for extra, names in packages.items():
        for name in names:
            assert name in rows, f"zoo doctor does not report {name} (extra {extra}): {sorted(rows)}"
            if extra == "gpu":
                continue
            if name == hidden[extra]:
                assert "missing" in rows[name] and f'pip install -e ".[{extra}]"' in rows[name], rows[name]
            else:
                assert "installed" in rows[name] and "missing" not in rows[name], rows[name]


def test_harness_without_lm_eval_ends_in_one_line_naming_the_extra(monkeypatch):
    from zoo import lm_harness
    _hide(monkeypatch, "lm_eval")
    monkeypatch.setattr(lm_harness, "register", lm_harness.register.__wrapped__)  # the cached one may have run
    with pytest.raises(SystemExit) as stop:
        lm_harness.main(["--model", "zoo", "--model_args", "checkpoint=runs/lm", "--tasks", "lambada_openai"])
    message = str(stop.value)
    assert message.startswith("python -m zoo.lm_harness: error: ") and "\n" not in message, message
    assert "lm_eval" in message and 'pip install -e ".[lm]"' in message, message


#: what Ray 2.60's ray.init answers for a ray:// address where Ray is installed without its client (pip install ray)
RAY_CLIENT_MISSING = ("Ray Client requires pip package `ray[client]`. If you installed the minimal Ray (e.g. `pip install "
                      "ray`), please reinstall by executing `pip install ray[client]`.")


def _fake_ray(monkeypatch, refusal: Exception) -> None:
    def init(**_):
        raise refusal
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False, init=init))


def test_a_ray_address_without_the_ray_client_names_the_extra_not_a_cluster_to_start(monkeypatch):
    from zoo.errors import UserError
    from zoo.experiments.executors import RayExecutor
    _fake_ray(monkeypatch, ValueError(RAY_CLIENT_MISSING))
    with pytest.raises(UserError) as refused:
        RayExecutor(address="ray://head:10001")._connect()
    assert "ray start --head" not in str(refused.value) and 'pip install -e ".[ray]"' in str(refused.value), refused.value
    _fake_ray(monkeypatch, ConnectionError("could not reach head:10001"))  # a cluster that is not there: start one
    with pytest.raises(UserError, match="ray start --head"):
        RayExecutor(address="ray://head:10001")._connect()
