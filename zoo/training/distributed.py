"""Data-parallel training under ``torchrun``: detection, process group, batch shards, reductions.

``torchrun --nproc_per_node N -m zoo train RECIPE`` starts N processes with ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK`` in their environment; :func:`context` reads them and joins the process group (gloo when
the run trains on the CPU, NCCL when it trains on CUDA, one GPU per local rank: a local rank past the machine's
GPUs is refused in one line before joining). Every rank builds the same
data and the same batch order from the recipe seed and trains on its contiguous shard of each global batch
(``train.batch_size`` is the global batch and must divide by the world size). Rank 0 alone writes
logs, checkpoints and results.

The loss each rank back-propagates is its shard's summed cross-entropy divided by the global number
of supervised tokens, times the world size; DistributedDataParallel averages gradients over ranks,
so the update equals the full-batch update up to floating-point summation order, even when shards
hold different numbers of supervised tokens.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UserError

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, global_batch: int) -> slice:
        """The positions of this rank's examples within a global batch of ``global_batch``."""
        per_rank = shard_size(global_batch, self.world_size)
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def all_sum(self, values: list[float], device) -> list[float]:
        """Sum ``values`` over ranks (identity in a single process)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


def shard_size(global_batch: int, world_size: int) -> int:
    if global_batch % world_size:
        raise ValueError(f"train.batch_size={global_batch} is the global batch and must divide by the "
                         f"{world_size} processes; choose a multiple of {world_size}")
    return global_batch // world_size


def launched_by_torchrun() -> bool:
    return all(v in os.environ for v in ENV_VARS)


def rank_before_joining() -> int:
    """This process's rank as torchrun set it (0 outside torchrun), read without joining the process group."""
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def world_size_before_joining() -> int:
    """The number of processes torchrun started (1 outside torchrun), read without joining the process group."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def context(device: torch.device | None = None) -> DistContext:
    """The current process's place in the job; joins the process group once when under torchrun, with the
    backend of the ``device`` the run trains on (a CPU run on a machine with GPUs takes gloo: NCCL cannot
    reduce CPU tensors). Without a device: CUDA when available."""
    if not launched_by_torchrun():
        return DistContext()
    rank, world, local = (int(os.environ[v]) for v in ENV_VARS)
    if world > 1 and not dist.is_initialized():
        on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
        backend = "nccl" if on_cuda else "gloo"
        if backend == "nccl":
            _pin_gpu(local)
        dist.init_process_group(backend=backend)
        atexit.register(shutdown)
    return DistContext(rank, world, local)


def pin_local_gpu(device: torch.device) -> None:
    """Under torchrun with several processes training on CUDA, make GPU ``LOCAL_RANK`` this process's device now,
    so that what runs before the process group is joined (the recipe's trial pass) runs there and not on GPU 0,
    where every rank would leave a CUDA context."""
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 and device.type == "cuda":
        _pin_gpu(int(os.environ["LOCAL_RANK"]))


def _pin_gpu(local_rank: int) -> None:
    """Make GPU ``local_rank`` this process's device; more processes on a machine than it has GPUs is refused in one
    line, before the process group is joined."""
    try:
        torch.cuda.set_device(local_rank)
    except RuntimeError:  # CUDA's "invalid device ordinal"
        count = torch.cuda.device_count()
        if local_rank < count:
            raise
        raise UserError(f"LOCAL_RANK={local_rank}: this machine has {count} CUDA device{'s' * (count != 1)}, one per "
                        f"process under torchrun; start at most {count} here (torchrun --nproc_per_node {count}), or "
                        f"train on the CPU with train.device=cpu") from None


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_for(ctx: DistContext, device: torch.device) -> torch.device:
    """One GPU per local rank under torchrun."""
    if ctx.enabled and device.type == "cuda":
        return torch.device("cuda", ctx.local_rank)
    return device
