"""What every reproduction shares: grids, results, output files, figures, inputs and weights."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

import torch
from matplotlib.figure import Figure
from pydantic import Field, TypeAdapter, ValidationError
from torch import Tensor, nn

from ..errors import InputError
from ..training.run import prepare_out_dir
from . import GRIDS

__all__ = [
    "Count",
    "Counts",
    "NonNegative",
    "Positive",
    "Positives",
    "Coefficients",
    "Names",
    "Sizes",
    "ReproResult",
    "check_grid",
    "grid_config",
    "new_figure",
    "save_figure",
    "output_paths",
    "write_csv",
    "write_json",
    "finish_result",
    "finite_or_none",
    "uniform_sets",
    "glorot_init_",
    "log_slope",
]


def check_grid(grid: str) -> str:
    """Return ``grid`` if it names a grid size, else raise ``ValueError``."""
    if grid not in GRIDS:
        raise InputError(f"unknown grid {grid!r}: choose from {', '.join(GRIDS)}")
    return grid


# the kinds of settings of the reproductions' configuration dataclasses, checked by
# grid_config (pydantic reads the constraints from the annotations)
Count = Annotated[int, Field(strict=True, ge=1)]
NonNegative = Annotated[int, Field(strict=True, ge=0)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Counts = Annotated[tuple[Count, ...], Field(min_length=1)]
Positives = Annotated[tuple[Positive, ...], Field(min_length=1)]
Coefficients = Annotated[tuple[Annotated[float, Field(gt=0, lt=1)], ...], Field(min_length=1)]
Names = Annotated[tuple[str, ...], Field(min_length=1)]
Sizes = Annotated[tuple[tuple[Count, Count], ...], Field(min_length=1)]


def grid_config(cls, presets: dict[str, dict], grid: str, seed: int | None, overrides: dict):
    """Instantiate the configuration dataclass ``cls`` for ``grid``, then apply ``overrides``.

    Unknown override names are an error (a typo should not silently run the default grid), and
    so is a value of the wrong kind (the field's annotation: a count >= 1, a positive finite
    number, a non-empty tuple of them, ...), named with the value.

    Examples:
        >>> from flowattn.repro.layernorm import PRESETS, LayerNormConfig
        >>> grid_config(LayerNormConfig, PRESETS, "quick", None, {"dims": [4]}).dims
        (4,)
        >>> grid_config(LayerNormConfig, PRESETS, "quick", None, {"eps": float("nan")})
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: LayerNormConfig: eps: Input should be a finite number (got nan)
    """
    check_grid(grid)
    config = cls(**presets[grid])
    names = {f.name for f in fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise InputError(f"unknown {cls.__name__} field(s): {', '.join(sorted(unknown))}")
    if seed is not None:
        overrides = {**overrides, "seed": seed}
    if not overrides:
        return config
    try:
        checked = TypeAdapter(cls).validate_python(
            {f.name: getattr(config, f.name) for f in fields(cls)} | overrides)
    except ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise InputError(f"{cls.__name__}: {where}: {problem['msg']} (got "
                         f"{problem['input']!r})") from None
    return replace(config, **{name: getattr(checked, name) for name in overrides})


@dataclass
class ReproResult:
    """The outcome of one reproduction.

    Attributes:
        name: the reproduction's name (``flowattn repro NAME``).
        grid: ``"quick"``, ``"default"``, ``"full"`` or ``"custom"``.
        config: the settings it ran with.
        rows: the table written to the CSV file, one dict per row.
        summary: headline numbers and the outcome of the qualitative checks.
        files: kind (``"png"``, ``"csv"``, ``"json"``) -> path of each file written.
        seconds: wall-clock time of the run.
    """

    name: str
    grid: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers become ``None``)."""
        return finite_or_none(
            {
                "name": self.name,
                "grid": self.grid,
                "config": self.config,
                "summary": self.summary,
                "rows": self.rows,
                "seconds": self.seconds,
            }
        )


