"""Whether a training step fits in memory, checked before the first step.

A step keeps every tensor its backward pass needs until that pass runs. For most models this is
small, but a continuous flow trained through its solver keeps every field evaluation of the
solve (with the exact divergence, one backward pass per dimension for each), hundreds of MB per
set. On a CPU the operating system then kills the process without a message. So a run measures
the tensors autograd saves for one item, scales it to its batch and compares with the memory
left on its device.

The saved tensors are measured on passes of one and of two items: the difference is what each
item adds, the rest what a pass saves whatever its batch (tensors made from the weights). The
estimate of a step's peak is ``PEAK_FACTOR`` times the saved tensors (the backward pass holds
its gradients beside them). Measured on a CPU over three training steps (loss, backward, AdamW)
at batches of hundreds of items: the rise of the peak resident memory was 1.27-1.34 times the
saved tensors for the sets' flows (the default, the large preset, a continuous flow with the
EGNN field) and 1.39-1.54 for the language models (dot product, contractive, invertible).

Added to it is what training holds whatever the batch: a gradient and AdamW's two moments per
trainable parameter, and the parameter average (:func:`state_bytes`). A language model whose
weights and state alone do not fit is refused before it is built (:func:`check_model_fits`,
which counts it on torch's meta device).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["saved_bytes", "pass_bytes", "PassBytes", "available_memory", "check_fits",
           "check_model_fits", "state_bytes", "byte_amount", "PEAK_FACTOR"]

PEAK_FACTOR = 2.0


def saved_bytes(fn: Callable[[], torch.Tensor], resident: Iterable[torch.Tensor] = ()
                ) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and return its result and the bytes autograd saved for its backward pass.

    Each storage counts once, however many views of it are saved; the storages of
    ``resident`` (a model's parameters and buffers: memory held whether or not a pass runs)
    do not count.

    Examples:
        >>> x = torch.ones(1000, requires_grad=True)
        >>> _, n = saved_bytes(lambda: (x * x).sum())
        >>> n  # x is saved once, for both factors
        4000
        >>> saved_bytes(lambda: (x * x).sum(), resident=[x])[1]
        0
    """
    held = {(t.device, t.untyped_storage().data_ptr()) for t in resident}
    sizes: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in held:
            sizes[key] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(sizes.values())


class PassBytes(NamedTuple):
    """What a training pass saves for its backward pass: ``fixed`` bytes whatever its batch
    (tensors made from the weights alone), and ``per_item`` bytes for each item."""

    fixed: int
    per_item: int


