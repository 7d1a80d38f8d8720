"""``zoo.generate.generate_ids`` from Python refuses what it cannot decode in one line naming the argument (the
command line's flags are checked by ``check_arguments``; a notebook calls the function directly): an empty prompt
(no logits to draw the first token from) and sampling arguments out of range. ``zoo export`` of a model whose
decoding differs from its forward pass (SKA with chunk_size > 1) says so, on stderr and in the exported README, as
``zoo generate`` does."""
from __future__ import annotations

import pytest
import torch

import zoo
from mixers import Mixer
from tests.zoo.untrained import wake_zero_initialised
from zoo.errors import UserError
from zoo.generate import decode_notes, generate_ids, load_lm
from zoo.training import checkpoint as ckpt


def lm_recipe(layers):
    return zoo.load({"model": {"d_model": 16, "layers": layers}, "task": {"name": "lm", "seq_len": 16},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})


@pytest.fixture(scope="module")
def model():
    return wake_zero_initialised(zoo.build_model(lm_recipe(["gla"]))).eval()


def test_an_empty_prompt_is_refused_naming_eos(model):
    with pytest.raises(UserError, match=r"empty prompt \(0 tokens\).*EOS") as err:
        generate_ids(model, [], 5)
    assert "\n" not in str(err.value)
    assert generate_ids(model, [], 0) == ([], 0.0, 0.0)   # nothing asked, nothing decoded
    assert len(generate_ids(model, [256], 3)[0]) == 3      # EOS starts it, as zoo generate starts an empty prompt


@pytest.mark.parametrize("argument,value,words", [
    ("top_p", 0.0, "must be in (0, 1]"), ("top_p", 1.5, "must be in (0, 1]"), ("top_p", float("nan"), "(0, 1]"),
    ("top_k", -1, "must be >= 0"), ("temperature", float("nan"), "finite"), ("temperature", float("inf"), "finite")])
def test_a_sampling_argument_out_of_range_is_refused_naming_it(model, argument, value, words):
    with pytest.raises(UserError) as err:
        generate_ids(model, [1, 2], 3, **{"temperature": 1.0, argument: value})
    assert str(err.value).startswith(f"generate_ids: {argument}={value!r}: ") and words in str(err.value)


def test_the_edges_of_the_ranges_decode(model):
    for kwargs in ({"top_p": 1.0}, {"top_p": 1e-9}, {"top_k": 0}, {"top_k": 1}, {"temperature": -1.0}):
        new, _, _ = generate_ids(model, [1, 2], 3, **{"temperature": 1.0, **kwargs})
        assert len(new) == 3, kwargs
    greedy = generate_ids(model, [1, 2], 4)[0]
    assert generate_ids(model, [1, 2], 4, temperature=1.0, top_k=1, seed=5)[0] == greedy
    assert generate_ids(model, [1, 2], 4, temperature=1.0, top_p=1e-9, seed=6)[0] == greedy


def write_run(folder, recipe) -> str:
    model = wake_zero_initialised(zoo.build_model(recipe))
    run = folder / "run"
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                    "model": model.state_dict(), "step": 1, "finished": True})
    return str(run)


SKA = {"n_heads": 2, "rank": 4, "normalisation": "running_max", "ridge": 0.1}


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_export_names_a_layer_whose_decoding_differs_from_its_forward(tmp_path, capsys, chunk_size):
    pytest.importorskip("transformers")
    from zoo.cli import main as zoo_main

    recipe = lm_recipe([{"ska": {**SKA, "chunk_size": chunk_size}}, "gla"])
    notes = decode_notes(zoo.build_model(recipe))
    assert bool(notes) == (chunk_size > 1)
    assert zoo_main(["export", write_run(tmp_path, recipe), "--to", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    readme = (tmp_path / "hf" / "README.md").read_text()
    if chunk_size == 1:
        assert "note" not in err and "differs from the forward pass" not in readme
    else:
        assert f"zoo export: note: {notes[0]}" in err and len(err.strip().splitlines()) == 1
        assert "Decoding with the cache differs from the forward pass" in readme and notes[0] in readme


def test_a_seed_the_sampling_generator_cannot_tell_apart_is_refused(model):
    low = int(torch.randint(0, 2 ** 31, ()))
    same = [torch.rand(3, generator=torch.Generator().manual_seed(s)) for s in (low, low + 2 ** 32)]
    assert torch.equal(*same)   # why: the CPU generator keeps a seed's lowest 32 bits
    for seed in (low + 2 ** 32, -1 - low):
        with pytest.raises(UserError, match=r"seed .*0 \.\. 2\*\*32 - 1"):
            generate_ids(model, [1, 2], 3, temperature=1.0, seed=seed)
    assert len(generate_ids(model, [1, 2], 3, temperature=1.0, seed=2 ** 32 - 1)[0]) == 3


def test_a_model_in_training_mode_decodes_in_eval_mode_and_keeps_its_mode(model):
    """A model fresh from training decodes as it is evaluated (test-time knobs apply in eval mode only)."""
    seen = []
    prefill, step = model.prefill, model.step
    model.prefill = lambda *a, **k: (seen.append(model.training), prefill(*a, **k))[1]
    model.step = lambda *a, **k: (seen.append(model.training), step(*a, **k))[1]
    try:
        model.train()
        generate_ids(model, [1, 2], 3)
        assert seen == [False] * 3 and model.training   # decoded in eval mode, handed back in training mode
    finally:
        del model.prefill, model.step
        model.eval()


def test_a_checkpoint_decodes_with_another_kernel_backend_and_no_other_override(tmp_path):
    """A model trained with ``backend: triton`` on a GPU decodes on a CPU with ``backend=torch``: here the reverse
    (through the interpreter), the same logits; any other model override is refused."""
    recipe = zoo.load({"model": {"d_model": 16, "layers": [{"gla": {"backend": "torch"}}]},
                       "task": {"name": "lm", "seq_len": 16}, "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})
    trained = wake_zero_initialised(zoo.build_model(recipe)).eval()
    run = tmp_path / "run"
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                    "model": trained.state_dict(), "step": 1, "finished": True})
    other, _task = load_lm(run, backends=["model.layers.0.gla.backend=triton"])
    assert [m.options.backend for m in other.modules() if isinstance(m, Mixer)] == ["triton"]
    ids = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        assert torch.allclose(other(ids), trained(ids), rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="only a mixer's kernel backend"):
        load_lm(run, backends=["model.layers.0.gla.chunk_size=32"])
