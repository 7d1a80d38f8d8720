"""The mixers the package itself registers: a test that compares with a fresh process (``zoo list``, a recipe
naming every mixer) uses these, because test modules register example mixers into the same registry."""
from mixers import MIXERS


def builtin_mixer_names() -> list[str]:
    """Registered mixers defined in the ``mixers`` package (not by a test or an out-of-tree module)."""
    return MIXERS.builtin_names("mixers")
