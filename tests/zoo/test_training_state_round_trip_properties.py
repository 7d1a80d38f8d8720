"""A training state saved mid-run and loaded into a freshly built one (zoo.training.state.TrainState) goes on as the
saved one would: the learning curve of periodic evaluations written before the save, the step, the running averages
and the finished flag come back as they were saved, and the batches read after the load are those the saved state
reads next, past an epoch's end too."""
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.state import TrainState

from .test_train import TINY

CPU = torch.device("cpu")


def _state(recipe, num_train: int) -> TrainState:
    return TrainState.fresh(recipe, HybridLM.from_recipe(recipe, vocab_size=32), num_train, "fp32", CPU)


def _recipe(seed: int):
    return resolve(TINY, [f"seed={seed}", "model.d_model=16", "model.layers=[attention]",
                          "model.mixer_options={attention: {n_heads: 2}}"])


def test_a_loaded_state_has_the_saved_curve_step_and_averages_and_reads_the_same_batches_next():
    seed = int(torch.randint(1000, ()))
    batch, num_train = int(torch.randint(2, 6, ())), int(torch.randint(12, 30, ()))
    running = _state(_recipe(seed), num_train)
    steps = int(torch.randint(num_train // batch + 1, 3 * num_train // batch + 2, ()))  # past an epoch's end
    losses, accuracies = torch.rand(steps).tolist(), torch.rand(steps).tolist()
    curve = []
    for k in range(steps):
        running.next_indices(batch)
        running.record(losses[k], accuracies[k])
        if k % 2:
            curve.append({"step": k + 1, "test_loss": float(torch.rand(())), "test_accuracy": float(torch.rand(()))})
            running.history.append(dict(curve[-1]))
    saved = running.state_dict()

    loss_ema, acc_ema = losses[0], accuracies[0]
    for loss, accuracy in zip(losses[1:], accuracies[1:]):
        loss_ema, acc_ema = 0.95 * loss_ema + 0.05 * loss, 0.95 * acc_ema + 0.05 * accuracy

    resumed = _state(_recipe(seed + 1), num_train)  # another seed: nothing of the fresh state may stay
    resumed.load_state_dict(saved)
    assert resumed.history == curve
    assert resumed.step == steps and resumed.finished is False
    assert abs(resumed.loss_ema - loss_ema) < 1e-12 and abs(resumed.acc_ema - acc_ema) < 1e-12
    for _ in range(2 * num_train // batch + 1):  # both cross the next epoch's end
        assert resumed.next_indices(batch).tolist() == running.next_indices(batch).tolist()
