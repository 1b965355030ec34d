"""Whether a training step fits in memory, checked before the first step.

A step keeps every tensor its backward pass needs until that pass runs. For most models this is
small, but a continuous flow trained through its solver keeps every field evaluation of the
solve (with the exact divergence, one backward pass per dimension for each), hundreds of MB per
set. On a CPU the operating system then kills the process without a message. So a run measures
the tensors autograd saves for one item, scales it to its batch and compares with the memory
left on its device.

The estimate of a step's peak is ``PEAK_FACTOR`` times the saved tensors: the backward pass
holds its gradients beside them (measured on the sets' flows: peak resident memory 2.2-2.4 times
the saved bytes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["saved_bytes", "item_bytes", "available_memory", "check_fits", "PEAK_FACTOR"]

PEAK_FACTOR = 2.5


def saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and return its result and the bytes autograd saved for its backward pass.

    Each storage counts once, however many views of it are saved (parameters included: they
    are small beside the activations this is for).

    Examples:
        >>> x = torch.ones(1000, requires_grad=True)
        >>> _, n = saved_bytes(lambda: (x * x).sum())
        >>> n  # x is saved once, for both factors
        4000
    """
    sizes: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        sizes[(tensor.device, storage.data_ptr())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(sizes.values())


def item_bytes(model: nn.Module, step: Callable[[], torch.Tensor]) -> int:
    """The bytes autograd saves for ``step`` (one item's loss through ``model``), leaving the
    model's buffers as they were (a training pass may update some: power-iteration vectors).

    Examples:
        >>> layer = nn.Linear(1000, 10)
        >>> item_bytes(layer, lambda: layer(torch.ones(1, 1000)).sum())  # the input, saved
        4000
    """
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        return saved_bytes(step)[1]
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means no limit


def _host_available(root: Path = Path("/")) -> int | None:
    """Bytes the host can still give: MemAvailable, or less under a cgroup limit (files read
    under ``root``)."""
    amounts = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                amounts.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = root / "sys/fs/cgroup"
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2, then v1
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        cap, used = _read_int(cgroup / limit), _read_int(cgroup / usage)
        if cap is not None and used is not None and cap < 1 << 60:
            amounts.append(max(cap - used, 0))
    return min(amounts) if amounts else None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device``; None where it cannot be told (then no check).

    The host's available memory (the smaller of ``MemAvailable`` and the cgroup's limit less
    its usage) for the CPU; for a CUDA device the driver's free memory plus what torch's
    caching allocator holds unused.
    """
    if device.type == "cpu":
        return _host_available()
    if device.type == "cuda":  # the driver's free memory, and what torch's cache holds unused
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return None


def check_fits(item_bytes: int, items: int, device: torch.device, *, processes: int = 1,
               what: str = "batch_size", hints: tuple[str, ...] = ()) -> None:
    """Refuse a step of ``items`` items of ``item_bytes`` saved bytes each that would not fit.

    The step's items are shared out over ``processes`` data-parallel processes, each holding
    at most ceil(items / processes) of them, and a process's peak is taken as
    ``PEAK_FACTOR * item_bytes`` times its items. On the CPU, processes started by
    ``torchrun`` on one machine share its memory, so their number there (``LOCAL_WORLD_SIZE``)
    multiplies the need.

    Raises:
        ConfigError: naming the estimate, the memory available, the largest ``what`` (a count
            for the whole step, like ``items``) that fits and ``hints`` (other ways to need
            less).

    Examples:
        >>> check_fits(1000, 64, torch.device("cpu"))  # 160 kB: fits anywhere
    """
    free = available_memory(device)
    if free is None or item_bytes <= 0:
        return
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    each = -(-items // processes)
    need = PEAK_FACTOR * item_bytes * each * sharing
    if need <= free:
        return
    fits = int(free // (PEAK_FACTOR * item_bytes * sharing)) * processes
    gib = 2**30
    advice = [f"{what} {fits} or less" if fits >= 1 else
              f"less memory per item ({what} 1 alone needs "
              f"{PEAK_FACTOR * item_bytes * sharing / gib:.1f} GiB)", *hints]
    raise ConfigError(
        f"a training step would need about {need / gib:.1f} GiB on {device} "
        f"({item_bytes / 2**20:.0f} MiB saved for the backward pass per item, {each} items"
        + (f" in each of {processes} processes" if processes > 1 else "")
        + (f", {sharing} processes on this host" if sharing > 1 else "")
        + f"), and {free / gib:.1f} GiB is available: use " + "; or ".join(advice))
