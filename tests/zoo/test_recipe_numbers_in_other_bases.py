"""Numbers YAML 1.1 reads in another base than they seem written in (``010`` is octal 8, ``1:30`` base-60 90) are
refused where a recipe, an override or a test-time knob gives them, naming the line, the value YAML would read
(worked out here by hand) and how to write it; quoted names and the other spellings YAML shares with Python
(``0x10``, ``1_000``, ``0.10``) keep their values."""
import re

import pytest
import torch

from zoo.errors import UserError
from zoo.generate import parse_test_time
from zoo.recipes.loading import read_yaml
from zoo.recipes.overrides import parse_override

BASE = "task: {name: mqar}\nmodel:\n  d_model: 32\n  layers: [{attention: {}}]\ntrain:\n  lr: 0.003\n"


def _octal() -> tuple[str, int]:
    """An integer written with leading zeros in octal digits, and the number YAML 1.1 reads it as."""
    digits = "".join(str(int(d)) for d in torch.randint(0, 8, (int(torch.randint(1, 5, ())),)))
    text = "0" * int(torch.randint(1, 3, ())) + digits
    sign = ["", "-", "+"][int(torch.randint(0, 3, ()))]
    return sign + text, (-1 if sign == "-" else 1) * int(digits, 8)


def _base60() -> tuple[str, int]:
    hours, minutes = int(torch.randint(1, 100, ())), int(torch.randint(0, 60, ()))
    return f"{hours}:{minutes:02d}", hours * 60 + minutes


@pytest.mark.parametrize("spelling", [_octal, _base60])
def test_a_recipe_number_in_another_base_is_refused_at_its_line(tmp_path, spelling):
    for _ in range(20):
        text, value = spelling()
        where = int(torch.randint(0, 3, ()))
        extra = ["  steps: {}\n", "  warmup_steps: {}\n", "grid:\n  - label: {}\n    train.lr: 0.01\n"][where]
        path = tmp_path / "r.yaml"
        path.write_text(BASE + extra.format(text))
        line = BASE.count("\n") + 1 + (where == 2)
        with pytest.raises(UserError) as refused:
            read_yaml(path)
        message = str(refused.value)
        assert message.startswith(f"{path}:{line}: YAML reads {text} as the ")
        assert f"number {value};" in message and f"quote it ('{text}')" in message


def test_quoted_names_and_the_spellings_yaml_shares_with_python_keep_their_values(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(BASE + "  steps: 0x10\n  warmup_steps: 1_000\n  weight_decay: 0.10\ngrid:\n"
                           "  - label: '010'\n    train.lr: 010.5\n  - label: \"1:30\"\n    train.lr: 0\n")
    data, _ = read_yaml(path)
    assert (data["train"]["steps"], data["train"]["warmup_steps"], data["train"]["weight_decay"]) == (16, 1000, 0.1)
    assert [(c["label"], c["train.lr"]) for c in data["grid"]] == [("010", 10.5), ("1:30", 0)]


def test_overrides_and_test_time_knobs_refuse_them_too():
    text, value = _octal()
    with pytest.raises(UserError, match=re.escape(f"override 'train.steps={text}': YAML reads {text} as the octal "
                                                  f"number {value};")):
        parse_override(f"train.steps={text}")
    with pytest.raises(UserError, match=r"YAML reads 2:05 as the base-60 number 125;"):
        parse_override("model.layers=[{attention: {n_heads: 2:05}}]")
    assert parse_override(f"task.label='{text}'") == (["task", "label"], text)
    with pytest.raises(UserError, match=re.escape(f"--test-time num_iter={text}: YAML reads {text} as the octal")):
        parse_test_time([f"num_iter={text}"])
    assert parse_test_time(["num_iter=12"])[0][:2] == ("num_iter", 12)
