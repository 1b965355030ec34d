"""Work on pair tensors in passes on the CPU, so that no tensor of a pass outgrows the heap.

A CPU allocator hands every block above its mmap threshold (glibc: at most 32 MB) straight from
the operating system and back, so each pass over a fresh tensor of that size pays a page fault
per 4 KB page, and the faults cost more than the arithmetic. Pair tensors, (..., N, N, ...),
grow past the threshold quickly: split along an axis whose slices are independent (the sets of
a batch, the query rows of attention), each pass's tensors stay within :data:`PAIR_BYTES` and
the heap reuses their memory from one pass to the next. On other devices one pass takes all.

Measured (one thread, ``docs/benchmarks.md``): LJ55's EGNN field at batch 100 0.35x the time;
the set flow's attention log-det at N = 3000 points.
"""

from __future__ import annotations

import torch

__all__ = ["PAIR_BYTES", "per_pass"]

# the most bytes a tensor of one pass may hold on the CPU
PAIR_BYTES = 2**24


def per_pass(item_bytes: int, items: int, device: torch.device, limit: int | None = None) -> int:
    """How many of ``items`` slices one pass takes, each slice putting ``item_bytes`` into the
    largest tensor of the pass: on the CPU as many as keep that tensor within ``limit`` bytes
    (:data:`PAIR_BYTES` by default; at least one slice), elsewhere all of them.

    Examples:
        >>> per_pass(2**20, 100, torch.device("cpu"))  # 1 MiB a slice: 16 a pass
        16
        >>> per_pass(2**30, 100, torch.device("cpu"))  # one a pass, however large
        1
    """
    if device.type != "cpu":
        return items
    limit = PAIR_BYTES if limit is None else limit
    return max(1, min(items, limit // max(1, item_bytes)))
