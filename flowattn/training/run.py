"""Run folders: start, refuse, restart or resume — the same rules for every command.

A run folder holds ``run.json`` (which command's run it is and which data it read),
``config.json`` (every setting), ``checkpoint.pt``, ``metrics.jsonl``, ``tensorboard/`` and,
when it is done, ``summary.json``. :func:`plan_run` decides what a request means *before*
anything is written:

=====================================================  =======================================
request                                                outcome
=====================================================  =======================================
fresh run, empty or new folder                         start at step 0
folder holds other files and no run                    refused: choose a new or empty ``--out``
fresh run, folder holds a checkpoint                   refused: pass ``--resume`` or another
                                                       ``--out``
fresh run or ``--resume``, folder holds a run that     restart clean at step 0 (its old
stopped before its first checkpoint                    metrics are removed)
``--resume``, no run in the folder                     refused: nothing to resume
``--resume`` alone                                     continue with the stored settings
``--resume`` with settings                             only ``RESUMABLE`` ones may differ
                                                       (more steps, device, threads,
                                                       cadence); others are refused by name
``--resume`` of a finished run                         nothing to do (more ``--steps`` trains
                                                       on)
data file changed since the run began                  refused (its SHA-256 is recorded)
another command's run folder                           refused
folder in use by another process's run                 refused (naming its process id)
=====================================================  =======================================
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError, RunError
from ..files import atomic_write_text, no_such_file, unwritable
from .checkpoint import (
    BEST,
    CHECKPOINT,
    LEGACY_NAMES,
    check_resumable,
    read_checkpoint,
)
from .config import RunConfig, from_sources, read_config_file

__all__ = ["RunPlan", "plan_run", "data_fingerprint", "prepare_out_dir", "RUN_FILE",
           "CONFIG_FILE", "SUMMARY_FILE", "DIVERGED_FILE"]

RUN_FILE = "run.json"
LOCK_FILE = ".run.lock"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
DIVERGED_FILE = "diverged.json"
_OUTPUTS = ("metrics.jsonl", SUMMARY_FILE, DIVERGED_FILE)


@dataclass
class RunPlan:
    """What a training request will do, decided before anything is written.

    Attributes:
        out: the run folder.
        kind: the command (``lm``, ``sets``).
        config: the settings the run trains with.
        data: the data fingerprint (``source``, ``sha256``) recorded in run.json.
        checkpoint: the record to resume from, or None for a run from step 0.
        finished: the run already reached its last step; nothing to do.
        restart: the folder held a run that never reached a checkpoint; it starts over.
    """

    out: Path
    kind: str
    config: RunConfig
    data: dict
    checkpoint: dict | None = None
    finished: bool = False
    restart: bool = False
    notes: list[str] = field(default_factory=list)
    _lock: Any = field(default=None, repr=False, compare=False)  # the folder's, once prepared

    @property
    def start_step(self) -> int:
        return 0 if self.checkpoint is None else int(self.checkpoint["step"])

    def prepare(self) -> None:
        """Create the folder, check it is writable, clear a stale start and the temporary files
        of writes that a killed process left unfinished, write run.json and config.json (call
        on the first process only). The folder stays locked for this run while the plan
        lives (another process's run there is refused)."""
        prepare_out_dir(self.out)
        self._lock = _lock_folder(self.out)
        for name in (*_OUTPUTS, RUN_FILE, CONFIG_FILE, CHECKPOINT, BEST):
            for stale in self.out.glob(f".{name}.*.tmp"):  # atomic_write's temporary names
                stale.unlink(missing_ok=True)
        if self.checkpoint is None:  # from step 0: nothing of an earlier attempt survives
            for name in _OUTPUTS:
                (self.out / name).unlink(missing_ok=True)
            shutil.rmtree(self.out / "tensorboard", ignore_errors=True)
        manifest = {"format": "flowattn-run", "kind": self.kind, "data": self.data,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        atomic_write_text(json.dumps(manifest, indent=2) + "\n", self.out / RUN_FILE)
        atomic_write_text(json.dumps(self.config.to_dict(), indent=2) + "\n",
                          self.out / CONFIG_FILE)


def _lock_folder(out: Path):
    """An exclusive lock on ``out/.run.lock`` (its open file, or None where the system has no
    ``fcntl``): two processes training into one folder would interleave their checkpoints
    and metrics. A POSIX record lock belongs to the process, so the same process may take it
    again (a run resumed in the process that was interrupted); it goes when the file is
    closed or the process ends, however it ends."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        return None
    handle = open(out / LOCK_FILE, "a+")  # noqa: SIM115 - held open while the run lives
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip()
        handle.close()
        raise RunError(f"the run in {out} is in use by another process"
                       + (f" (pid {owner})" if owner.isdigit() else "")
                       + ": wait for it to end, or stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def prepare_out_dir(out: str | os.PathLike) -> Path:
    """Create the folder ``out`` if needed and check that files can be written in it."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RunError(f"output folder {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"cannot write to output folder {path}: {err.strerror or err}") from None
    reason = unwritable(path)
    if reason is not None:
        raise RunError(f"cannot write to output folder {path}: {reason}")
    return path


def _check_writable(out: Path) -> None:
    """Refuse an output folder that could not be made or written, before the data are loaded
    and the model is built (the folder itself is made when the run starts)."""
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    reason = "Not a directory" if not existing.is_dir() else unwritable(existing)
    if reason is not None:
        raise RunError(f"cannot write to output folder {out}: {reason}")


def _manifest(out: Path) -> dict | None:
    path = out / RUN_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or manifest.get("format") != "flowattn-run":
            raise ValueError
    except (ValueError, OSError):
        raise RunError(f"{path} is not a flowattn run file: choose another --out") from None
    return manifest


def _has_checkpoint(out: Path, kind: str) -> Path | None:
    for name in (CHECKPOINT, *LEGACY_NAMES):
        if (out / name).is_file():
            return out / name
    return None


def _check_changes(stored: RunConfig, requested: RunConfig, step: int) -> None:
    _refuse_changes(stored, stored.changed(requested))
    if requested.train.steps < step:
        raise ConfigError(f"steps={requested.train.steps} is below the step the run has reached "
                          f"({step})")


def _refuse_changes(stored: RunConfig, changed: Mapping[str, tuple[Any, Any]]) -> None:
    """Refuse the changes ``leaf -> (stored, requested)`` that a resume may not make."""
    refused = {k: v for k, v in changed.items() if k not in type(stored).RESUMABLE}
    if refused:
        listed = "; ".join(f"{k} ({a!r} in the run, {b!r} now)" for k, (a, b) in refused.items())
        allowed = ", ".join(sorted(type(stored).RESUMABLE))
        raise ConfigError(f"cannot change the run's settings when resuming: {listed}. Settings "
                          f"that may change: {allowed}")


def _check_same_run(stored: RunConfig, out: Path, recorded: list[str],
                    checkpoint_file: Path) -> None:
    """Refuse a checkpoint whose run settings disagree with the folder's config.json beyond
    what a resume may change: a checkpoint copied in from another run."""
    path = out / CONFIG_FILE
    if not path.is_file():
        return
    try:
        folder = type(stored).from_stored(read_config_file(path), str(path))
    except ConfigError:
        return  # unreadable settings: the checkpoint's own are the run's
    changed = stored.changed(folder.with_absolute_paths(recorded))
    refused = sorted(k for k in changed if k not in type(stored).RESUMABLE)
    if refused:
        raise RunError(f"{checkpoint_file} and {path} describe different runs (they differ in "
                       f"{', '.join(refused[:4])}{', ...' if len(refused) > 4 else ''}): the "
                       "checkpoint was copied from another run; choose the right folder")


def _check_data(stored: Mapping | None, now: dict, where: Path) -> None:
    if not stored or stored.get("sha256") is None or now.get("sha256") is None:
        return
    if stored["sha256"] != now["sha256"]:
        raise DataError(f"the data {now.get('source')} changed since the run in {where} began "
                        f"(SHA-256 {stored['sha256'][:12]}... then, {now['sha256'][:12]}... "
                        "now): resume with the original data, or start a new run")


def plan_run(
    out: str | os.PathLike,
    kind: str,
    config_class: type[RunConfig],
    *,
    resume: bool,
    file: str | os.PathLike | None = None,
    flags: Mapping[str, Any] | None = None,
    fingerprint: Callable[[RunConfig], dict] | None = None,
) -> RunPlan:
    """Decide what ``flowattn KIND train --out OUT [--resume] [--config FILE] [flags]`` does.

    Arguments:
        out: the run folder.
        kind: the command's name, recorded in run.json and the checkpoint.
        config_class: the command's :class:`~flowattn.training.config.RunConfig`.
        resume: whether ``--resume`` was given.
        file: a config file given with ``--config``.
        flags: the settings typed on the command line (only those).
        fingerprint: ``fingerprint(config) -> {"source": ..., "sha256": ...}`` of the data.

    Raises:
        RunError, CheckpointError, ConfigError, DataError: as in the module's table.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} is a file, not a folder")
    _check_writable(out)
    manifest = _manifest(out) if out.is_dir() else None
    if manifest is not None and manifest.get("kind") != kind:
        raise RunError(f"{out} holds a flowattn {manifest.get('kind')} run, not a {kind} run: "
                       "choose another --out")
    checkpoint_file = _has_checkpoint(out, kind) if out.is_dir() else None
    overrides: dict = {}
    if file is not None:
        overrides.update(config_class.nest(read_config_file(file), str(file)))
    for key, value in (flags or {}).items():
        overrides.setdefault(config_class.leaves()[key][0], {})[key] = value
    notes: list[str] = []

    record = None
    if checkpoint_file is not None:
        record = read_checkpoint(checkpoint_file, kind)  # also refuses another command's
        if not resume:
            raise RunError(f"{out} already holds a run (checkpoint at step {record['step']}): "
                           "pass --resume to continue it, or choose another --out")
        check_resumable(record)
        recorded = record.get("data_fingerprint") or (manifest or {}).get("data")
        stored = config_class.from_stored(record["config"], f"{checkpoint_file}")
        stored = stored.with_absolute_paths(_sources(recorded))
        _check_same_run(stored, out, _sources(recorded), checkpoint_file)
        config = _resumed(stored, overrides)
        _check_changes(stored, config, int(record["step"]))
        data = fingerprint(config) if fingerprint else {}
        _check_data(recorded, data, out)
        finished = int(record["step"]) >= config.train.steps and \
            (out / SUMMARY_FILE).exists()
        return RunPlan(out, kind, config, data, record, finished, notes=notes)

    restart = manifest is not None
    if resume and not restart:
        raise RunError(f"no run to resume in {out} (no {CHECKPOINT}): start it without --resume")
    if resume:  # interrupted before its first checkpoint: its stored settings, from step 0
        stored = config_class.from_stored(read_config_file(out / CONFIG_FILE),
                                          str(out / CONFIG_FILE))
        stored = stored.with_absolute_paths(_sources(manifest.get("data")))
        config = _resumed(stored, overrides)
        _check_changes(stored, config, 0)
        notes.append(f"{out} holds no checkpoint yet: the run starts again from step 0")
    else:
        config = from_sources(config_class, file, flags).with_absolute_paths()
        if not restart:
            _check_free(out, config, file)
        if restart:
            notes.append(f"{out} held a run stopped before its first checkpoint: starting over")
    data = fingerprint(config) if fingerprint else {}
    return RunPlan(out, kind, config, data, None, False, restart, notes)


def _check_free(out: Path, config: RunConfig, file: str | os.PathLike | None) -> None:
    """Refuse to start a run in a folder that holds files of its own: a run writes several
    files and folders into ``out``, never among a user's. Hidden entries (a file manager's)
    and the files the run reads (its ``--config`` file, its data files) may be there."""
    if not out.is_dir():
        return
    reads = {Path(path).resolve() for path in
             [file, *(config.flat()[key] for key in config.PATHS)] if isinstance(path, str | Path)}
    foreign = sorted(entry.name for entry in out.iterdir()
                     if not entry.name.startswith(".") and entry.resolve() not in reads)
    if not foreign:
        return
    if any(name in (*_OUTPUTS, CONFIG_FILE) for name in foreign):
        raise RunError(f"{out} holds files of another run (no {RUN_FILE}): choose a new or "
                       "empty --out")
    raise RunError(f"{out} holds {len(foreign)} file(s) or folder(s) of its own (e.g. "
                   f"{foreign[0]!r}) and no flowattn run: choose a new or empty --out (a run "
                   "writes its files there)")


def _sources(fingerprint: Mapping | None) -> list[str]:
    """The absolute paths a run's data fingerprint recorded (none for built-in data)."""
    source = (fingerprint or {}).get("source")
    return [source] if isinstance(source, str) else list(source or [])


def _resumed(stored: RunConfig, overrides: Mapping) -> RunConfig:
    """The stored settings with the ones given now; data files given now are taken from the
    working directory, so a file named differently but the same is no change."""
    if not overrides:
        return stored
    try:
        return stored.updated(overrides, "resume").with_absolute_paths()
    except ConfigError:
        # a change that the settings refuse together with the stored ones (a preset given
        # beside the run's stored flow): a resume refuses it as a change of the run
        flat = stored.flat()
        given = {name: value for section in type(stored).nest(overrides, "resume").values()
                 for name, value in section.items()}
        _refuse_changes(stored, {k: (flat.get(k), v) for k, v in given.items()
                                 if k in flat and flat[k] != v})
        raise


def data_fingerprint(*paths: str | os.PathLike | None) -> dict:
    """``{"source": ..., "sha256": ...}`` of the data files a run reads (built-in data: no
    digest; its settings are part of the config). A missing file is a DataError."""
    import hashlib

    files = [Path(p) for p in paths if p is not None and not str(p).startswith("builtin:")]
    if not files:
        return {"source": [str(p) for p in paths if p is not None] or None, "sha256": None}
    digest = hashlib.sha256()
    for path in files:
        try:
            with path.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        except FileNotFoundError:
            raise DataError(no_such_file(path)) from None
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror or err}") from None
        digest.update(b"\x00")
    return {"source": [str(p.resolve()) for p in files], "sha256": digest.hexdigest()}
