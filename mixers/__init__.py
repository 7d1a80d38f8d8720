"""Sequence mixers and state mixers behind one contract (:mod:`mixers.base`).

Importing this package registers every built-in mixer. Add a mixer: write ``mixers/<name>.py``
with a registered :class:`~mixers.base.Mixer` subclass and import it here.
"""
from .base import MIXERS, STATE_MIXERS, Mixer, State, StateMixer, build_mixer, build_state_mixer, register_mixer, register_state_mixer
from . import attention, bdlru, deltaproduct, gka, gla, jordan, kronecker_slots, mamba2, mlp, ska  # noqa: F401  (registration side effects)

__all__ = ["MIXERS", "STATE_MIXERS", "Mixer", "State", "StateMixer", "build_mixer", "build_state_mixer",
           "register_mixer", "register_state_mixer"]
