"""Training and evaluation of one recipe: the loop (:mod:`.loop`), its :class:`~.state.TrainState` and
optimizer (:mod:`.optim`), checkpoints (:mod:`.checkpoint`), ``torchrun`` data parallelism
(:mod:`.distributed`), optional tracking (:mod:`.tracking`), the metrics of a model (:mod:`.evaluation`,
which training calls and which never imports the loop), and the device, precision and autocast choices
(:mod:`.device`). Nothing here imports :mod:`zoo.experiments`; evaluating a checkpoint again (``zoo eval``)
is :mod:`zoo.reevaluate`."""
