"""``zoo export`` and the transformers model it writes: the same logits as the zoo's model for every mixer and
a hybrid with per-layer options, a bit-exact save/load round trip, ``generate`` on each layer's decode state
(greedy equal to ``zoo generate``, sampling equal to sampling without a cache), the tokenizer, the
lm-evaluation-harness ``hf`` model against the zoo's adapter, and the one-line refusals. Tiny models made
here; nothing downloads."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import zoo
import zoo.hf  # noqa: F401  (registers the model type with the Auto classes)
from mixers import MIXERS, Mixer
from tests.zoo.untrained import wake_zero_initialised
from zoo.cli import main as zoo_main
from zoo.data.tokenize import ByteTokenizer, HFTokenizer
from zoo.generate import generate_ids, load_lm
from zoo.hf import ZooCache
from zoo.hf.model import CACHE_FIELD
from zoo.lm_harness import ZooScorer
from zoo.rows import append_row, make_row
from zoo.training import checkpoint as ckpt

EOS = 256


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def lm_recipe(layers, d_model=16, task=None, **model):
    return zoo.load({"model": {"d_model": d_model, "layers": layers, **model},
                     "task": {"name": "lm", "seq_len": 16, **(task or {})},
                     "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})


def write_run(folder, recipe, name="run") -> str:
    """A checkpoint of ``recipe``'s model with every weight random and nonzero (zero-initialised projections
    would make a mixer contribute nothing), as ``zoo train --out`` writes it."""
    model = zoo.build_model(recipe)
    wake_zero_initialised(model)
    run = folder / name
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": ckpt.imports_for(recipe),
                                    "model": model.state_dict(), "step": 1, "finished": True})
    return str(run)


def export(run, to) -> str:
    assert zoo_main(["export", run, "--to", str(to)]) == 0
    return str(to)


#: two greedy decodes of one model may part where its two most likely tokens are this close: an untrained model's
#: logits lie within about 0.1 of each other, and the two decodes round them differently (about 1e-7 apart)
GREEDY_TIE = 1e-5


def assert_same_greedy_decode(ours, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """``got`` (transformers' ``generate``) is ``expected`` (zoo's ``generate_ids``) up to where they part, and
    they part only at a near-tie of ``ours``'s logits after the shared prefix; past it they continue different
    prefixes and are not compared."""
    for t, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            with torch.no_grad():
                logits = ours(torch.tensor([prompt + expected[:t]]))[0, -1]
            assert float(logits.max() - logits[a]) <= GREEDY_TIE, (t, got, expected)
            return
    assert len(got) == len(expected), (got, expected)


def recorded_lengths(model) -> list[int]:
    """The input lengths of every forward of ``model`` from now on."""
    lengths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return lengths


@pytest.mark.parametrize("name", MIXERS.names())
def test_every_mixer_exports_to_the_same_logits_and_greedy_decodes_as_zoo_generate(name, tmp_path):
    run = write_run(tmp_path, lm_recipe([{name: dict(MIXERS.get(name).contract_options)}]))
    ours, _ = load_lm(run)
    theirs = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "hf"))
    assert type(theirs).__name__ == "ZooForCausalLM" and theirs.dtype == torch.float32
    ids = torch.randint(0, 257, (2, int(torch.randint(5, 40, ()))))
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max() <= 1e-5
    prompt = torch.randint(0, 256, (int(torch.randint(1, 12, ())),)).tolist()
    expected, _, _ = generate_ids(ours, prompt, max_new_tokens=8, eos_id=EOS)
    lengths = recorded_lengths(theirs)
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    got = out.sequences[0, len(prompt):].tolist()
    assert_same_greedy_decode(ours, prompt, got, expected)
    assert lengths == [len(prompt)] + [1] * (len(got) - 1)  # the prompt once, then one token per step
    cache = getattr(out, CACHE_FIELD)
    assert isinstance(cache, ZooCache) and cache.get_seq_length() == len(prompt) + len(got) - 1


def test_generate_without_a_prompt_starts_from_eos_as_zoo_generate_does(tmp_path):
    run = write_run(tmp_path, lm_recipe(["mamba2", "attention"]))
    ours, _ = load_lm(run)
    theirs = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "hf"))
    expected, _, _ = generate_ids(ours, [EOS], max_new_tokens=8, eos_id=EOS)   # zoo generate's empty prompt
    out = theirs.generate(max_new_tokens=8, do_sample=False)
    assert out[0, 0] == EOS
    assert_same_greedy_decode(ours, [EOS], out[0, 1:].tolist(), expected)


def test_hidden_states_end_after_the_final_norm_and_the_head_reads_the_last_one(tmp_path):
    """transformers' convention (GPT-2, Llama): ``hidden_states`` is the embedding, then every layer's output,
    the last one after the final norm, so that ``lm_head(hidden_states[-1])`` is the logits; recomputed here
    layer by layer on the zoo model. Asking for them changes no logit, with or without a cache."""
    run = write_run(tmp_path, lm_recipe(["mamba2", "attention", "gla"]))
    ours, _ = load_lm(run)
    theirs = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "hf"))
    ids = torch.randint(0, 257, (2, int(torch.randint(3, 20, ()))))
    with torch.no_grad():
        expected = [ours.embed(ids)]
        for block in ours.blocks:
            expected.append(block(expected[-1]))
        expected[-1] = ours.norm(expected[-1])
        for use_cache in (False, True):
            out = theirs(ids, output_hidden_states=True, use_cache=use_cache)
            assert len(out.hidden_states) == len(expected) == 4
            for got, want in zip(out.hidden_states, expected):
                assert (got - want).abs().max() <= 1e-5
            assert torch.equal(out.logits, theirs.get_output_embeddings()(out.hidden_states[-1]))
            assert torch.equal(out.logits, theirs(ids, use_cache=use_cache).logits)


def hybrid_recipe(**task):
    return lm_recipe([{"gla": {"n_heads": 1, "head_dim": 16}}, "attention", {"gla": {"chunk_size": 4}},
                      {"mamba2": {"d_state": 4}}], d_model=32, task=task, state_mixer="koopman_mlp",
                     mixer_options={"gla": {"n_heads": 2, "head_dim": 8}, "attention": {"n_heads": 4},
                                    "mamba2": {"headdim": 16}}, state_mixer_options={"multiple_of": 16})


def test_a_hybrid_with_per_layer_options_round_trips_its_recipe_and_weights_bit_exactly(tmp_path):
    recipe = hybrid_recipe()
    run = write_run(tmp_path, recipe)
    val_bpb = float(torch.rand(())) + 1
    append_row(tmp_path / "run" / "results.jsonl", make_row(recipe, "train", {"val_bpb": val_bpb, "steps": 1}))
    ours, _ = load_lm(run)
    loaded = AutoModelForCausalLM.from_pretrained(export(run, tmp_path / "hf"))
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert f"val_bpb {val_bpb:.4g}" in readme and recipe.key in readme and "koopman_mlp" in readme
    assert loaded.config.recipe == recipe.plain and loaded.config.recipe_key == recipe.key
    assert [b.mixer.options for b in loaded.zoo.blocks] == [s.options for s in recipe.layers]
    assert loaded.zoo.blocks[0].mixer.options.n_heads == 1 and loaded.zoo.blocks[2].mixer.options.n_heads == 2
    ids = torch.randint(0, 257, (3, 33))
    with torch.no_grad():
        assert (loaded(ids).logits - ours(ids)).abs().max() <= 1e-5
    loaded.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    a, b = loaded.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again.zoo.head.weight is again.zoo.embed.weight  # the tied embedding, stored once
    for name in ("config.json", "model.safetensors"):  # the files too, byte for byte
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, loaded(ids).logits)
    cache, split = ZooCache(), int(torch.randint(1, 32, ()))
    with torch.no_grad():  # a prefill, then the rest through the states in one call: the same logits
        parts = [again(ids[:, :split], cache=cache).logits, again(ids[:, split:], cache=cache).logits]
    assert (torch.cat(parts, 1) - loaded(ids).logits).abs().max() <= 1e-5 and cache.get_seq_length() == 33
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        logits = ours(ids)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert again(ids, labels=labels).loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.fixture
def out_of_tree():
    """The module of an out-of-tree mixer (``cumulative_mean``). The test imports it, which registers the mixer,
    and drops it from ``sys.modules``; both are put back as they were, so later tests see the registry they expect."""
    name, mixer = "tests.zoo.out_of_tree_mixer", "cumulative_mean"
    module, entry = sys.modules.get(name), MIXERS.entries.get(mixer)
    yield name
    for table, key, value in ((sys.modules, name, module), (MIXERS.entries, mixer, entry)):
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def test_a_model_with_an_out_of_tree_mixer_loads_once_its_module_is_imported(tmp_path, capsys, out_of_tree):
    module = out_of_tree
    recipe = zoo.load({"imports": [module], "model": {"d_model": 16, "layers": ["cumulative_mean", "gla"]},
                       "task": {"name": "lm", "seq_len": 16}})
    run = write_run(tmp_path, recipe)
    assert "--imports" in one_line_error(capsys, "export", run, "--to", tmp_path / "hf")
    assert zoo_main(["export", run, "--to", str(tmp_path / "hf"), "--imports", module]) == 0
    hint = capsys.readouterr().out   # how to load it names the module to import first, as the model card does
    assert f"load it with: import zoo.hf; import {module}; AutoModelForCausalLM.from_pretrained(" in hint, hint
    assert f"\nimport {module}  #" in (tmp_path / "hf" / "README.md").read_text()
    ours, _ = load_lm(run, imports=[module])
    ids = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        assert (AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits - ours(ids)).abs().max() <= 1e-5
    del sys.modules[module]  # as in a fresh process that has not imported it: loading imports nothing
    with pytest.raises(ValueError, match=f"defined in \\['{module}'\\]; import them"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_sampling_on_the_state_draws_what_sampling_without_a_cache_draws(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(export(write_run(tmp_path, hybrid_recipe()), tmp_path / "hf"))
    prompt = torch.randint(0, 256, (1, int(torch.randint(3, 10, ()))))
    seed = int(torch.randint(1 << 30, ()))
    draws = []
    for use_cache in (True, False):
        torch.manual_seed(seed)
        draws.append(model.generate(prompt, do_sample=True, temperature=1.5, top_k=100, max_new_tokens=10,
                                    use_cache=use_cache))
    assert torch.equal(draws[0], draws[1])
    # EOS suppressed: a greedy EOS among the first 4 tokens would end the 9-token call there and not the resumed one
    no_eos = dict(suppress_tokens=[EOS])
    first = model.generate(prompt, max_new_tokens=4, return_dict_in_generate=True, **no_eos, **{CACHE_FIELD: ZooCache()})
    resumed = model.generate(first.sequences, max_new_tokens=5, **no_eos, **{CACHE_FIELD: getattr(first, CACHE_FIELD)})
    assert resumed.shape[1] == prompt.shape[1] + 9
    assert torch.equal(resumed, model.generate(prompt, max_new_tokens=9, **no_eos))
    ids = torch.randint(0, 256, (2, 6))
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():  # right padding is harmless when scoring: every layer is causal
        assert (model(ids, attention_mask=right).logits[1, :4] - model(ids[1:, :4]).logits[0]).abs().max() <= 1e-5
    for mask in (right.flip(1), right):  # before decoding, padding would enter the states
        with pytest.raises(ValueError, match="recurrent state"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_the_exported_tokenizers_encode_as_the_zoo_tokenizers_do(tmp_path):
    text = bytes(torch.randint(0, 256, (300,)).tolist()).decode("utf-8", errors="replace") + " <|endoftext|> é π"
    tok = AutoTokenizer.from_pretrained(export(write_run(tmp_path, lm_recipe(["gla"])), tmp_path / "bytes"))
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text) and tok.eos_token_id == EOS
    assert tok.decode(tok(text)["input_ids"]) == text

    tokenizers = pytest.importorskip("tokenizers")  # a dependency of transformers
    corpus = "the state of the mixer is the state of the scan; the key decays and the gate opens. " * 6
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", 0)])  # a BOS the zoo never adds: the export drops it too
    bpe.train_from_iterator([corpus], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    run = write_run(tmp_path, lm_recipe(["gla"], task={"tokenizer": str(tmp_path / "tokenizer.json")}), "bpe_run")
    tok = AutoTokenizer.from_pretrained(export(run, tmp_path / "bpe"))
    zoo_tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    sample = "the gate of the scan decays; " + text[:40]
    assert tok(sample)["input_ids"] == zoo_tok.encode(sample) and tok.eos_token_id == zoo_tok.eos_id == 0


def test_the_harness_hf_model_scores_as_the_zoo_adapter_does(tmp_path):
    from lm_eval.api.instance import Instance  # the test extra installs lm-eval[hf]
    from lm_eval.api.registry import get_model

    run = write_run(tmp_path, hybrid_recipe())
    harness = get_model("hf").create_from_arg_string(f"pretrained={export(run, tmp_path / 'hf')},dtype=float32,"
                                                     f"device=cpu,batch_size=1")
    scorer = ZooScorer.from_checkpoint(run)
    pairs = [("the key", " decays"), ("", "state"), ("a gate é", " opens π"), ("x", "y" * 30)]
    got = harness.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                                disable_tqdm=True)
    for (ll, greedy), pair in zip(got, pairs):
        zoo_ll, zoo_greedy = scorer.loglikelihood(*pair)
        assert ll == pytest.approx(zoo_ll, rel=1e-5, abs=1e-5) and greedy == zoo_greedy
    texts = ["the scan", "state mixer é"]
    rolled = harness.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)],
                                           disable_tqdm=True)
    assert rolled == pytest.approx([scorer.loglikelihood_rolling(t) for t in texts], rel=1e-5, abs=1e-5)


def one_line_error(capsys, *argv) -> str:
    assert zoo_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo: error: ") and "Traceback" not in err
    return err


def test_every_refusal_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    mqar = zoo.load({"model": {"d_model": 16, "layers": ["gla"]},
                     "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2}})
    other = tmp_path / "mqar"
    ckpt.save(other / ckpt.FILENAME, {"recipe": mqar.plain, "recipe_key": mqar.key, "imports": [], "step": 1,
                                      "model": zoo.build_model(mqar).state_dict(), "finished": True})
    assert "not a language model" in one_line_error(capsys, "export", other, "--to", tmp_path / "a")
    run = write_run(tmp_path, lm_recipe(["gla"]))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "not an empty folder" in one_line_error(capsys, "export", run, "--to", tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["notes.txt"]
    monkeypatch.setitem(sys.modules, "transformers", None)  # the hf extra not installed
    for module in [m for m in sys.modules if m == "zoo.hf" or m.startswith("zoo.hf.")]:
        monkeypatch.delitem(sys.modules, module)
    assert "pip install 'mixer-zoo[hf]'" in one_line_error(capsys, "export", run, "--to", tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["full", "mqar", "run"]  # no export and no temporary folder


def test_an_export_to_a_file_says_it_is_a_file_and_leaves_it(tmp_path, capsys):
    run = write_run(tmp_path, lm_recipe(["gla"]))
    (tmp_path / "afile").write_text("mine")
    err = one_line_error(capsys, "export", run, "--to", tmp_path / "afile")
    assert f"{tmp_path / 'afile'}: is a file, not a folder" in err, err
    assert (tmp_path / "afile").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile", "run"]


def test_an_export_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    from zoo.hf import export as exporter
    run = write_run(tmp_path, lm_recipe(["gla"]))
    (tmp_path / "empty").mkdir()

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter.hf_tokenizer, "save", broken)
    with pytest.raises(zoo.UserError, match="No space left"):
        exporter.export(run, tmp_path / "empty")
    assert sorted(os.listdir(tmp_path)) == ["empty", "run"] and not os.listdir(tmp_path / "empty")


def test_export_of_an_unfinished_run_says_so_on_stderr(tmp_path, capsys):
    """An interrupted run's checkpoint exports (it is a model), with a line saying it is partly trained, as zoo eval
    says of it; a finished run's export says nothing of the kind."""
    steps = int(torch.randint(3, 9, ()))
    recipe = lm_recipe(["gla"])
    recipe = zoo.load({**recipe.plain, "train": {**recipe.plain["train"], "steps": steps}})
    model = zoo.build_model(recipe)
    state = {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": ckpt.imports_for(recipe),
             "model": model.state_dict(), "step": steps - 1, "finished": False}
    ckpt.save(tmp_path / "cut" / ckpt.FILENAME, state)
    export(str(tmp_path / "cut"), tmp_path / "hf_cut")
    err = capsys.readouterr().err
    assert f"is the checkpoint of an unfinished run (step {steps - 1} of {steps})" in err, err
    ckpt.save(tmp_path / "done" / ckpt.FILENAME, {**state, "step": steps, "finished": True})
    export(str(tmp_path / "done"), tmp_path / "hf_done")
    assert "unfinished" not in capsys.readouterr().err


