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
           "no_such_file", "signals_deferred", "HeldSignals"]


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
    to the handler that was in place (:class:`HeldSignals`)."""
    held = HeldSignals()
    with held:
        try:
            yield
        finally:
            held.deliver()


class HeldSignals:
    """SIGINT and SIGTERM held back while a ``with`` block runs: the first one received is
    noted (:attr:`received`) instead of handled, until :meth:`deliver` hands it to the
    handler that was in place.

    Only in the main thread, where Python runs its handlers (blocking the signals at the
    system level would not do: a thread of torch's may take them); signals that are ignored,
    or whose handler was not set from Python, are left alone.

    Arguments:
        noted: called with the signal number when the first one arrives (to say so).
        second_at_once: a second signal is delivered at once (a second Ctrl-C stops).
    """

    def __init__(self, noted=None, second_at_once: bool = False) -> None:
        self.noted, self.second_at_once = noted, second_at_once
        self.received: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(signum)
                if handler is not None and handler != signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._receive)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _receive(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            if self.noted is not None:
                self.noted(signum)
        elif self.second_at_once:
            self.received = signum
            self.deliver(frame)

    def deliver(self, frame=None) -> None:
        """Put the handlers in place before back and hand them the signal received, if any
        (Ctrl-C's raises KeyboardInterrupt; a default one takes the signal's default action)."""
        self.__exit__()
        if self.received is None:
            return
        handler = self.previous.get(self.received, signal.getsignal(self.received))
        if callable(handler):
            handler(self.received, frame)
        else:
            signal.raise_signal(self.received)


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
    typed, path = str(path), Path(path)
    if path.suffix != suffix:  # Path(".npz") has no suffix: it is a hidden file's name
        raise InputError(f"--out must name a {suffix} file, such as out{suffix}, got {typed!r}")
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
