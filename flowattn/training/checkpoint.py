"""Checkpoints: one format for every command, written atomically, read with ``weights_only``.

A checkpoint is a dict of tensors and plain values::

    {"format": "flowattn", "kind": "lm" | "sets", "version": 2, "config": {...},
     "step": int, "model": state_dict, "optimizer": state_dict, "rng": [per process],
     "loop": {...}, "task": {...}}

:func:`read_checkpoint` turns every way a file can be unusable — missing, empty, truncated, not
a torch file, another program's, another command's, a newer format — into one
:class:`~flowattn.errors.CheckpointError` line that names the file. Files of format version 1
(written before the training core was shared) are recognised and returned with ``version: 1``
so that each command can still load its model from them.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, RunError
from ..files import atomic_write

__all__ = ["CHECKPOINT", "BEST", "VERSION", "save_checkpoint", "read_checkpoint",
           "read_model", "unbuildable", "find_checkpoint", "check_resumable", "checkpoint_step"]

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"  # the state at the lowest validation loss, in runs with keep_best
VERSION = 2
LEGACY_NAMES = ("ckpt.pt",)  # the language-model checkpoint name of format version 1


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``payload`` (with format, kind and version added) atomically to ``path``."""
    record = {"format": "flowattn", "version": VERSION, **payload}
    atomic_write(path, lambda handle: torch.save(record, handle))


def find_checkpoint(location: str | os.PathLike) -> Path:
    """The checkpoint file of a run folder (or the file itself)."""
    path = Path(location)
    if path.is_dir():
        for name in (CHECKPOINT, *LEGACY_NAMES):
            if (path / name).is_file():
                return path / name
        raise CheckpointError(f"no checkpoint in {path} (expected {path / CHECKPOINT})")
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: no such file or folder")
    return path


def _kind_of(record: dict) -> tuple[str | None, int]:
    if record.get("format") == "flowattn":
        return record.get("kind"), int(record.get("version", 0))
    if record.get("kind") == "flowattn-lm":  # version 1 language-model checkpoints
        return "lm", 1
    if {"config", "data", "model", "step"} <= record.keys() and record.get("version") == 1:
        return "sets", 1  # version 1 set-flow checkpoints
    return None, 0


_DAMAGED = ("flowattn writes a checkpoint whole (a temporary file renamed into place), so one "
            "of its checkpoints in this state was damaged afterwards: restore it from a copy, "
            "or train the run again in a new --out folder")


def _numpy_archive(path: Path) -> bool:
    """Whether the zip file at ``path`` is numpy's .npz (arrays at its top level) rather than
    torch's (every entry inside one folder)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return bool(names) and all("/" not in n and n.endswith(".npy") for n in names)


def _damaged_record(path: Path) -> str | None:
    """The first record of the zip archive at ``path`` whose bytes fail the CRC-32 the archive
    stores for it (bytes changed on disk or in a copy, values still finite: torch.load does
    not check), or None (also where the archive itself cannot be read: torch.load says why)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None


