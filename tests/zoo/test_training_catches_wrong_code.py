"""Training's numbers against independent computations (zoo.training): the gradient the first AdamW update reads
is the gradient of the mean cross-entropy over the supervised positions of the first batch, recomputed here by
autograd on a model built from the recipe's seed; micro-batches split a batch as ``torch.chunk`` does; time
after the warm-up's last step is steady time; only fp16 keeps a gradient scaler; the loss by position bucket
averages each bucket over its own positions; a resumed run stopped before its next checkpoint names the step its
folder holds; and the checkpoint helpers refuse or keep what they say."""
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zoo import train
from zoo.errors import UserError
from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.tasks import TaskData
from zoo.training import checkpoint as ckpt
from zoo.training import loop, throughput
from zoo.training.evaluation import text_metrics
from zoo.training.state import ORDER_SEED_OFFSET, TrainState
from zoo.training.throughput import Throughput

from .test_interrupted_run_path import _interrupt_at_step
from .test_metric_computations import TokenLogits
from .test_reported_training_numbers_properties import initial_model_and_first_batch
from .test_train import TINY

CPU = torch.device("cpu")
SMALL = ["model.d_model=16", "model.layers=[attention]", "model.mixer_options={attention: {n_heads: 2}}",
         "train.eval_every=0", "task.num_test=16"]


def _first_batch_gradient(recipe) -> dict:
    """By hand: the gradient of the mean cross-entropy over the supervised positions of the first batch, for the
    model the recipe's seed builds and the batch the order generator draws first."""
    model, batch = initial_model_and_first_batch(recipe)
    supervised = batch.labels != -100
    assert 0 < supervised.sum() < supervised.numel()  # unsupervised positions that must not count
    logits = model(batch.inputs, mask=batch.mask)
    F.cross_entropy(logits[supervised], batch.labels[supervised]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_first_update_reads_the_gradient_of_the_mean_loss_over_the_supervised_positions(grad_accum):
    seed = int(torch.randint(1000, ()))
    recipe = resolve(TINY, [f"seed={seed}", *SMALL, "train.steps=1", "train.warmup_steps=1", "train.grad_clip=0",
                            f"train.grad_accum={grad_accum}"])
    want = _first_batch_gradient(recipe)
    seen = []

    def record(optimizer, args, kwargs):
        seen.append({id(p): p.grad.clone() for group in optimizer.param_groups for p in group["params"]})

    handle = register_optimizer_step_pre_hook(record)
    try:
        model = train(recipe, progress=False).model
    finally:
        handle.remove()
    assert len(seen) == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(seen[0][id(p)], want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_micro_batches_split_a_batch_into_the_row_counts_of_torch_chunk():
    for _ in range(20):
        parts = int(torch.randint(1, 6, ()))
        rows = parts * int(torch.randint(1, 9, ())) + int(torch.randint(0, 2, ())) * int(torch.randint(0, parts, ()))
        want = [len(c) for c in torch.arange(rows).chunk(parts)]
        assert loop._micro_batch_sizes(rows, parts) == want, (rows, parts)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_only_fp16_training_scales_its_gradients(precision):
    recipe = resolve(TINY, SMALL)
    state = TrainState.fresh(recipe, HybridLM.from_recipe(recipe, vocab_size=32), 16, precision, CPU)
    assert state.scaler.is_enabled() == (precision == "fp16")
    assert bool(state.state_dict()["scaler"]) == (precision == "fp16")


def test_the_loss_of_each_position_bucket_is_the_mean_over_its_own_positions_when_buckets_differ_in_size():
    V, rows = 5, int(torch.randint(2, 6, ()))
    T, buckets = int(torch.randint(2, 4, ())) * 3 + 1, 3  # 7 or 10 positions: the buckets differ in size
    table = torch.randn(V, V, dtype=torch.float64)
    ids = torch.randint(V, (rows, T + 1))
    data = TaskData(ids[:, :-1], ids[:, 1:])
    out = text_metrics(TokenLogits(table), data, torch.ones(V, dtype=torch.long), 2, CPU, buckets=buckets)
    logits = table[data.inputs]
    losses = torch.logsumexp(logits, -1) - logits.gather(-1, data.labels[..., None])[..., 0]
    size = math.ceil(T / buckets)
    for first in range(0, T, size):
        last = min(first + size, T) - 1
        want = losses[:, first:last + 1].mean().item()
        assert out[f"loss@pos{first}-{last}"] == pytest.approx(want, rel=1e-12), (first, last)


def test_a_checkpoint_whose_recipe_now_resolves_to_another_key_is_refused(tmp_path):
    key = f"k{int(torch.randint(10**6, ()))}"
    ckpt.check_same_model(tmp_path, {"recipe_key": key}, key)
    with pytest.raises(UserError, match="no longer resolves to the key it was trained under"):
        ckpt.check_same_model(tmp_path, {"recipe_key": key}, key + "x")


def test_a_temporary_checkpoint_file_of_another_users_live_process_is_kept(tmp_path, monkeypatch):
    """``os.kill(pid, 0)`` raising PermissionError means the process lives (under another user): its write in
    progress is kept; a process that is gone leaves a file that is removed."""
    pid = int(torch.randint(10**5, 10**6, ()))
    tmp = tmp_path / f".{ckpt.FILENAME}.{pid}.tmp"
    tmp.write_bytes(os.urandom(8))

    def kill(raised):
        def fake(target, signal):
            assert (target, signal) == (pid, 0)
            raise raised()
        return fake

    monkeypatch.setattr(ckpt.os, "kill", kill(PermissionError))
    assert ckpt.remove_orphans(tmp_path) == [] and tmp.exists()
    monkeypatch.setattr(ckpt.os, "kill", kill(ProcessLookupError))
    assert ckpt.remove_orphans(tmp_path) == [tmp] and not tmp.exists()


def test_a_resumed_run_stopped_before_its_next_checkpoint_names_the_step_the_folder_holds(tmp_path, monkeypatch,
                                                                                          capsys):
    every = int(torch.randint(2, 4, ()))
    recipe = resolve(TINY, [*SMALL, "train.steps=12", f"train.checkpoint_every={every}", "train.batch_size=8"])
    _interrupt_at_step(monkeypatch, every + 2)
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False, checkpoint_dir=tmp_path)
    capsys.readouterr()
    assert ckpt.load(tmp_path / ckpt.FILENAME)["step"] == every
    _interrupt_at_step(monkeypatch, 1)  # the resumed process stops before writing anything
    with pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False, checkpoint_dir=tmp_path)
    said = capsys.readouterr().err
    assert f"stopped by Ctrl-C at step {every}/12; {tmp_path / ckpt.FILENAME} holds step {every}" in said, said


