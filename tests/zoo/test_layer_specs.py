"""Per-layer mixer specs: two layers of one mixer type with different options, resolved once, trained,
and a typo inside a per-layer option reported with file:line and the nearest valid name."""
import subprocess
import sys
from pathlib import Path

import pytest

from zoo import train
from zoo.errors import UserError
from zoo.model import HybridLM
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"

PER_LAYER = """name: per-layer
seed: 1
model:
  d_model: 32
  layers: [{mamba2: {d_state: 4}}, attention, {mamba2: {d_state: 16, chunk_size: 4}}]
  mixer_options:
    attention: {n_heads: 2}
    mamba2: {headdim: 16, chunk_size: 8}
task: {name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: 2, num_train: 128, num_test: 32}
train: {steps: 3, warmup_steps: 1, batch_size: 16, threads: 1}
"""


def test_two_layers_of_one_type_get_their_own_options_and_train(tmp_path):
    path = tmp_path / "per_layer.yaml"
    path.write_text(PER_LAYER)
    recipe = resolve(path)
    first, _, third = recipe.layers
    assert (first.options.d_state, first.options.chunk_size) == (4, 8)  # type default for chunk_size
    assert (third.options.d_state, third.options.chunk_size) == (16, 4)  # per-layer wins
    assert recipe.plain["model"]["layer_options"][0]["d_state"] == 4
    model = HybridLM.from_recipe(recipe, vocab_size=32)
    blocks = model.blocks
    assert blocks[0].mixer.options is first.options and blocks[2].mixer.options.d_state == 16
    assert blocks[0].mixer.state_size(16) != blocks[2].mixer.state_size(16)
    result = train(recipe, progress=False)
    assert 0.0 <= result.metrics["test_accuracy"] <= 1.0
    # the hash sees per-layer options, and an override reaches one layer only
    other = resolve(path, ["model.layers.0.mamba2.d_state=8"])
    assert other.key != recipe.key and other.layers[0].options.d_state == 8 and other.layers[2].options.d_state == 16
    # a plain layer can take per-layer options by override
    swapped = resolve(path, ["model.layers.1.attention.n_heads=4"])
    assert swapped.layers[1].options.n_heads == 4 and swapped.layers[1].name == "attention"


def test_typo_in_a_per_layer_option_names_file_line_and_nearest_name(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(PER_LAYER.replace("layers: [{mamba2: {d_state: 4}}, attention,",
                                      "layers:\n    - {mamba2: {d_state: 4}}\n    - attention\n"
                                      "    - {mamba2: {d_stat: 16}}\n    #"))
    line = next(i + 1 for i, text in enumerate(path.read_text().splitlines()) if "d_stat:" in text)
    out = subprocess.run([sys.executable, "-m", "zoo", "check", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    msg = out.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    assert f"{path}:{line}:" in msg and "model.layers.2.mamba2.d_stat" in msg and "did you mean 'd_state'" in msg, msg


@pytest.mark.parametrize("layers,expect", [
    ("[{mamba2: {d_state: 4}, attention: {}}]", "one-key mapping"),
    ("[{mamba2: 4}]", "must be a mapping"),
    ("[{mamba3: {d_state: 4}}]", "did you mean 'mamba2'"),
])
def test_malformed_layer_entries(tmp_path, layers, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(PER_LAYER.replace("[{mamba2: {d_state: 4}}, attention, {mamba2: {d_state: 16, chunk_size: 4}}]", layers))
    with pytest.raises(UserError, match=expect):
        resolve(path)


def test_a_constructor_error_is_one_line_naming_the_layer():
    out = subprocess.run([sys.executable, "-m", "zoo", "check", str(TINY), "model.d_model=63"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    msg = out.stderr.strip()
    assert len(msg.splitlines()) == 1 and "model.layers.0" in msg and "n_heads" in msg, msg
