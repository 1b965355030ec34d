"""Start-up time of the command line: ``--help`` and an argument error, against bare Python.

Each command runs in a fresh interpreter, in interleaved rounds, beside ``python -c pass`` (the
floor no command can beat) and ``python -c "import torch"`` (what every command paid before the
parsers were built without torch). Medians in milliseconds and ratios to importing torch.

    python benchmarks/startup.py             # 7 rounds
    python benchmarks/startup.py --rounds 15
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

from entry import run_main

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "flowattn --help": [sys.executable, "-m", "flowattn", "--help"],
    "flowattn sets fit --help": [sys.executable, "-m", "flowattn", "sets", "fit", "--help"],
    "flowattn lm train --help": [sys.executable, "-m", "flowattn", "lm", "train", "--help"],
    "flowattn sets fit --steps five": [sys.executable, "-m", "flowattn", "sets", "fit",
                                       "--steps", "five"],
    "flowattn lm train --print-config": [sys.executable, "-m", "flowattn", "lm", "train",
                                         "--print-config"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for cmd in COMMANDS.values():  # warm the file cache
        subprocess.run(cmd, capture_output=True)
    for _ in range(args.rounds):
        for name, cmd in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(cmd, capture_output=True)
            times[name].append(time.perf_counter() - start)
    torch_ms = 1000 * statistics.median(times["python -c 'import torch'"])
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{args.rounds} rounds, medians")
    print("| command | ms | × import torch |")
    print("| --- | ---: | ---: |")
    for name, values in times.items():
        ms = 1000 * statistics.median(values)
        print(f"| `{name}` | {ms:.0f} | {ms / torch_ms:.2f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
