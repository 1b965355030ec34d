"""Built-in data sets by name, and users' own ``.npz`` files, as train/validation/test splits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import DataError, InputError
from ..validation import check_count
from .particles import particle_data
from .repulsive import repulsive_sets
from .sets import SetData, load_npz
from .shapes import shape_sets
from .surfaces import surface_clouds
from .synthetic import cluster_sets, gaussian_sets

__all__ = ["DATASETS", "SIZED_DATASETS", "load_dataset", "split_sets"]

DEFAULT_SIZES = {
    "dw4": {"train": 100_000, "val": 1_000, "test": 10_000},
    "lj13": {"train": 10_000, "val": 1_000, "test": 2_000},
    "lj55": {"train": 5_000, "val": 500, "test": 1_000},
    "gaussian-sets": {"train": 5_000, "val": 500, "test": 2_000},
    "cluster-sets": {"train": 5_000, "val": 500, "test": 2_000},
    "shape-sets": {"train": 5_000, "val": 500, "test": 2_000},
    "shape-sets-varsize": {"train": 5_000, "val": 500, "test": 2_000},
    "repulsive-sets": {"train": 5_000, "val": 500, "test": 2_000},
    # 2000 x 1000 x 3 float32 numbers are 23 MiB (230 MiB at N = 10,000); the test split is
    # small because a log-det at N D = 3000 is estimated, at seconds per set (docs/sets.md)
    "surface-clouds": {"train": 2_000, "val": 100, "test": 100},
}


def _synthetic(make: Callable[..., SetData], name: str | None = None,
               **settings) -> Callable[..., dict[str, SetData]]:
    def build(sizes: dict[str, int], seed: int, cache_dir=None, progress=False, **overrides):
        out = {}
        for index, (split, count) in enumerate(sizes.items()):
            g = torch.Generator().manual_seed(seed * 1000 + index)
            data = make(count, generator=g, **{**settings, **overrides})
            data.name = f"{name or data.name}/{split}"
            out[split] = data
        return out

    return build


def _particles(name: str) -> Callable[..., dict[str, SetData]]:
    def build(sizes: dict[str, int], seed: int, cache_dir=None, progress=False):
        return particle_data(name, sizes, seed, cache_dir, progress=progress)

    return build


DATASETS: dict[str, Callable[..., dict[str, SetData]]] = {
    "dw4": _particles("dw4"),
    "lj13": _particles("lj13"),
    "lj55": _particles("lj55"),
    "gaussian-sets": _synthetic(gaussian_sets),
    "cluster-sets": _synthetic(cluster_sets),
    "shape-sets": _synthetic(shape_sets),
    "shape-sets-varsize": _synthetic(shape_sets, "shape-sets-varsize", min_size=4, max_size=10),
    "repulsive-sets": _synthetic(repulsive_sets),
    "surface-clouds": _synthetic(surface_clouds),
}

#: built-in data sets whose number of elements per set is a setting (``set_size``)
SIZED_DATASETS = ("surface-clouds",)


def split_sets(data: SetData, val_fraction: float, seed: int) -> dict[str, SetData]:
    """Shuffle (seeded) and split one collection into train and validation parts."""
    if len(data) < 2:
        raise DataError(f"{data.name}: need at least 2 sets to split, got {len(data)}")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    n_val = min(max(1, round(val_fraction * len(data))), len(data) - 1)
    return {"train": data.subset(order[n_val:], f"{data.name}/train"),
            "val": data.subset(order[:n_val], f"{data.name}/val")}


def load_dataset(
    name_or_path: str,
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    set_size: int | None = None,
) -> dict[str, SetData]:
    """Train/val(/test) splits of a built-in data set, or of a user's ``.npz`` file.

    A built-in name gives independent ``train``, ``val`` and ``test`` splits (sizes from
    ``sizes``, else the defaults); an ``.npz`` path is shuffled and split 90/10 into ``train``
    and ``val`` (``sizes`` does not apply to it; the command line refuses ``num_train`` with a
    file). ``set_size`` sets the elements per set of the data sets in
    :data:`SIZED_DATASETS` (``None``: their default).

    Raises:
        DataError: an unknown name (the message lists the known ones) or an unusable file.
        InputError: a ``set_size`` for a data set whose set size is fixed, or below 1; sizes
            of splits the data set does not have, or that are not positive integers.

    Examples:
        >>> splits = load_dataset("surface-clouds", {"train": 4, "val": 2, "test": 2},
        ...                       set_size=64)
        >>> splits["train"].x.shape, splits["train"].name
        (torch.Size([4, 64, 3]), 'surface-clouds/train')
    """
    if set_size is not None:
        if name_or_path not in SIZED_DATASETS:
            raise InputError(f"set_size={set_size} applies to {', '.join(SIZED_DATASETS)}, "
                             f"not to {name_or_path!r} (its sets have a fixed size)")
        check_count(set_size, "set_size")
    if name_or_path in DATASETS:
        wanted = dict(DEFAULT_SIZES[name_or_path])
        unknown = sorted(set(sizes or {}) - set(wanted))
        if unknown:
            raise InputError(f"sizes names splits {unknown} that {name_or_path!r} does not "
                             f"have: its splits are {', '.join(wanted)}")
        for split, count in (sizes or {}).items():
            wanted[split] = check_count(count, f"the size of the {split} split")
        overrides = {} if set_size is None else {"set_size": set_size}
        return DATASETS[name_or_path](wanted, seed, cache_dir, progress, **overrides)
    if not name_or_path:
        raise DataError("data is empty: give a built-in data set or a .npz path")
    if name_or_path.endswith(".npz") or Path(name_or_path).exists():
        data = load_npz(name_or_path)
        if len(data) < 2:
            raise DataError(f"{name_or_path} holds {len(data)} set: fitting needs at least 2 "
                            "(sets to train on, and one or more held out to validate on)")
        return split_sets(data, 0.1, seed)
    known = ", ".join(sorted(DATASETS))
    raise DataError(f"unknown data set {name_or_path!r}: use one of {known} or a .npz path")
