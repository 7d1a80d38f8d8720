"""The exported model's loss as transformers' ``Trainer`` uses it: its ``forward`` takes ``**kwargs``, so the
Trainer passes ``num_items_in_batch`` (the supervised tokens of the whole accumulated batch) and does not divide
the loss by the accumulation steps itself. Micro-batch losses must then add up to the whole batch's mean token
loss, and a step with gradient accumulation must equal one step on the whole batch. Tiny models made here;
nothing downloads."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zoo
from tests.zoo.untrained import wake_zero_initialised

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from zoo.hf import ZooConfig, ZooForCausalLM  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def tiny_model() -> ZooForCausalLM:
    recipe = zoo.load({"model": {"d_model": 16, "layers": [{"gla": {"n_heads": 2, "head_dim": 8}}, "attention"]},
                       "task": {"name": "lm", "seq_len": 16}})
    model = ZooForCausalLM(ZooConfig(recipe=recipe.plain, recipe_key=recipe.key, vocab_size=257))
    wake_zero_initialised(model.zoo)
    return model


def batch(n: int = 4, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with a different number of supervised positions in every row."""
    ids = torch.randint(0, 257, (n, length))
    labels = ids.clone()
    for row, cut in enumerate(torch.randperm(length - 2)[:n].tolist()):
        labels[row, :cut + 1] = -100
    return ids, labels


def mean_token_loss(model, ids, labels) -> torch.Tensor:
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def test_micro_batch_losses_given_the_batch_item_count_add_up_to_the_batch_mean():
    model = tiny_model().eval()
    ids, labels = batch()
    items = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        whole = mean_token_loss(model, ids, labels)
        assert model(ids, labels=labels).loss.item() == pytest.approx(whole.item(), rel=1e-6)  # no count: the mean
        parts = [model(ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=torch.tensor(items)).loss
                 for i in (0, 2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-5)


def test_a_trainer_step_with_gradient_accumulation_is_one_step_on_the_whole_batch(tmp_path):
    pytest.importorskip("accelerate")  # the Trainer needs it
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __init__(self, ids, labels):
            self.ids, self.labels = ids, labels

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    ids, labels = batch()
    model = tiny_model()
    lr = 0.5
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    mean_token_loss(model, ids, labels).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            expected[name] -= lr * p.grad
    model.zero_grad()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=lr, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_drop_last=False, seed=0, data_seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(ids, labels))
    trainer.train()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-4, atol=1e-5, msg=name)
