"""An out-of-tree mixer for tests that name a module in a recipe's ``imports:``: the contributing guide's
example, registered when this module is imported (as a user's own mixer module would be)."""
from mixers import register_mixer
from tests.mixers.example_mixer import CumulativeMean

register_mixer(CumulativeMean)
