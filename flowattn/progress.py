"""Training progress on a terminal (a tqdm bar) or in a log file (a plain line now and then).

A bar redraws itself with carriage returns many times a second: on a terminal that is what one
wants, but redirected to a file (``nohup``, a batch scheduler, CI) it becomes one line of
megabytes that ``tail`` cannot show. When the stream is not a terminal, :class:`Progress`
writes one ordinary line per ``interval`` seconds instead, and one at the end:

    sets train: step 4100/6000 (68%), loss 1.2781, lr 1.57e-04, 3.52 s/step, 1:51:28 left
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from tqdm.auto import tqdm

__all__ = ["Progress", "progress_range", "progress_batches"]


class Progress:
    """A progress report of ``total`` steps starting at ``initial``, named ``desc``.

    Arguments:
        total: the number of steps of the run.
        initial: the steps done before (a resumed run).
        desc: the name shown first.
        enabled: False shows nothing (:meth:`write` still prints).
        file: the stream (default: standard error); a terminal or a notebook gets a tqdm bar.
        interval: seconds between two lines when the stream is not a terminal.
        unit: what is counted (``"step"``; an evaluation counts ``"set"``s).

    Examples:
        >>> import io
        >>> log = io.StringIO()
        >>> bar = Progress(total=3, desc="demo", file=log)
        >>> for _ in range(3):
        ...     bar.update()
        >>> bar.close()
        >>> log.getvalue().startswith("demo: step 3/3 (100%)")
        True
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "", enabled: bool = True,
                 file: TextIO | None = None, interval: float = 60.0, unit: str = "step") -> None:
        self.file = sys.stderr if file is None else file
        self.unit = unit
        self.total, self.step, self.desc, self.enabled = total, initial, desc, enabled
        self.interval, self.postfix = interval, {}
        self.bar = None
        if enabled and _interactive(self.file):
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc,
                            file=self.file, unit=unit)
        self.start_step, self.start = initial, time.monotonic()
        self.last, self.reported = self.start, initial

    def update(self, steps: int = 1) -> None:
        """Count ``steps`` more steps done."""
        self.step += steps
        if self.bar is not None:
            self.bar.update(steps)
        elif self.enabled and time.monotonic() - self.last >= self.interval:
            self._line()

    def set_postfix(self, **values: str) -> None:
        """Show ``values`` (name -> text) after the count."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(values)

    @staticmethod
    def write(message: str) -> None:
        """Print ``message`` on a line of standard output (above a bar on a terminal)."""
        tqdm.write(message)

    def close(self) -> None:
        """End the report: close the bar, or write the last line if a step was made."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.step != self.reported:
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        self.last, self.reported = now, self.step
        done = self.step - self.start_step
        parts = [f"{self.unit} {self.step}/{self.total} "
                 f"({100 * self.step // max(self.total, 1)}%)"]
        parts += [f"{name} {value}" for name, value in self.postfix.items()]
        if done > 0:
            per_step = (now - self.start) / done
            left = datetime.timedelta(seconds=round(per_step * (self.total - self.step)))
            parts += [f"{per_step:.3g} s/{self.unit}", f"{left} left"]
        print(f"{self.desc}: " + ", ".join(parts), file=self.file, flush=True)


def _interactive(stream: TextIO) -> bool:
    """A terminal, or a notebook's output (a Jupyter kernel's stream, where tqdm.auto draws a
    widget that updates in place)."""
    isatty = getattr(stream, "isatty", None)
    return (callable(isatty) and bool(isatty())) or type(stream).__module__.startswith("ipykernel")


def progress_range(steps: int, desc: str, enabled: bool = True, first: int = 0,
                   unit: str = "step") -> Iterator[int]:
    """``range(first, first + steps)`` with a :class:`Progress` report of ``steps`` steps, each
    counted as one ``unit`` (for samplers and other long loops).

    Examples:
        >>> sum(progress_range(4, "demo", enabled=False))
        6
    """
    bar = Progress(steps, 0, desc, enabled=enabled, unit=unit)
    try:
        for t in range(first, first + steps):
            yield t
            bar.update()
    finally:
        bar.close()


def progress_batches(total: int, batch_size: int, desc: str, enabled: bool = True,
                     unit: str = "step") -> Iterator[range]:
    """The consecutive batches ``range(start, stop)`` of at most ``batch_size`` items that
    cover ``range(total)``, with a :class:`Progress` report that counts the items of each batch
    once it is done (for evaluations and samplers that work a batch at a time).

    Examples:
        >>> [len(b) for b in progress_batches(7, 3, "demo", enabled=False)]
        [3, 3, 1]
    """
    bar = Progress(total, 0, desc, enabled=enabled, unit=unit)
    try:
        for start in range(0, total, batch_size):
            batch = range(start, min(start + batch_size, total))
            yield batch
            bar.update(len(batch))
    finally:
        bar.close()
