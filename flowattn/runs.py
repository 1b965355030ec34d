"""Run bookkeeping shared by the training commands: output folders, checkpoints, metrics, DDP."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .errors import RunError

__all__ = [
    "prepare_out_dir",
    "atomic_torch_save",
    "atomic_write_text",
    "truncate_metrics",
    "MetricsLog",
    "DistributedContext",
    "rng_state",
    "set_rng_state",
]




def prepare_out_dir(out: str | os.PathLike) -> Path:
    """Create ``out`` if needed and check that files can be written in it."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise RunError(f"cannot write to output folder {path}: {err.strerror or err}") from None
    return path


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file, then rename: a reader never sees half a checkpoint."""
    _atomic(Path(path), lambda handle: torch.save(obj, handle))


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write text atomically (temporary file, then rename)."""
    _atomic(Path(path), lambda handle: handle.write(text.encode()))


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Drop the records of a ``metrics.jsonl`` logged after ``step``.

    A resumed run continues from its last checkpoint; records written after it belong to the
    interrupted attempt and would otherwise appear twice.
    """
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write_text("".join(line + "\n" for line in kept), path)


class MetricsLog:
    """Append-only ``metrics.jsonl`` plus TensorBoard scalars (when tensorboard is installed).

    Each record is one JSON line with at least ``step`` and a wall-clock ``time``; numeric
    fields also go to TensorBoard under ``prefix/name``.
    """

    def __init__(self, out: Path, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # logging to TensorBoard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (see :func:`truncate_metrics`)."""
        if self.enabled:
            truncate_metrics(self.path, step)

    def log(self, step: int, prefix: str, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), "split": prefix, **values}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class DistributedContext:
    """Process-group state of a run launched by ``torchrun`` (or a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(cls, device: str) -> DistributedContext:
        """Join the process group that ``torchrun`` describes in the environment, if any.

        The backend is NCCL on CUDA devices and gloo on CPU.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            backend = "nccl" if device.startswith("cuda") else "gloo"
            dist.init_process_group(backend=backend)
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))

    def device(self, requested: str) -> torch.device:
        if requested.startswith("cuda") and self.active:
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device(requested)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group once every rank has finished (call on success only)."""
        if self.active and dist.is_initialized():
            # Process 0 evaluates and writes after training; tearing the group down under it
            # (it also hosts the rendezvous store) can abort the other processes.
            dist.barrier()
            dist.destroy_process_group()


def rng_state(generator: torch.Generator) -> dict:
    """Everything random a run depends on: its data generator and torch's global RNGs."""
    state = {"generator": generator.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(generator: torch.Generator, state: dict) -> None:
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
