"""An override of one layer's option changes that layer only, however the recipe repeats a value.

A recipe may write a layer once and repeat it through a YAML alias (``layers: [&m {mamba2: {...}}, x, *m]``),
or a Python caller may put one mapping at several places; ``model.layers.<i>.<mixer>.<option>=value`` (on the
command line or as a grid cell's key) and ``model.mixer_options.<mixer>.<option>=value`` still change the one
place they name: the other layers keep what was written.
"""
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve

TASK = "task: {name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: 2, num_train: 64, num_test: 16}\n"


def _pick(choices, k):
    return [choices[int(i)] for i in torch.randperm(len(choices))[:k]]


def test_an_override_of_an_aliased_layer_changes_that_layer_only(tmp_path):
    written, first, cell = _pick([4, 8, 16, 32], 3)
    n = int(torch.randint(2, 5, ()))
    layers = ", ".join(["&m {mamba2: {d_state: %d, headdim: 16}}" % written] + ["attention", "*m"] * (n - 1))
    target = 2 * int(torch.randint(0, n, ()))          # a mamba2 layer: the written one or an alias of it
    path = tmp_path / "aliased.yaml"
    path.write_text(f"model:\n  d_model: 32\n  layers: [{layers}]\n  mixer_options: {{attention: {{n_heads: 2}}}}\n"
                    f"{TASK}grid:\n  - {{label: one, model.layers.{target}.mamba2.d_state: {cell}}}\n"
                    f"  - {{label: other, train.lr: 0.01}}\n")
    n_layers = 2 * n - 1
    mamba = [i for i in range(n_layers) if i % 2 == 0]

    def expected(changes):
        return [changes.get(i, written) if i in mamba else None for i in range(n_layers)]

    def d_states(recipe):
        return [getattr(spec.options, "d_state", None) for spec in recipe.layers]

    recipe = resolve(path, [f"model.layers.{target}.mamba2.d_state={first}"])
    assert d_states(recipe) == expected({target: first})
    one, other = (c.recipe for c in recipe.cells)
    assert d_states(one) == expected({target: cell})
    assert d_states(other) == expected({target: first})
    model = HybridLM.from_recipe(one, 32)
    assert len(model.blocks) == n_layers
    assert [getattr(b.mixer.options, "d_state", None) for b in model.blocks] == expected({target: cell})
    assert resolve(path).layers[target].options.d_state == written   # the file itself is unchanged


def test_an_override_of_a_mapping_a_caller_shares_changes_one_place():
    heads, other_heads = _pick([1, 2, 4], 2)
    options = {"n_heads": heads, "head_dim": 8}
    shared = {"gla": options}
    recipe = {"model": {"d_model": 16, "layers": [shared, shared, shared],
                        "mixer_options": {"gla": options, "gka": options}},
              "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2}}
    target = int(torch.randint(0, 3, ()))
    got = resolve(recipe, [f"model.layers.{target}.gla.n_heads={other_heads}"])
    assert [spec.options.n_heads for spec in got.layers] == [other_heads if i == target else heads for i in range(3)]
    swapped = resolve(recipe, [f"model.mixer_options.gla.n_heads={other_heads}", "model.layers=[gla, gka]"])
    assert [spec.options.n_heads for spec in swapped.layers] == [other_heads, heads]   # gka keeps its own
    assert options == {"n_heads": heads, "head_dim": 8}                              # the caller's mapping too
