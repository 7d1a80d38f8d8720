"""Training and evaluation of one recipe: the loop (:mod:`.loop`), its :class:`~.state.TrainState` and
optimizer (:mod:`.optim`), checkpoints (:mod:`.checkpoint`), ``torchrun`` data parallelism
(:mod:`.distributed`), optional tracking (:mod:`.tracking`), and evaluation (:mod:`.evaluation`, which
training calls and which never imports training)."""
