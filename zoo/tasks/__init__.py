"""Synthetic tasks, registered by name (``zoo list`` shows them): MQAR, the state-tracking family and the
transfer-retrieval tasks."""
from .base import TASKS, Task, TaskData, register_task
from . import memory_tasks, mqar, state_tasks, transfer_mix, transfer_tasks  # noqa: F401  (registration)

__all__ = ["TASKS", "Task", "TaskData", "register_task"]
