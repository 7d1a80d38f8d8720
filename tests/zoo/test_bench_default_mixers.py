"""``zoo bench`` without ``--mixers`` benchmarks "every registered mixer (see `zoo list`)": with a module of one's
own named in ``imports`` (an ``imports=[...]`` override, or the ``imports:`` of the ``--recipe``), that includes the
module's mixer, as ``zoo list --imports`` does. A module that cannot be imported is refused in one line."""
from __future__ import annotations

import argparse
import sys
import uuid

import pytest

from mixers import MIXERS
from zoo.benchmark import runner as bench
from zoo.errors import UserError

MODULE = '''"""A user's mixer module, outside the repository."""
from mixers import register_mixer
from tests.mixers.example_mixer import CumulativeMean


@register_mixer
class Mine(CumulativeMean):
    name = "{name}"
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh module (never imported in this process) registering a mixer when imported: (module, mixer name)."""
    tag = uuid.uuid4().hex[:10]
    module, name = f"bench_user_mixer_{tag}", f"bench_user_{tag}"
    (tmp_path / f"{module}.py").write_text(MODULE.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, name
    MIXERS.entries.pop(name, None)
    sys.modules.pop(module, None)


def _args(*extra):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    return parser.parse_intermixed_args(["model.d_model=16", *extra])


def _layers(args) -> list[str]:
    return [spec.name for spec in bench.bench_recipe(args).layers]


def test_an_imports_override_adds_its_mixer_to_the_default_entries(user_module):
    module, name = user_module
    assert name not in MIXERS.names()
    layers = _layers(_args(f"imports=[{module}]"))
    assert name in layers
    assert set(layers) == set(MIXERS.names())   # every registered mixer, each once
    assert len(layers) == len(set(layers))


def test_the_imports_of_the_recipe_add_its_mixer_to_the_default_entries(user_module, tmp_path):
    module, name = user_module
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"imports: [{module}]\nmodel: {{d_model: 16}}\n")
    assert name in _layers(_args("--recipe", str(recipe)))


def test_an_override_replaces_the_recipes_imports(user_module, tmp_path):
    module, name = user_module
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("imports: [a_module_that_does_not_exist_anywhere]\nmodel: {d_model: 16}\n")
    assert name in _layers(_args("--recipe", str(recipe), f"imports=[{module}]"))


def test_a_module_that_cannot_be_imported_is_refused_in_one_line():
    with pytest.raises(UserError) as refused:
        bench.bench_recipe(_args("imports=[a_module_that_does_not_exist_anywhere]"))
    message = str(refused.value)
    assert "cannot import 'a_module_that_does_not_exist_anywhere'" in message and "\n" not in message