def test_time_after_the_warmups_last_step_is_steady_time_even_across_a_pause(monkeypatch):
    """The steady phase begins once the warm-up's last step is done: host time between that step and a pause (an
    evaluation) belongs to the first steady step's lap, and the pause to neither clock."""
    now = [float(torch.randint(10**6, ()))]
    monkeypatch.setattr(throughput, "clock", lambda: now[0])
    warm = int(torch.randint(2, 5, ()))
    warm_steps, before, after = torch.rand(warm).add(1).tolist(), float(torch.rand(())), float(torch.rand(()))
    t = Throughput()
    t.start(CPU, warm)
    for dt in warm_steps:
        now[0] += dt
        t.step()
    now[0] += before
    with t.paused():
        now[0] += 1000.0
    now[0] += after
    t.step()
    t.stop()
    assert t.warmup_seconds == pytest.approx(sum(warm_steps), rel=1e-12)
    assert t.steady_steps == 1 and t.steady_seconds == pytest.approx(before + after, rel=1e-9)


class WindowStream:
    """A stand-in stream: a batch is ``batch_size`` window starts drawn with the generator it is handed."""

    def draw(self, batch_size, generator):
        return torch.randint(10**6, (batch_size,), generator=generator)


def test_a_stream_draws_its_windows_from_the_order_generator_and_a_loaded_state_goes_on_drawing_them():
    seed, batch = int(torch.randint(1000, ())), int(torch.randint(2, 6, ()))
    recipe = resolve(TINY, [f"seed={seed}", *SMALL])
    running = TrainState.fresh(recipe, HybridLM.from_recipe(recipe, vocab_size=32), None, "fp32", CPU)
    order = torch.Generator().manual_seed(seed + ORDER_SEED_OFFSET)
    stream = WindowStream()
    for _ in range(3):  # successive steps read new windows, in the order generator's sequence
        assert torch.equal(running.next_batch(stream, batch), stream.draw(batch, order))
    saved = running.state_dict()
    resumed = TrainState.fresh(resolve(TINY, [f"seed={seed + 1}", *SMALL]),
                               HybridLM.from_recipe(recipe, vocab_size=32), None, "fp32", CPU)
    resumed.load_state_dict(saved)
    for _ in range(2):
        assert torch.equal(resumed.next_batch(stream, batch), running.next_batch(stream, batch))
