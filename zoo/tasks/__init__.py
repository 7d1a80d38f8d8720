"""Synthetic tasks, registered by name (``zoo list`` shows them): MQAR and the state-tracking family."""
from .base import TASKS, Task, TaskData, register_task
from . import memory_tasks, mqar, state_tasks  # noqa: F401  (registration)

__all__ = ["TASKS", "Task", "TaskData", "register_task"]
