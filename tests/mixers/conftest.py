"""Fixtures shared by the mixer tests."""
import pytest

from mixers import MIXERS, register_mixer


@pytest.fixture
def registered():
    """``registered(cls)`` registers a test-only mixer class and returns its name; every class registered is
    removed from the registry after the test."""
    added = []

    def add(cls):
        register_mixer(cls)
        added.append(cls.name)
        return cls.name

    yield add
    for name in added:
        MIXERS.entries.pop(name, None)
