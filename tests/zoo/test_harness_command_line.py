"""``python -m zoo.lm_harness`` as the README runs it: registering the model ``zoo`` leaves the harness's own
models (``--model hf`` for an exported folder) loadable, and the harness's default device (``cuda:0``, passed
unless ``--device`` says otherwise) scores on the CPU where no CUDA device is available, as its ``hf`` model
does. Tiny models made here; nothing downloads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from tests.zoo.untrained import wake_zero_initialised
from zoo.lm_harness import ZooScorer
from zoo.training import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


def write_run(folder) -> str:
    recipe = zoo.load({"model": {"d_model": 16, "layers": [{"gla": {"n_heads": 2, "head_dim": 8}}]},
                       "task": {"name": "lm", "seq_len": 16}, "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})
    model = wake_zero_initialised(zoo.build_model(recipe))
    ckpt.save(folder / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                       "model": model.state_dict(), "step": 1, "finished": True})
    return str(folder)


def test_registering_the_zoo_model_keeps_the_harness_own_models():
    """In a fresh interpreter (the harness's registry is process-wide): ``register()`` first, as ``main`` does,
    then both ``zoo`` and the harness's ``hf`` load by name."""
    pytest.importorskip("lm_eval")
    code = ("from zoo.lm_harness import register\n"
            "register()\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('zoo').__name__, get_model('hf').__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ZooHarnessLM", "HFLM"], done.stdout


def test_the_harness_default_device_scores_on_the_cpu_without_cuda(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from zoo.lm_harness import register

    run = write_run(tmp_path / "run")
    register()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # what the harness's evaluator hands every model besides --model_args (its config's default device)
    harness = get_model("zoo").create_from_arg_string(f"checkpoint={run}", {"batch_size": 1, "max_batch_size": None,
                                                                             "device": "cuda:0"})
    assert harness.scorer.device == torch.device("cpu")
    words = ["state", "mixer", "scan", "key", "gate"]
    pick = torch.randint(len(words), (3,)).tolist()
    pair = (" ".join(words[i] for i in pick[:2]), " " + words[pick[2]])
    (got,) = harness.loglikelihood([Instance("loglikelihood", {}, pair, 0)])
    assert got == ZooScorer.from_checkpoint(run).loglikelihood(*pair)
    explicit = get_model("zoo").create_from_arg_string(f"checkpoint={run}", {"device": "cpu"})
    assert explicit.scorer.device == torch.device("cpu")


def test_a_checkpoint_the_harness_cannot_score_is_refused_in_one_line(tmp_path, monkeypatch):
    """A checkpoint that is not a language model's, handed to ``python -m zoo.lm_harness --model zoo``, ends the
    command with one line naming the harness model (a traceback that named ``zoo generate`` before)."""
    pytest.importorskip("lm_eval")
    from zoo.lm_harness import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))   # main hands the harness its arguments through sys.argv
    recipe = zoo.load({"model": {"d_model": 16, "layers": ["attention"]},
                       "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2},
                       "train": {"steps": 1, "batch_size": 2, "warmup_steps": 0}})
    run = tmp_path / f"run{int(torch.randint(100, ()))}"
    ckpt.save(run / ckpt.FILENAME, {"recipe": recipe.plain, "recipe_key": recipe.key, "imports": [],
                                    "model": zoo.build_model(recipe).state_dict(), "step": 1, "finished": True})
    with pytest.raises(SystemExit) as ended:
        main(["--model", "zoo", "--model_args", f"checkpoint={run}", "--tasks", "lambada_openai", "--device", "cpu"])
    assert str(ended.value) == (f"python -m zoo.lm_harness: error: {run / ckpt.FILENAME}: trained on task 'mqar', "
                                f"not a language model (task: lm); lm_eval --model zoo needs an lm checkpoint")
