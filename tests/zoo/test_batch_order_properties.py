"""The order in which training reads a generated training set (zoo.training.state.TrainState): every epoch
is a shuffled order of the whole set, so a run of ``num_train / batch_size`` steps reads every example exactly
once, and a batch size that does not divide the set never repeats an example within an epoch."""
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.state import TrainState

from .test_train import TINY

CPU = torch.device("cpu")


def _state(num_train: int, seed: int) -> TrainState:
    recipe = resolve(TINY, [f"seed={seed}", "model.d_model=16", "model.layers=[attention]",
                            "model.mixer_options={attention: {n_heads: 2}}"])
    return TrainState.fresh(recipe, HybridLM.from_recipe(recipe, vocab_size=32), num_train, "fp32", CPU)


def test_each_epoch_reads_every_example_exactly_once_when_the_batch_divides_the_set():
    batch = int(torch.randint(2, 9, ()))
    epochs, per_epoch = 3, int(torch.randint(2, 6, ()))
    num_train = batch * per_epoch
    state = _state(num_train, int(torch.randint(1000, ())))
    for _ in range(epochs):
        seen = torch.cat([state.next_indices(batch) for _ in range(per_epoch)])
        assert sorted(seen.tolist()) == list(range(num_train))


def test_a_batch_that_does_not_divide_the_set_never_repeats_an_example_within_an_epoch():
    batch = int(torch.randint(3, 9, ()))
    num_train = batch * int(torch.randint(2, 6, ())) + int(torch.randint(1, batch, ()))
    state = _state(num_train, int(torch.randint(1000, ())))
    full = num_train // batch  # whole batches an epoch holds; the rest waits for the next shuffle
    for _ in range(3):
        seen = torch.cat([state.next_indices(batch) for _ in range(full)])
        assert len(set(seen.tolist())) == full * batch
