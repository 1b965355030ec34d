"""Process groups for ``torchrun``: join, synchronise, gather, leave — in one place.

A run launched by ``torchrun --nproc_per_node K -m flowattn ...`` finds RANK, WORLD_SIZE and
LOCAL_RANK in its environment and joins the process group (NCCL on GPUs, gloo on CPUs); a plain
process is a world of one and every method here is then a no-op. The model is wrapped in
:class:`torch.nn.parallel.DistributedDataParallel`; nothing else is home-made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .device import resolve_device

__all__ = ["Distributed"]


@dataclass
class Distributed:
    """Where this process stands in the run: rank, world size and its device."""

    rank: int
    world: int
    device: torch.device
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @classmethod
    def join(cls, device: str) -> Distributed:
        """Resolve ``device`` and join the process group ``torchrun`` describes, if any."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        resolved = resolve_device(device, local_rank)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 or "RANK" not in os.environ:
            return cls(0, 1, resolved)
        owns = not dist.is_initialized()
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        if owns:
            dist.init_process_group(backend="nccl" if resolved.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), resolved, owns)

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` inside DistributedDataParallel when there are several processes."""
        if not self.active:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=ids)

    def any(self, flag: bool) -> bool:
        """True on every process if ``flag`` is true on one (a collective)."""
        if not self.active:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value)
        return bool(value.item() > 0)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` over processes (a collective)."""
        if not self.active:
            return values
        values = values.clone()
        dist.all_reduce(values)
        return values / self.world

    def gather(self, obj) -> list:
        """Every process's ``obj``, in rank order (a collective)."""
        if not self.active:
            return [obj]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def leave(self) -> None:
        """Leave the process group once every process has got here.

        Process 0 writes the last checkpoint and the summary and hosts the rendezvous store:
        the barrier keeps the others from tearing the group down under it.
        """
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
