"""Sequence mixers and state mixers behind one contract (:mod:`mixers.base`).

Importing this package registers every built-in mixer. Add a mixer: write ``mixers/<name>.py``
with a registered :class:`~mixers.base.Mixer` subclass and import it here.
"""
from .base import MIXERS, STATE_MIXERS, Mixer, State, StateMixer, build_mixer, build_state_mixer, register_mixer, register_state_mixer
from . import attention, mamba2, mlp  # noqa: F401  (registration side effects)

for _optional in ("ska", "gka", "gla", "deltaproduct"):
    # mixers being added in parallel register themselves once their module exists
    try:
        __import__(f"{__name__}.{_optional}")
    except ModuleNotFoundError as _err:
        if _err.name != f"{__name__}.{_optional}":
            raise

__all__ = ["MIXERS", "STATE_MIXERS", "Mixer", "State", "StateMixer", "build_mixer", "build_state_mixer",
           "register_mixer", "register_state_mixer"]
