"""Collections of sets: the container, `.npz` input and output, splits and mini-batches."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError, InputError
from ..files import atomic_write, no_such_file
from ..validation import check_count

__all__ = ["SetData", "load_npz", "save_npz", "size_mask"]




@dataclass
class SetData:
    """M sets of up to N elements in R^D, padded to (M, N, D), with an optional padding mask.

    Arguments:
        x: (M, N, D) float tensor; padded entries may hold anything (NaN too) and are stored
            as zero.
        mask: (M, N) bool tensor, True where an element is present, or None (all present).
        name: where the data came from.
        zero_com: whether the sets live in the zero-centre-of-mass subspace (particle systems):
            flows fitted to them keep sum_i x_i = 0 and report NLL in the E-NF convention.
        true_log_prob: the closed-form log-density (x, mask) -> (M,) when it is known.
        meta: free-form description (sampler settings, generator parameters).
        iid_log_prob: the log-density of the sets as i.i.d. points from the exact one-point
            marginal, (x, mask) -> (M,), when it is known: the best NLL without interactions.
    """

    x: Tensor
    mask: Tensor | None = None
    name: str = "sets"
    zero_com: bool = False
    true_log_prob: Callable[[Tensor, Tensor | None], Tensor] | None = None
    meta: dict = field(default_factory=dict)
    iid_log_prob: Callable[[Tensor, Tensor | None], Tensor] | None = None

    def __post_init__(self) -> None:
        validate(self.x, self.mask, self.name)
        if self.mask is not None and bool(self.mask.all()):
            self.mask = None
        if self.mask is not None:  # padding given as anything (NaN too) is stored as zero
            self.x = torch.where(self.mask[..., None], self.x, torch.zeros_like(self.x))

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def set_size(self) -> int:
        return self.x.shape[1]

    @property
    def dim(self) -> int:
        return self.x.shape[2]

    def sizes(self) -> Tensor:
        """Number of present elements of each set, shape (M,)."""
        if self.mask is None:
            return torch.full((len(self),), self.set_size, dtype=torch.long)
        return self.mask.sum(1)

    def subset(self, index: Tensor, name: str | None = None) -> SetData:
        """The sets at ``index`` (a long tensor), sharing everything else."""
        return SetData(
            self.x[index],
            None if self.mask is None else self.mask[index],
            name or self.name,
            self.zero_com,
            self.true_log_prob,
            dict(self.meta),
            iid_log_prob=self.iid_log_prob,
        )

    def batches(
        self, batch_size: int, generator: torch.Generator | None = None, drop_last: bool = False
    ) -> Iterator[tuple[Tensor, Tensor | None]]:
        """Mini-batches (x, mask); shuffled when a generator is given."""
        check_count(batch_size, "batch_size")
        m = len(self)
        order = torch.arange(m) if generator is None else torch.randperm(m, generator=generator)
        stop = m - m % batch_size if drop_last and m >= batch_size else m
        for start in range(0, stop, batch_size):
            idx = order[start : start + batch_size]
            yield self.x[idx], None if self.mask is None else self.mask[idx]

    def mean_true_nll(self) -> float | None:
        """Average -log p_true over the sets, when the density is known in closed form."""
        if self.true_log_prob is None:
            return None
        return float(-self.true_log_prob(self.x, self.mask).mean())

    def mean_iid_nll(self) -> float | None:
        """Average -log q_iid over the sets (the best i.i.d.-points model), when it is known."""
        if self.iid_log_prob is None:
            return None
        return float(-self.iid_log_prob(self.x, self.mask).mean())


def size_mask(sizes: Tensor, set_size: int) -> Tensor:
    """The mask (M, set_size) of sets with ``sizes`` (M,) elements, the first ones present.

    Examples:
        >>> size_mask(torch.tensor([1, 3]), 3)
        tensor([[ True, False, False],
                [ True,  True,  True]])
    """
    return torch.arange(set_size, device=sizes.device) < sizes.unsqueeze(-1)


def validate(x, mask, name: str = "data") -> None:
    """Raise :class:`DataError` unless ``x`` (M, N, D) and ``mask`` (M, N) form usable sets."""
    if not isinstance(x, Tensor):
        raise DataError(f"{name}: x must be an array, got {type(x).__name__}")
    if x.dim() != 3:
        raise DataError(f"{name}: x must have shape (M, N, D), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise DataError(f"{name}: x must be floating point, got dtype {x.dtype}")
    if x.numel() == 0:
        raise DataError(f"{name}: x is empty, shape {tuple(x.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise DataError(f"{name}: mask must be boolean (True = present), got {mask.dtype}")
        if mask.shape != x.shape[:2]:
            raise DataError(f"{name}: mask must have shape (M, N) = {tuple(x.shape[:2])}, "
                            f"got {tuple(mask.shape)}")
        empty = ~mask.any(1)
        if empty.any():
            rows = empty.nonzero().flatten()[:5].tolist()
            raise DataError(f"{name}: sets {rows} have no present element")
    finite = torch.isfinite(x)
    if mask is not None:
        finite = finite | ~mask[..., None]  # padding may hold anything; it is ignored
    if not finite.all():
        bad = (~finite).any(-1).any(-1).nonzero().flatten()[:5].tolist()
        raise DataError(f"{name}: x holds NaN or Inf values (sets {bad})")


def check_names(names: Sequence[str], known: Sequence[str], argument: str, noun: str) -> None:
    """Refuse a parameter ``argument`` of a generator that must be a non-empty list of distinct
    names from ``known`` (each a ``noun``), naming what is wrong."""
    if isinstance(names, str) or len(names) == 0:
        raise InputError(f"{argument} must be a non-empty list of names, got {names!r}")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise InputError(f"unknown {noun} {unknown[0]!r}: use names from {list(known)}")
    if len(set(names)) != len(names):
        raise InputError(f"{argument} must not repeat, got {list(names)}")


def load_npz(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> SetData:
    """Load sets from an ``.npz`` file with ``x`` (M, N, D) and optional ``mask`` (M, N).

    Raises:
        DataError: a missing file or key, a wrong rank or shape, non-finite values, a mask that is
            not boolean or not (M, N), an empty array or an empty set.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"cannot read {path}: Is a directory")
    if not path.is_file():
        raise DataError(no_such_file(path))
    _check_npz_archive(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = set(archive.files)
            if "x" not in keys:
                raise DataError(f"{path}: missing key 'x' (found {sorted(keys) or 'no arrays'})")
            x_np = archive["x"]
            mask_np = archive["mask"] if "mask" in keys else None
    except DataError:
        raise
    except Exception as err:  # not a zip, corrupt, pickled objects...
        if "Object arrays" in str(err):  # e.g. sets of different sizes saved as a list
            raise DataError(f"{path}: holds Python objects, not arrays; for sets of different "
                            "sizes save x padded to (M, N, D) and a boolean mask (M, N), True "
                            "where an element is present") from None
        raise DataError(f"{path}: not a readable .npz file ({err})") from None
    if not np.issubdtype(x_np.dtype, np.floating):
        raise DataError(f"{path}: x must be floating point, got dtype {x_np.dtype}")
    if x_np.ndim != 3:  # before the arrays below, which a 0-d x would turn into scalars
        raise DataError(f"{path}: x must have shape (M, N, D), got shape {x_np.shape}")
    original, finite = x_np, np.isfinite(x_np)
    if not x_np.dtype.isnative or x_np.dtype.itemsize > 8:
        # big-endian arrays and extended precision, which torch does not read: as float64 in
        # the machine's byte order (values beyond float64 become inf and are refused below)
        with np.errstate(over="ignore"):
            x_np = x_np.astype(np.float64)
    x = torch.from_numpy(np.require(x_np, requirements="C")).to(dtype)
    overflow = torch.from_numpy(finite) & ~torch.isfinite(x)
    if overflow.any():  # finite in the file, out of range once cast
        # in the file's own precision (a long double beyond float64 would print as inf)
        largest = np.format_float_scientific(np.abs(original[overflow.numpy()]).max(),
                                             precision=2, unique=False)
        raise DataError(f"{path}: x holds values too large for {dtype} (|x| up to "
                        f"{largest}): rescale the data")
    mask = None
    if mask_np is not None:
        if mask_np.dtype != np.bool_:
            raise DataError(f"{path}: mask must be boolean (True = present), got {mask_np.dtype}")
        mask = torch.from_numpy(np.require(mask_np, requirements="C"))  # keeps 0-d
    data = SetData(x, mask, name=str(path))  # validates; errors name the file
    data.name = path.stem
    if data.mask is not None:  # padding may hold anything in the file; zero it here
        data.x = torch.where(data.mask[..., None], data.x, torch.zeros_like(data.x))
    return data


def _check_npz_archive(path: Path) -> None:
    """Refuse a file that is not an ``.npz`` archive (a zip file) by what it is instead."""
    try:
        with open(path, "rb") as file:
            head = file.read(6)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if head.startswith(b"\x93NUMPY"):
        raise DataError(f"{path} is a .npy file (one array), not an .npz archive: save the sets "
                        "with numpy.savez(path, x=x) (and mask=mask for sets of different "
                        "sizes)")
    if not head.startswith(b"PK"):
        shown = "is empty" if not head else f"starts with {head!r}"
        raise DataError(f"{path} is not an .npz archive (numpy.savez writes a zip file; this "
                        f"one {shown})")


def save_npz(path: str | os.PathLike, x: Tensor, mask: Tensor | None = None) -> None:
    """Write sets to ``path`` atomically: a temporary file in the same folder, then a rename."""
    path = Path(path)
    arrays = {"x": x.detach().cpu().numpy()}
    if mask is not None:
        arrays["mask"] = mask.detach().cpu().numpy().astype(bool)
    atomic_write(path, lambda handle: np.savez(handle, **arrays))
