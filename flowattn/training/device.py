"""Which device a run uses: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``, checked before any work;
and whether ``torch.compile`` can build kernels for it."""

from __future__ import annotations

import os
import re
import shutil
import sys

import torch

from ..errors import ConfigError, InputError

__all__ = ["resolve_device", "set_threads", "cpp_compiler", "check_compilable", "NO_COMPILER"]

NO_COMPILER = ("torch.compile on CPU (inductor) builds C++ kernels: no C++ compiler ($CXX, "
               "or g++ where CXX is unset) was found")


def set_threads(count: int | None) -> None:
    """Use ``count`` intra-op threads in torch (a ``--threads`` flag); None keeps torch's.

    Examples:
        >>> set_threads(None)  # nothing changes
    """
    if count is None:
        return
    if count < 1:
        raise InputError(f"--threads must be >= 1, got {count}")
    torch.set_num_threads(count)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device ``name`` asks for; ``cuda`` without an index is the process's GPU.

    Arguments:
        name: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available, else CPU).
        local_rank: the process's index on its machine (``torchrun``'s LOCAL_RANK).

    Raises:
        ConfigError: for any other name, or CUDA asked for where there is none, or a GPU index
            the machine does not have.

    Examples:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> try:
        ...     resolve_device("gpu")
        ... except ConfigError as err:
        ...     print(err)
        device 'gpu' is not one of cpu, cuda, cuda:N, auto
    """
    match = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", name if isinstance(name, str) else "")
    if match is None:
        raise ConfigError(f"device {name!r} is not one of cpu, cuda, cuda:N, auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but CUDA is not available on this "
                          "machine (use --device cpu)")
    index = local_rank if match.group(1) is None else int(match.group(1))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device cuda:{index} was asked for, but this machine has "
                          f"{torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU, where it is an executable: $CXX when
    set (inductor then tries nothing else), otherwise g++ (clang++ on macOS); None if that one
    is not found.

    Examples:
        >>> import shutil
        >>> cpp_compiler() in (None, shutil.which(os.environ.get("CXX") or "g++"))
        True
    """
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return shutil.which(name)


def check_compilable(device: torch.device) -> None:
    """Refuse ``torch.compile`` where it cannot build kernels: on the CPU without a C++
    compiler (the error would otherwise come from deep inside the first compiled call).

    Raises:
        ConfigError: naming the missing compiler and the way out.

    Examples:
        >>> check_compilable(torch.device("cuda"))  # GPU kernels need no C++ compiler
    """
    if device.type == "cpu" and cpp_compiler() is None:
        cxx = os.environ.get("CXX")
        if cxx:  # inductor takes $CXX alone when it is set
            raise ConfigError(f"--compile: torch.compile on CPU (inductor) builds C++ kernels "
                              f"with $CXX, and CXX={cxx!r} is not an executable on PATH; set "
                              "CXX to an installed compiler (or unset it to use g++) or train "
                              "without --compile")
        raise ConfigError(f"--compile: {NO_COMPILER}; install one (e.g. apt-get install g++) "
                          "or train without --compile")
