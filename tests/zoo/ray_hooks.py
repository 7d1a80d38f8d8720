"""Test-only hook named in a recipe's ``imports``: makes chosen cells die or fail, once or always.

A cell opts in through its (cosmetic, unhashed) ``description``: ``die-once:<marker>`` trains, then
kills its own process with SIGKILL before returning the row, the first time any process reaches it
(the marker file, created atomically, records the pid and recipe key); ``fail-once:<marker>`` raises
the first time; ``fail-always:`` raises every time; ``wait-for:<file>`` waits (at most 60 s) until the file
exists, then trains. Every other recipe trains normally.
"""
import os
import signal
import time

import zoo.training.loop as training

_original = getattr(training.train, "__wrapped_original__", training.train)


def _claim(marker: str, recipe) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()} {recipe.key}".encode())
    os.close(fd)
    return True


def train(recipe, *args, **kwargs):
    how, _, marker = recipe.config.description.partition(":")
    if how == "fail-always":
        raise ValueError("this cell always fails (test hook)")
    if how == "fail-once" and _claim(marker, recipe):
        raise ValueError("this cell fails once (test hook)")
    deadline = time.monotonic() + 60
    while how == "wait-for" and not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    result = _original(recipe, *args, **kwargs)
    if how == "die-once" and _claim(marker, recipe):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-cell: trained, row not yet returned
    return result


train.__wrapped_original__ = _original
training.train = train