def read_checkpoint(location: str | os.PathLike, kind: str,
                    map_location: str | torch.device = "cpu") -> dict:
    """The checkpoint of a ``kind`` run (``lm`` or ``sets``) at ``location``, a file or folder.

    Returns the record with ``kind`` and ``version`` filled in and ``path`` (the file read).

    Raises:
        CheckpointError: naming the file, if it is missing, empty, truncated, corrupted (a
            record failing its checksum) or unreadable, not a flowattn checkpoint, another
            command's, of a newer format version, or with a step that is not an integer >= 0.
    """
    path = find_checkpoint(location)
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); {_DAMAGED}")
    with open(path, "rb") as file:
        head = file.read(4)
    if not (head.startswith(b"PK") or head.startswith(b"\x80")):  # a zip archive or a pickle
        raise CheckpointError(f"checkpoint {path} is not a torch file (it starts with "
                              f"{head!r}; torch.save writes a zip archive)")
    if head.startswith(b"PK") and _numpy_archive(path):
        raise CheckpointError(f"{path} is a numpy .npz archive (data), not a checkpoint: give "
                              "the run folder or its checkpoint.pt as the checkpoint, and this "
                              "file as the data")
    damaged = _damaged_record(path) if head.startswith(b"PK") else None
    if damaged is not None:
        raise CheckpointError(f"checkpoint {path} is corrupted: its record {damaged} fails the "
                              f"checksum the archive stores; {_DAMAGED}")
    try:
        record = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError,
            ValueError, AttributeError, KeyError, IndexError, UnicodeDecodeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "Weights only load failed" in reason:  # torch's explanation runs for a paragraph
            raise CheckpointError(
                f"checkpoint {path} cannot be read: it holds Python objects other than tensors "
                "and plain data, which are not loaded (weights_only)") from None
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated, corrupted or not a "
                              f"torch file): {reason[:200]}; {_DAMAGED}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} is not a flowattn checkpoint (it holds a "
                              f"{type(record).__name__})")
    found, version = _kind_of(record)
    if found is None:
        raise CheckpointError(f"{path} is not a flowattn checkpoint")
    if found != kind:
        raise CheckpointError(f"{path} is a checkpoint of a flowattn {found} run, not of a "
                              f"{kind} run")
    if version > VERSION:
        raise CheckpointError(f"{path} was written in checkpoint format version {version}; this "
                              f"flowattn reads versions up to {VERSION}: upgrade flowattn")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: its step is {step!r}, not a number of steps taken "
                              f"(an integer >= 0); {_DAMAGED}")
    return {**record, "kind": found, "version": version, "path": str(path)}


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint file holds, or None where it cannot be read (a message's detail:
    nothing is checked beyond that; :func:`read_checkpoint` reads a checkpoint for use)."""
    try:
        record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(record["step"])
    except Exception:  # noqa: BLE001 - any failure only leaves the step out of the message
        return None


def read_model(location: str | os.PathLike, kind: str,
               map_location: str | torch.device = "cpu") -> dict:
    """The checkpoint whose model a run folder ends with: :data:`BEST` for a run trained with
    ``keep_best`` (once it has validated), else the last checkpoint. A file given by its path is
    read as it is. Returns what :func:`read_checkpoint` returns.

    Raises:
        CheckpointError: as :func:`read_checkpoint`, or if the model's weights hold NaN or Inf.
    """
    record = read_checkpoint(location, kind, map_location)
    best = Path(record["path"]).parent / BEST
    keep_best = (record.get("config") or {}).get("train", {}).get("keep_best", False)
    if Path(location).is_dir() and keep_best and best.is_file():
        record = read_checkpoint(best, kind, map_location)
    model = record.get("model")
    bad = [name for name, value in (model.items() if isinstance(model, dict) else ())
           if isinstance(value, torch.Tensor) and value.is_floating_point()
           and not bool(torch.isfinite(value).all())]
    if bad:
        raise CheckpointError(f"{record['path']}: the model's weights hold NaN or Inf values "
                              f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                              "the file is damaged or was written by a diverged run")
    return record


def unbuildable(record: dict, what: str, err: BaseException) -> CheckpointError:
    """The error for a checkpoint whose model cannot be rebuilt from its record: ``what`` it
    should hold, and why not: a missing entry by its name, else the error's whole message on
    one line (``load_state_dict`` lists every missing key and size mismatch), cut at 400
    characters.

    Examples:
        >>> str(unbuildable({"path": "c.pt"}, "a set flow", KeyError("model")))
        "c.pt does not hold a set flow this flowattn can rebuild: its record has no entry 'model'"
    """
    if isinstance(err, KeyError):
        reason = f"its record has no entry {err.args[0]!r}" if err.args else "an entry is missing"
    else:
        reason = " ".join(str(err).split())
        reason = reason if len(reason) <= 400 else reason[:400] + " ..."
    return CheckpointError(f"{record['path']} does not hold {what} this flowattn can rebuild: "
                           f"{reason}")


def check_resumable(record: dict) -> None:
    """Refuse to resume from a checkpoint of an older format (its model still loads)."""
    if record["version"] < VERSION:
        raise RunError(f"{record['path']} was written in checkpoint format version "
                       f"{record['version']}: its model can be evaluated and sampled, but the "
                       f"run cannot be resumed by this flowattn (format version {VERSION}); "
                       "start a new run")
