"""Synthetic tasks, registered by name (``zoo list`` shows them): MQAR, the state-tracking family, the
memory tasks and the transfer-retrieval tasks.

Importing this package imports every module in it, so a task is registered by writing its module here
with a ``@register_task`` class; no list of modules to edit. A task in a package of your own is registered the
same way and named in a recipe's ``imports:`` (CONTRIBUTING.md, "Adding a task").
"""
import importlib
import pkgutil

from .base import TASKS, Task, TaskData, register_task

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TASKS", "Task", "TaskData", "register_task"]
