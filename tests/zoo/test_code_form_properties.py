"""The code form that decides whether a table's cell is stale (zoo.experiments.freshness.code_form): two
versions of a module that differ only in docstrings, comments, formatting or the order of their imports have
one form, and any change of what the code does gives another."""
import random

from zoo.experiments.freshness import code_form

IMPORTS = ["import math", "import os", "from pathlib import Path", "from . import base", "import torch as th"]
BODY = '''

def area(r):
    """The area of a circle."""
    return math.pi * r ** 2  # the usual formula


class Box:
    """A box."""

    def size(self):
        """Its size."""
        return 3
'''


def _module(imports, body=BODY, doc='"""A module."""\n'):
    return doc + "\n".join(imports) + "\n" + body


def test_import_order_docstrings_comments_and_layout_leave_the_form_unchanged():
    shuffled = IMPORTS[:]
    while shuffled == IMPORTS:
        random.shuffle(shuffled)
    reworded = (BODY.replace('"""The area of a circle."""', '"""Pi r squared."""')
                .replace("# the usual formula", "")
                .replace("return math.pi * r ** 2", "return (math.pi\n            * r ** 2)"))
    original = code_form(_module(IMPORTS))
    assert code_form(_module(shuffled)) == original
    assert code_form(_module(IMPORTS, reworded, doc='"""Another docstring."""\n\n')) == original


def test_a_change_of_what_the_code_does_changes_the_form():
    original = code_form(_module(IMPORTS))
    assert code_form(_module(IMPORTS, BODY.replace("r ** 2", "r ** 3"))) != original
    assert code_form(_module(IMPORTS[:-1])) != original
    assert code_form(_module(IMPORTS, BODY.replace("return 3", "return 4"))) != original
    assert code_form(None) is None
