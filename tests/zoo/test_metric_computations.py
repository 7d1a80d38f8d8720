"""The reported numbers against independent computations: accuracy and loss pooled over the supervised
positions of batches of different sizes, bits per byte, the learning-rate schedule, one AdamW step with
declared weight decay, gradient accumulation on a task whose micro-batches hold different numbers of
supervised positions, and the MQAR layout and seeds."""
import math

import pytest
import torch

from mixers.options import build_options
from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.tasks import TASKS, TaskData
from zoo.training.evaluation import evaluate_data, text_metrics
from zoo.training.optim import lr_at, make_optimizer

from .test_train import TINY

CPU = torch.device("cpu")


class TokenLogits(torch.nn.Module):
    """A stand-in model: the logits at a position are row ``ids[t]`` of a fixed ``(V, V)`` table."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids, mask=None):
        return self.table[ids]


def hand_metrics(table, data):
    """Loss, accuracy and sequence accuracy by plain Python over every supervised position (sequence accuracy
    over the rows with at least one)."""
    nats, right, count, exact, judged = 0.0, 0, 0, 0, 0
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        all_right = True
        if all(label == -100 for label in y):
            continue
        for token, label in zip(x, y):
            if label == -100:
                continue
            row = table[token].tolist()
            nats += math.log(sum(math.exp(v) for v in row)) - row[label]
            hit = max(range(len(row)), key=row.__getitem__) == label
            right, count, all_right = right + hit, count + 1, all_right and hit
        exact, judged = exact + all_right, judged + 1
    return {"loss": nats / count, "accuracy": right / count, "sequence_accuracy": exact / judged}


def data_with_uneven_supervision(generator, V=6, rows=7, T=5, empty_rows=()):
    inputs = torch.randint(V, (rows, T), generator=generator)
    labels = torch.randint(V, (rows, T), generator=generator)
    keep = torch.rand(rows, T, generator=generator) < 0.4
    keep[:, 0] = True
    keep[list(empty_rows)] = False
    return TaskData(inputs, torch.where(keep, labels, -100))


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7, 100])
def test_accuracy_and_loss_pool_every_supervised_position_whatever_the_batch_size(batch_size):
    """Batches of different sizes (a short last one) and rows with different numbers of supervised positions:
    every supervised position weighs the same, as in one pass over the whole set."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(6, 6, generator=g, dtype=torch.float64)
    data = data_with_uneven_supervision(g)
    got = evaluate_data(TokenLogits(table), data, batch_size, CPU)
    want = hand_metrics(table, data)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_batch_without_supervised_positions_leaves_the_metrics_finite(batch_size):
    """A row with nothing supervised (mad_recall's rows where no key repeats) can make a whole evaluation batch
    unsupervised, most often the short last one; it adds nothing to the loss and must not turn the loss and the
    accuracy of the whole set into NaN. Such a row has nothing to get right: the sequence accuracy leaves it out
    (counted as right, a task with many such rows would report a high sequence accuracy for any model)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 32, ())))  # from the test's seed: replayable
    table = torch.randn(6, 6, generator=g, dtype=torch.float64)
    data = data_with_uneven_supervision(g, rows=5, empty_rows=[1, 4])
    got = evaluate_data(TokenLogits(table), data, batch_size, CPU)
    want = hand_metrics(table, data)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["accuracy"] == pytest.approx(want["accuracy"], rel=1e-9)
    assert got["sequence_accuracy"] == pytest.approx(want["sequence_accuracy"], rel=1e-9)
    # the same model on the supervised rows alone
    labelled = torch.tensor([0, 2, 3])
    alone = evaluate_data(TokenLogits(table), data.batch(labelled), batch_size, CPU)
    assert got["sequence_accuracy"] == pytest.approx(alone["sequence_accuracy"], rel=1e-9)


def test_a_mad_recall_evaluation_at_a_short_length_is_finite():
    """The case above as a task produces it: mad_recall at L = 4 (two pairs; the second key repeats the first
    with probability 1 / (V/2)) leaves most rows unsupervised; an evaluation one row a batch still reads."""
    cls = TASKS.get("mad_recall")
    task = cls(build_options(cls.Options, {"vocab_size": 8, "seq_len": 4}))
    data = task.make("test", seed=0, num_examples=40)
    supervised = (data.labels != -100).sum(1)
    assert (supervised == 0).any() and (supervised > 0).any()
    table = torch.randn(8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = evaluate_data(TokenLogits(table), data, 1, CPU)
    assert got["accuracy"] == pytest.approx(hand_metrics(table, data)["accuracy"], rel=1e-9)


def test_bits_per_byte_and_position_losses_pool_over_a_short_last_batch():
    """bpb = summed nats / ln 2 / summed bytes of the target tokens, tokens of different byte lengths, a last
    batch shorter than the others; the position buckets are means over every row."""
    g = torch.Generator().manual_seed(3)
    V, T, rows = 5, 6, 5
    table = torch.randn(V, V, generator=g, dtype=torch.float64)
    ids = torch.randint(V, (rows, T + 1), generator=g)
    data = TaskData(ids[:, :-1], ids[:, 1:])
    token_bytes = torch.tensor([1, 2, 3, 1, 4])
    out = text_metrics(TokenLogits(table), data, token_bytes, 2, CPU, buckets=2)
    losses = torch.logsumexp(table[data.inputs], -1) - table[data.inputs].gather(-1, data.labels[..., None])[..., 0]
    assert out["bpb"] == pytest.approx(losses.sum().item() / math.log(2) / token_bytes[data.labels].sum().item(),
                                       rel=1e-12)
    assert out["ppl"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-12)
    assert out["loss@pos0-2"] == pytest.approx(losses[:, :3].mean().item(), rel=1e-12)
    assert out["loss@pos3-5"] == pytest.approx(losses[:, 3:].mean().item(), rel=1e-12)


def test_the_schedule_warms_up_to_the_peak_and_decays_to_the_floor():
    recipe = resolve(TINY, ["train.steps=20", "train.warmup_steps=4", "train.min_lr_ratio=0.2"])
    assert [lr_at(s, recipe) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    for s in range(4, 21):
        progress = (s - 4) / 16
        assert lr_at(s, recipe) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * progress)), rel=1e-12)
    assert lr_at(20, recipe) == pytest.approx(0.2) and lr_at(25, recipe) == pytest.approx(0.2)
    no_warmup = resolve(TINY, ["train.steps=10", "train.warmup_steps=0"])
    assert lr_at(0, no_warmup) == pytest.approx(1.0)


def test_one_adamw_step_matches_a_hand_computation_with_and_without_decay():
    """The first AdamW step from ``make_optimizer``: ``p -= lr * (wd * p + m / (sqrt(v) + eps))`` with the
    bias-corrected moments; ``lr`` is the schedule's at step 0. In this model every matrix (and the short
    convolution's taps) is decayed; the tied embedding and every vector (gains, biases, A_log, dt_bias, D) is not."""
    lr, wd, warmup = 0.05, 0.3, 4
    recipe = resolve(TINY, [f"train.lr={lr}", f"train.weight_decay={wd}", f"train.warmup_steps={warmup}",
                            "train.betas=[0.8, 0.9]"])
    model = HybridLM.from_recipe(recipe, vocab_size=12)
    optimizer, _scheduler = make_optimizer(model, recipe)
    g = torch.Generator().manual_seed(4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    optimizer.step()
    step_lr = lr / warmup
    b1, b2, eps = 0.8, 0.9, 1e-8
    for n, p in model.named_parameters():
        m_hat = (1 - b1) * grads[n] / (1 - b1)
        v_hat = (1 - b2) * grads[n] ** 2 / (1 - b2)
        # the embedding, gains, biases and the recurrence's vectors are undecayed, every matrix decays
        decay = 0.0 if (n == "embed.weight" or p.dim() < 2) else wd
        want = before[n] * (1 - step_lr * decay) - step_lr * m_hat / (v_hat.sqrt() + eps)
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-7, msg=n)


