"""Sequence mixers and state mixers behind one contract (:mod:`mixers.base`).

Importing this package imports every module in it, which registers every built-in mixer. Add a mixer:
write ``mixers/<name>.py`` with a ``@register_mixer`` :class:`~mixers.base.Mixer` subclass; there is no
list of modules to edit.
"""
import importlib
import pkgutil

from .base import (
    MIXERS,
    STATE_MIXERS,
    Mixer,
    State,
    StateMixer,
    build_mixer,
    build_state_mixer,
    register_mixer,
    register_state_mixer,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["MIXERS", "STATE_MIXERS", "Mixer", "State", "StateMixer", "build_mixer", "build_state_mixer",
           "register_mixer", "register_state_mixer"]
