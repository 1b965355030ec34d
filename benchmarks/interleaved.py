"""Timing a piece of work in several modes (today's code and the code before a change, patched
back in) in interleaved rounds in one process, so that slow drifts of the machine hit every
mode alike; shared by the scripts that time a speed-up against the code before it."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from entry import positive_int
from machine import cpu_name

__all__ = ["add_timing_arguments", "start", "timed"]


def add_timing_arguments(parser: argparse.ArgumentParser, rounds: int, repeats: int) -> None:
    """--device, --rounds, --repeats and --threads, with these defaults."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--repeats", type=int, default=repeats, help="calls timed per round")
    parser.add_argument("--threads", type=positive_int, help="intra-op threads (default: torch's)")


def start(parser: argparse.ArgumentParser, args: argparse.Namespace,
          positive: tuple[str, ...] = ("rounds", "repeats")) -> tuple[int, int]:
    """Check that the ``positive`` arguments are, set the threads, print the machine's line,
    and return (rounds, repeats): (1, 1) with ``args.quick``."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"device: {args.device} ({name}), threads: {torch.get_num_threads()}, "
          f"torch {torch.__version__}, {rounds} interleaved round(s) of {repeats} call(s)\n")
    return rounds, repeats


def timed(run: Callable[[], Any], modes: dict[str, Callable[[], AbstractContextManager]],
          rounds: int, repeats: int, device: str,
          agree: Callable[[Any, Any], bool]) -> tuple[dict[str, float], bool]:
    """Median ms per call of ``run`` in each mode (a context factory; the first is today's),
    over interleaved rounds after one warm-up call each, and whether every mode's result
    ``agree``\\ s with today's."""
    results = {}
    for mode, context in modes.items():
        with context():
            results[mode] = run()  # warm-up, and the values compared
    today = results[next(iter(modes))]
    same = all(agree(result, today) for result in results.values())
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, context in modes.items():
            with context():
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                begin = time.perf_counter()
                for _ in range(repeats):
                    run()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[mode].append((time.perf_counter() - begin) / repeats * 1e3)
    return {mode: statistics.median(t) for mode, t in times.items()}, same