def test_gradient_accumulation_gives_the_full_batch_step_when_micro_batches_hold_different_counts():
    """mad_recall supervises only repeated keys, so the micro-batches of a step hold different numbers of
    supervised positions: ``grad_accum=4`` must still make the step of the whole batch's mean loss."""
    import zoo
    base = {"seed": 3, "model": {"d_model": 16, "layers": ["attention"], "mixer_options": {"attention": {"n_heads": 2}}},
            "task": {"name": "mad_recall", "vocab_size": 16, "seq_len": 12, "num_train": 64, "num_test": 8},
            "train": {"steps": 2, "batch_size": 16, "warmup_steps": 0, "threads": 1, "grad_clip": 0}}
    task_counts = TASKS.get("mad_recall")(build_options(TASKS.get("mad_recall").Options,
                                                        {"vocab_size": 16, "seq_len": 12}))
    counts = (task_counts.make("train", 3, num_examples=16).labels != -100).view(4, 4, -1).sum((1, 2))
    assert len(set(counts.tolist())) > 1  # the micro-batches differ
    one = zoo.train(resolve(base), progress=False)
    four = zoo.train(resolve(base, ["train.grad_accum=4"]), progress=False)
    for (name, a), b in zip(one.model.state_dict().items(), four.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert one.metrics["train_loss"] == pytest.approx(four.metrics["train_loss"], rel=1e-5)
    assert one.metrics["train_accuracy"] == pytest.approx(four.metrics["train_accuracy"], rel=1e-9)


def test_mqar_queries_ask_every_key_once_and_seeds_select_the_data():
    cls = TASKS.get("mqar")
    task = cls(build_options(cls.Options, {"vocab_size": 40, "seq_len": 24, "num_kv_pairs": 3}))
    data = task.make("test", seed=5)
    assert torch.equal(data.inputs, task.make("test", seed=5).inputs)
    assert not torch.equal(data.inputs, task.make("test", seed=6).inputs)
    assert not torch.equal(data.inputs[:50], task.make("train", seed=5).inputs[:50])
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        binding = dict(zip(x[0:6:2], x[1:6:2]))
        asked = [(t, x[t], y[t]) for t in range(24) if y[t] != -100]
        assert sorted(k for _, k, _ in asked) == sorted(binding)
        assert all(t >= 6 and (t - 6) % 2 == 0 and binding[k] == v for t, k, v in asked)
        assert m == [1.0] * 6 + [0.0] * 18


def test_gradient_accumulation_hands_the_optimizer_the_full_batch_gradient(monkeypatch):
    """The gradient AdamW receives at the first step is the whole batch's mean-loss gradient for every
    ``grad_accum``: AdamW's update sees a constant scale of the gradient (a 1/K) only through its eps, so the
    gradient itself is compared."""
    import zoo

    seen: list[dict] = []
    step = torch.optim.AdamW.step

    def recording(self, *args, **kwargs):
        params = [p for group in self.param_groups for p in group["params"]]
        seen.append({i: p.grad.clone() for i, p in enumerate(params) if p.grad is not None})
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    k = int(torch.randint(2, 5, ()))
    base = {"seed": int(torch.randint(100, ())), "model": {"d_model": 16, "layers": ["mamba2"],
                                                           "mixer_options": {"mamba2": {"headdim": 8, "d_state": 4}}},
            "task": {"name": "mad_recall", "vocab_size": 16, "seq_len": 12, "num_train": 64, "num_test": 8},
            "train": {"steps": 1, "batch_size": 4 * k, "warmup_steps": 0, "threads": 1, "grad_clip": 0}}
    zoo.train(resolve(base), progress=False)
    zoo.train(resolve(base, [f"train.grad_accum={k}"]), progress=False)
    whole, accumulated = seen
    assert whole.keys() == accumulated.keys() and whole
    for i in whole:
        torch.testing.assert_close(accumulated[i], whole[i], rtol=1e-4, atol=1e-7, msg=f"parameter {i}")
