"""Files written whole or not at all (a temporary file beside the target, then a rename), and
what to say of files that are missing or cannot be written."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path

from .errors import InputError

__all__ = ["atomic_write", "atomic_write_text", "check_output_file", "unwritable",
           "no_such_file", "signals_deferred"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, then rename it into place.

    A reader never sees half a file; the file gets the permissions of an ordinary new file
    (0666 less the umask), not the temporary file's 0600. A file that cannot be written (no
    such folder, no permission, a folder in its place, a full disk) is an
    :class:`~flowattn.errors.InputError` naming it, and leaves nothing behind. Ctrl-C and
    SIGTERM wait until the file is in place (an interrupt inside ``torch.save`` turns into
    torch's own error about the archive it was writing).
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise InputError(f"cannot write {path}: {err.strerror or err}") from None
    with signals_deferred():
        _write_and_rename(fd, tmp, path, write)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM back until the block ends, then deliver the first one received
    to the handler that was in place (in the main thread, where Python runs its handlers;
    blocking them at the system level would not do: a thread of torch's may take them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not None:  # None: a handler not set from Python
            held[signum] = signal.signal(signum, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


def _write_and_rename(fd: int, tmp: str, path: Path, write) -> None:
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise InputError(f"cannot write {path}: {err.strerror or err}") from None
        raise


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda handle: handle.write(text.encode()))


def check_output_file(path: str | os.PathLike, suffix: str) -> Path:
    """``path`` as a file a command may write once its work is done, checked before the work:
    it ends in ``suffix``, is not a folder, and its folder exists and takes new files.

    Raises:
        InputError: naming what is wrong with ``path``.
    """
    path = Path(path)
    if path.suffix != suffix:
        raise InputError(f"--out must name a {suffix} file, got {path}")
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a folder")
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise InputError(f"cannot write {path}: {folder} is a file, not a folder")
    if not folder.is_dir():
        raise InputError(f"cannot write {path}: folder {folder} does not exist")
    reason = unwritable(folder)  # what the final write will need: a new file in that folder
    if reason is not None:
        raise InputError(f"cannot write {path}: {reason}")
    return path


def unwritable(folder: str | os.PathLike) -> str | None:
    """Why no new file can be created in the existing folder ``folder`` (the operating
    system's reason), or None when one can: a temporary file is created there and removed."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-", suffix=".tmp"):
            return None
    except OSError as err:
        return str(err.strerror or err)


def no_such_file(path: str | os.PathLike) -> str:
    """The message for a file that is not there; a relative path also names the folder it was
    looked for in (relative paths, in flags and config files alike, are read from the working
    directory).

    Examples:
        >>> no_such_file("/data/sets.npz")
        '/data/sets.npz: no such file'
    """
    path = Path(path)
    where = "" if path.is_absolute() else f" (looked for in the working directory {Path.cwd()})"
    return f"{path}: no such file{where}"