def finite_or_none(value: Any) -> Any:
    """Recursively replace NaN and infinities by ``None`` (JSON has no such numbers)."""
    if isinstance(value, dict):
        return {str(k): finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write ``payload`` as indented JSON (non-finite numbers as null)."""
    path = Path(path)
    path.write_text(json.dumps(finite_or_none(payload), indent=1, allow_nan=False) + "\n")
    return path


def write_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as CSV; the header is the union of the keys, in first-seen order."""
    path = Path(path)
    header: list[str] = []
    for row in rows:
        header.extend(k for k in row if k not in header)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    return path


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "nan")
    return value


def new_figure(rows: int = 1, cols: int = 1, width: float = 4.2, height: float = 3.2):
    """A figure with a ``rows`` x ``cols`` grid of axes, drawn by the Agg renderer.

    The figure is built without pyplot, so producing it never touches the caller's backend or
    opens a window. Returns (figure, 2-D array of axes).
    """
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = 90) -> Path:
    """Save ``fig`` as a PNG; a modest resolution keeps files small enough to commit."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def output_paths(out: str | os.PathLike, name: str) -> dict[str, Path]:
    """Create the folder ``out``; return the PNG, CSV and JSON paths of reproduction ``name``."""
    folder = prepare_out_dir(out)
    stem = name.replace("-", "_")
    return {ext: folder / f"{stem}.{ext}" for ext in ("png", "csv", "json")}


def uniform_sets(
    batch: int,
    n: int,
    dim: int,
    spread: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Tensor:
    """Inputs of Kim et al. (2021, §5.2): x_1 = 0 and every other x_ij ~ U[-spread, spread].

    At x_i = 0 the attention row of DP-MHA is uniform and d f_i / d x_i grows with the variance
    of the other inputs (proof of Thm 3.1), so these inputs probe where dot-product attention
    is least Lipschitz.
    """
    if batch < 1 or n < 2 or dim < 1:
        raise InputError(f"need batch >= 1, n >= 2, dim >= 1; got {batch}, {n}, {dim}")
    if not spread > 0:
        raise InputError(f"spread must be positive, got {spread}")
    x = (2 * torch.rand(batch, n, dim, generator=generator, dtype=dtype) - 1) * spread
    x[:, 0] = 0.0
    return x.to(device)


@torch.no_grad()
def glorot_init_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Glorot-uniform initialisation of every weight matrix, biases zero (Kim et al. 2021, App. H).

    Stacked projections (a (3D, D) query-key-value matrix) are initialised block by block, so
    each D x D map gets the same distribution whichever module holds it; the L2 and dot-product
    attention modules then draw comparable weights.
    """
    for name, param in module.named_parameters():
        if param.dim() == 2:
            width = param.shape[1]
            if param.shape[0] % width:
                raise InputError(f"{name}: shape {tuple(param.shape)} is not a stack of squares")
            for block in param.split(width, dim=0):
                values = torch.empty(block.shape, dtype=torch.float64)
                nn.init.xavier_uniform_(values, generator=generator)
                block.copy_(values)
        elif name.endswith("bias"):
            param.zero_()
    return module


def log_slope(ns: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` against log(ns): the growth per factor e of N."""
    logs = [math.log(n) for n in ns]
    if len(logs) < 2:
        return math.nan
    mx, my = sum(logs) / len(logs), sum(values) / len(values)
    sxx = sum((a - mx) ** 2 for a in logs)
    return sum((a - mx) * (b - my) for a, b in zip(logs, values, strict=True)) / sxx


def finish_result(name: str, grid: str, config, rows: list[dict], summary: dict,
                  started: float, out, plot, rows_in_json: bool = True) -> ReproResult:
    """Wrap a reproduction's rows and summary; with ``out``, write its PNG, CSV and JSON.

    ``plot(png_path)`` draws the figure and may return extra fields for the JSON; ``started``
    is the ``perf_counter`` value at the start of the run. With ``rows_in_json=False`` the
    rows are left to the CSV.
    """
    result = ReproResult(name, grid, asdict(config), rows, summary)
    result.seconds = time.perf_counter() - started
    if out is not None:
        paths = output_paths(out, name)
        extra = plot(paths["png"]) or {}
        write_csv(paths["csv"], rows)
        result.files = {k: str(v) for k, v in paths.items()}
        record = result.to_json()
        if not rows_in_json:
            record["rows"] = None
        write_json(paths["json"], {**record, **extra})
    return result