def pass_bytes(model: nn.Module, step: Callable[[int], torch.Tensor]) -> PassBytes:
    """The bytes a training pass of ``model`` saves, split into a fixed part and a part per
    item: ``step(k)`` is the loss of k copies of one item, run for k = 1 and 2; the difference
    is the part per item. The model's parameters and buffers are not counted (they are held
    anyway). Both passes draw the same random numbers (a Russian-roulette log-det draws how
    many terms its series takes), and the random streams and the model's buffers are put back
    as they were (a training pass may update some: power-iteration vectors).

    Examples:
        >>> model = nn.Sequential(nn.Linear(10, 1000), nn.Linear(1000, 1000))
        >>> pass_bytes(model, lambda k: model(torch.ones(k, 10)).sum())  # input rows
        PassBytes(fixed=0, per_item=4040)
    """
    resident = [*model.parameters(), *model.buffers()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    kind, devices = _accelerator_streams()
    sizes = []
    for items in (1, 2):
        try:
            with torch.random.fork_rng(devices=devices, device_type=kind):
                torch.manual_seed(0)
                sizes.append(saved_bytes(lambda k=items: step(k), resident)[1])
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
    per_item = max(sizes[1] - sizes[0], 0)
    return PassBytes(max(sizes[0] - per_item, 0), per_item)


def _accelerator_streams() -> tuple[str, list[int]]:
    """The machine's accelerator and all its devices: every random stream that
    ``torch.manual_seed`` sets, for ``fork_rng`` to put back (none on a machine without one)."""
    found = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if found is None:
        return "cuda", []
    return found.type, list(range(torch.get_device_module(found.type).device_count()))


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


def state_bytes(model: nn.Module, average: bool = False) -> int:
    """The bytes training allocates beside ``model``'s weights, whatever the batch: a gradient
    and AdamW's two moments for every trainable parameter, and with ``average`` the parameter
    average's copy of the parameters and buffers.

    Examples:
        >>> state_bytes(nn.Linear(10, 100))  # 1,100 float32 parameters, three copies
        13200
    """
    trainable = _bytes(p for p in model.parameters() if p.requires_grad)
    return 3 * trainable + (_weight_bytes(model) if average else 0)


def _weight_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers."""
    return _bytes((*model.parameters(), *model.buffers()))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sharing(device: torch.device) -> int:
    """The processes that share ``device``'s memory: on the CPU those ``torchrun`` started on
    this host (``LOCAL_WORLD_SIZE``), on an accelerator one."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1


def check_model_fits(build: Callable[[int], nn.Module], layers: int, device: torch.device, *,
                     average: bool = False, smaller: str = "") -> None:
    """Refuse a model of ``layers`` identical layers whose weights, gradients and optimiser
    state (:func:`state_bytes`) would not fit on ``device``, before it is built. ``build(k)``
    builds the model with k layers; it is built with one and with two on torch's meta device,
    which allocates nothing, and the bytes are extrapolated to ``layers`` (each layer adds the
    same): a model of 10^5 layers is refused at once, where building it took minutes and all
    the memory. A model that cannot be built there (an initialisation that reads values) is not
    checked; the random streams are left as they were.

    Raises:
        ConfigError: naming the parameters, the estimate, the memory available and
            ``smaller`` (the settings that make the model smaller, as their flags).

    Examples:
        >>> build = lambda k: nn.Sequential(*(nn.Linear(10, 10) for _ in range(k)))
        >>> check_model_fits(build, 4, torch.device("cpu"))  # 440 parameters: fits anywhere
    """
    free = available_memory(device)
    if free is None:
        return
    counts = []  # (parameters, bytes of the weights and of their training state)
    for k in (1, 2):
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model = build(k)
        except (RuntimeError, NotImplementedError):  # e.g. .item() of a meta tensor
            return
        counts.append((sum(p.numel() for p in model.parameters()),
                       _weight_bytes(model) + state_bytes(model, average)))
    (count, need), (count2, need2) = counts
    count, need = count + (layers - 1) * (count2 - count), need + (layers - 1) * (need2 - need)
    sharing = _sharing(device)
    if need * sharing > free:
        raise ConfigError(
            f"this model ({count:,} parameters) would need about {byte_amount(need * sharing)} on "
            f"{device} for its weights, gradients and optimiser state alone"
            + (f" ({sharing} processes on this host)" if sharing > 1 else "")
            + f", and {byte_amount(free)} is available"
            + (f": use {smaller}" if smaller else ""))


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


def check_fits(saved: PassBytes, items: int, device: torch.device, *, processes: int = 1,
               what: str = "batch_size", hints: tuple[str, ...] = (), state: int = 0,
               smaller: str = "") -> None:
    """Refuse a step of ``items`` items that would not fit, ``saved`` what its pass saves and
    ``state`` what training holds whatever the batch (:func:`state_bytes`).

    The step's items are shared out over ``processes`` data-parallel processes, each holding
    at most ceil(items / processes) of them, and a process's peak is taken as
    ``state + PEAK_FACTOR * (saved.fixed + saved.per_item * its items)``. On the CPU,
    processes started by ``torchrun`` on one machine share its memory, so their number there
    (``LOCAL_WORLD_SIZE``) multiplies the need. Where the state alone does not fit, the
    message says so and names ``smaller`` instead of a batch size.

    Raises:
        ConfigError: naming the estimate, the memory available, the largest ``what`` (a count
            for the whole step, like ``items``; a setting's name, shown with its flag) that
            fits and ``hints`` (other ways to need less, each as its flag would give it); where
            the state alone does not fit, ``smaller`` (the settings that make a model smaller).

    Examples:
        >>> check_fits(PassBytes(0, 1000), 64, torch.device("cpu"))  # 96 kB: fits anywhere
    """
    free = available_memory(device)
    fixed, per_item = saved
    if free is None or fixed + per_item + state <= 0:
        return
    sharing = _sharing(device)
    each = -(-items // processes)
    need = (state + PEAK_FACTOR * (fixed + per_item * each)) * sharing
    if need <= free:
        return
    mib = 2**20
    if state * sharing >= free:  # the model cannot train at all, whatever its batch
        raise ConfigError(
            f"training this model would need about {byte_amount(state * sharing)} on "
            f"{device} for its gradients and optimiser state alone"
            + (f" ({sharing} processes on this host)" if sharing > 1 else "")
            + f", and {byte_amount(free)} is available" + (f": use {smaller}" if smaller else ""))
    room = (free / sharing - state) / PEAK_FACTOR - fixed  # bytes a process has for its items
    fits = int(room // per_item) * processes if per_item > 0 and room > 0 else 0
    named = " + ".join(f"{name} (--{name.replace('_', '-')})" for name in what.split(" + "))
    advice = [f"{named} {fits:,} or less" if fits >= 1 else
              f"less memory per item ({named} 1 alone needs "
              f"{byte_amount((state + PEAK_FACTOR * (fixed + per_item)) * sharing)})", *hints]
    raise ConfigError(
        f"a training step would need about {byte_amount(need)} on {device} "
        f"({_size(per_item)} saved for the backward pass per item, {each:,} items"
        + (f" in each of {processes} processes" if processes > 1 else "")
        + (f", and {_size(fixed)} whatever the batch" if fixed >= mib else "")
        + (f"; {_size(state)} of gradients and optimiser state" if state >= mib else "")
        + (f"; {sharing} processes on this host" if sharing > 1 else "")
        + f"), and {byte_amount(free)} is available: use " + "; or ".join(advice))


def byte_amount(count: float) -> str:
    """A byte count in GiB, or as :func:`_size` below one GiB (where GiB would read "0.0").

    Examples:
        >>> byte_amount(3 * 2**30), byte_amount(5 * 2**20)
        ('3.0 GiB', '5 MiB')
    """
    return f"{count / 2**30:,.1f} GiB" if count >= 2**30 else _size(count)


def _size(count: float) -> str:
    """A byte count in MiB, or in KiB below one MiB (where MiB would read "0").

    Examples:
        >>> _size(5 * 2**20), _size(2048)
        ('5 MiB', '2.0 KiB')
    """
    return f"{count / 2**20:.0f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"
