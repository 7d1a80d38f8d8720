"""The one error a user of the zoo is meant to see: :class:`UserError`, reported as one line.

Every mistake the user can fix (a recipe typo, a missing file, an unwritable folder, a missing optional
extra, a damaged checkpoint) raises :class:`UserError` with a message that names the problem and what to
do; the command line prints it on one line with exit code 2 and no traceback. It sits at the bottom of
``zoo/`` so that every module can raise it without importing anything above it. A Ctrl-C ends a command the
same way, in one line with exit status :data:`INTERRUPTED`, even while the command is still importing
(:func:`interrupted_while_starting`).
"""
from __future__ import annotations

import sys

#: the exit status of a command stopped by Ctrl-C: 128 + SIGINT, what a shell reports for a program that signal ends
INTERRUPTED = 130

#: characters that end a line for a terminal or for str.splitlines(), written as escapes in an error
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


class UserError(Exception):
    """A problem the user can fix, reported as one line (no traceback)."""


def one_line(text: str) -> str:
    """``text`` on exactly one line (a recipe key or value may contain line breaks)."""
    return text.strip().translate(_LINE_BREAKS)


def error_summary(err: BaseException) -> str:
    """``"Type: first line of the message"``, for reports of failed cells and attempts."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def interrupted_while_starting() -> SystemExit:
    """A Ctrl-C while the command line is still importing its modules (torch, triton): one line on standard error;
    returns the :class:`SystemExit` (status :data:`INTERRUPTED`) that ends the process without a traceback."""
    print("zoo: interrupted while starting; nothing was run", file=sys.stderr)
    return SystemExit(INTERRUPTED)
