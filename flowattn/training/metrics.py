"""``metrics.jsonl`` and TensorBoard: one record schema for every command.

Every record is one JSON line ``{"step": int, "split": "train" | "val" | "test" | "event",
"time": unix seconds, ...values}``; numeric values also go to TensorBoard as ``split/name``.
When a run continues from a checkpoint at step ``s``, records past ``s`` (written by the attempt
that was interrupted) are dropped from the file, a torn last line is dropped, and TensorBoard
purges its events past ``s``: the log reads as if the run had never stopped. A fresh run starts
both from nothing.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import RunError
from ..files import atomic_write_text

__all__ = ["MetricsLog", "METRICS", "read_metrics"]

METRICS = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file; a torn last line (an interrupted write) is left out.

    Raises:
        RunError: if a line other than the last is not a JSON object (naming file and line).
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record")
        except ValueError:
            if number == len(lines):  # torn by an interruption mid-write
                break
            raise RunError(f"{path}, line {number}, is not a metrics record: repair or remove "
                           "the file") from None
        records.append(record)
    return records


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, also inside dicts and lists, as None: strict
    JSON has no NaN or Infinity."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Append records to ``out/metrics.jsonl`` and, optionally, TensorBoard under ``out``.

    Arguments:
        out: the run folder.
        start: the step the run continues from (0: a fresh run, the old log is removed).
        enabled: False on every process but the first of a distributed run.
        tensorboard: also write TensorBoard events (if the package is installed).
    """

    def __init__(self, out: Path, start: int, enabled: bool = True,
                 tensorboard: bool = True) -> None:
        self.path = Path(out) / METRICS
        self.tensorboard_dir = Path(out) / "tensorboard"
        self.start = start
        self.enabled = enabled
        self.tensorboard = tensorboard and enabled
        self._writer = None
        if not enabled:
            return
        if start == 0:
            self.path.unlink(missing_ok=True)
            shutil.rmtree(self.tensorboard_dir, ignore_errors=True)
        else:
            kept = [r for r in read_metrics(self.path) if r["step"] <= start]
            atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), self.path)

    def _tensorboard(self):
        if self._writer is None and self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # TensorBoard is optional
                self.tensorboard = False
                return None
            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir),
                                         purge_step=self.start or None)
        return self._writer

    def log(self, step: int, split: str, **values: Any) -> None:
        """Append one record; numbers also go to TensorBoard as ``split/name``."""
        if not self.enabled:
            return
        record = {"step": step, "split": split, "time": time.time(),
                  **json_safe(values)}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        writer = self._tensorboard()
        if writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(f"{split}/{name}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
