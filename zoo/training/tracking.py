"""Optional experiment tracking of the training curve: TensorBoard or Weights & Biases.

Chosen per recipe with ``train.tracking: none | tensorboard | wandb`` (logs under
``train.tracking_dir``). The packages are imported only when asked for and are never required
(``pip install 'mixer-zoo[tracking]'``); a missing one is a one-line error before training starts.
``results.jsonl`` and the checkpoint's history stay the record; tracking is a view of them.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError


class Tracker:
    """Does nothing; the base of the real trackers."""

    def log(self, step: int, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """A run resumed from its checkpoint at ``resume_step`` (> 0) asks TensorBoard to hide what the interrupted
    process logged after that step (``purge_step``): those steps are trained and logged again, and would otherwise
    show twice; what it logged up to the checkpoint's step stays, since nothing logs it again."""

    def __init__(self, log_dir: Path, resume_step: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("train.tracking=tensorboard needs the tensorboard package: "
                            "pip install 'mixer-zoo[tracking]' (or pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step, values):
        for key, value in values.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, log_dir: Path, recipe, resume_step: int):
        try:
            import wandb
        except ImportError:
            raise UserError("train.tracking=wandb needs the wandb package: pip install 'mixer-zoo[tracking]' "
                            "(or pip install wandb)") from None
        log_dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project="mixer-zoo", name=recipe.name or recipe.key, dir=str(log_dir),
                              config=recipe.plain, id=f"{recipe.key}", resume="allow" if resume_step else None)

    def log(self, step, values):
        self.run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self):
        self.run.finish()


def default_dir(recipe, checkpoint_dir: Path | None) -> Path:
    if recipe.train.tracking_dir:
        return Path(recipe.train.tracking_dir)
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / "tracking"
    return Path("runs") / (recipe.name.replace("/", "_").replace(" ", "_") or recipe.key)


def make_tracker(recipe, checkpoint_dir: Path | None = None, resume_step: int = 0) -> Tracker:
    kind = recipe.train.tracking
    if kind == "none":
        return Tracker()
    log_dir = default_dir(recipe, checkpoint_dir)
    if kind == "tensorboard":
        return TensorBoardTracker(log_dir, resume_step)
    if kind == "wandb":
        return WandbTracker(log_dir, recipe, resume_step)
    raise UserError(f"train.tracking={kind!r}: choose none, tensorboard or wandb")