def test_an_export_loads_with_another_kernel_backend_to_the_same_logits(tmp_path):
    """``from_pretrained(DIR, kernel_backend=...)``: a model trained with ``backend: triton`` on a GPU runs on a CPU
    with ``torch`` (here the reverse, through the interpreter), every layer with a backend option switched, the
    same logits; a backend no layer takes is refused naming it."""
    run = write_run(tmp_path, lm_recipe([{"gla": {"backend": "torch"}}, "attention", {"mamba2": {"backend": "torch"}}]))
    hf = export(run, tmp_path / "hf")
    as_trained = AutoModelForCausalLM.from_pretrained(hf)
    other = AutoModelForCausalLM.from_pretrained(hf, kernel_backend="triton")
    backends = [getattr(m.options, "backend", None) for m in other.zoo.modules() if isinstance(m, Mixer)]
    assert backends == ["triton", "triton", "triton"] and other.config.kernel_backend == "triton"
    assert [getattr(m.options, "backend", None) for m in as_trained.zoo.modules() if isinstance(m, Mixer)] \
        == ["torch", "auto", "torch"]
    ids = torch.randint(0, 257, (2, int(torch.randint(5, 30, ()))))
    with torch.no_grad():
        assert torch.allclose(other(ids).logits, as_trained(ids).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="kernel_backend='cuda_magic'"):
        AutoModelForCausalLM.from_pretrained(hf, kernel_backend="cuda_magic")
