"""Pictures of a fitted set flow: samples beside data; particle statistics beside data."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from ..data import PARTICLE_SYSTEMS, SetData, pairwise_distances  # noqa: E402
from ..flows.setflow import SetFlow  # noqa: E402
from .budget import eval_batch_size  # noqa: E402

__all__ = ["plot_run", "plot_sets", "plot_particles", "draw_samples", "sample_count"]


def draw_samples(flow: SetFlow, like: SetData, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` sets drawn by inverting the flow, with the sizes of the first sets of ``like``
    (at most as many as ``like`` has, and fewer for large sets: :func:`sample_count`)."""
    count = min(sample_count(count, like.set_size), len(like))
    mask = like.mask[:count] if like.mask is not None else None
    device = next(flow.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        x = flow.sample(count, like.set_size, None if mask is None else mask.to(device),
                        generator)
    if mask is None:
        mask = torch.ones(count, like.set_size, dtype=torch.bool)
    return x.detach().cpu(), mask.cpu()


def sample_count(count: int, set_size: int) -> int:
    """Sets to draw for a plot: ``count``, capped like an evaluation batch (sets x N² <= 2^22,
    :func:`~flowattn.sets.budget.eval_batch_size`), and at least 6.

    Inverting a residual flow also computes its log-det, estimated by a probe series for
    N D > 512 at seconds per set of N = 1000 (and attention holds sets x N² weights): 500
    sampled sets would take most of an hour there. Sets of up to 91 elements keep 500.

    Examples:
        >>> sample_count(500, 55), sample_count(500, 1000), sample_count(500, 10_000)
        (500, 6, 6)
    """
    return min(count, max(6, eval_batch_size(count, set_size)))


def _scatter(ax, x: Tensor, mask: Tensor, title: str, highlight: int = 6) -> None:
    line = x.shape[-1] == 1
    if line:  # points on a line: set b drawn on the horizontal line at height b
        rows = torch.arange(x.shape[0], dtype=x.dtype)[:, None, None].expand_as(x)
        x = torch.cat([x, rows], -1)
    points = x[mask]
    ax.scatter(points[:, 0], points[:, 1], s=2, c="0.75", rasterized=True)
    for b in range(min(highlight, x.shape[0])):
        pts = x[b, mask[b]]
        ax.scatter(pts[:, 0], pts[:, 1], s=18, label=f"set {b}")
    ax.set_title(title)
    if line:
        ax.set_ylabel("set")
    else:
        ax.set_aspect("equal", adjustable="box")


def plot_sets(data: SetData, samples: Tensor, sample_mask: Tensor, path: Path) -> Path:
    """Scatter of data sets beside sampled sets (first two coordinates, or one set per row for
    points on a line; a few sets coloured). For points on a line a third panel compares the
    distances between two points of a set, where repulsion or attraction shows."""
    count = samples.shape[0]
    data_mask = (data.mask[:count] if data.mask is not None
                 else torch.ones(count, data.set_size, dtype=torch.bool))
    line = data.dim == 1
    fig, axes = plt.subplots(1, 3 if line else 2, figsize=(15 if line else 10, 5))
    _scatter(axes[0], data.x[:count], data_mask, f"data ({count} sets)")
    _scatter(axes[1], samples, sample_mask, f"samples ({count} sets)")
    axes[1].set_xlim(axes[0].get_xlim())  # same window, so the two can be compared
    axes[1].set_ylim(axes[0].get_ylim())
    if line:
        real = within_set_distances(data.x[:count], data_mask)
        fake = within_set_distances(samples, sample_mask)
        bins = torch.linspace(0.0, float(torch.quantile(real, 0.99)), 50)
        for d, label in ((real, "data"), (fake, "samples")):  # the largest 1 % left out
            axes[2].hist(d[d <= bins[-1]], bins=bins, density=True, histtype="step",
                         label=label)
        axes[2].set_xlabel("distance between two points of a set (99 % of the data's)")
        axes[2].legend()
    fig.suptitle(f"{data.name}: every element in grey, six sets in colour")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def within_set_distances(x: Tensor, mask: Tensor) -> Tensor:
    """The distances ||x_i - x_j|| of every pair i < j of present elements of each set of ``x``
    (B, N, D), flattened.

    Examples:
        >>> x = torch.tensor([[[0.0], [1.0], [3.0]]])
        >>> within_set_distances(x, torch.tensor([[True, True, False]])).tolist()
        [1.0]
    """
    first, second = torch.triu_indices(x.shape[1], x.shape[1], 1)
    distances = (x[:, first] - x[:, second]).norm(dim=-1)
    return distances[mask[:, first] & mask[:, second]]


def plot_particles(data: SetData, samples: Tensor, energy_name: str, path: Path) -> Path:
    """Histograms of pairwise distances and energies, data vs samples."""
    energy = PARTICLE_SYSTEMS[energy_name].energy
    count = samples.shape[0]
    real = data.x[:count].double()
    fake = samples.double()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for x, label in ((real, "data"), (fake, "samples")):
        axes[0].hist(pairwise_distances(x).flatten(), bins=60, density=True, histtype="step",
                     label=label)
    axes[0].set_xlabel("pairwise distance")
    e_real, e_fake = energy(real), energy(fake)
    high = torch.quantile(e_real, 0.99).item() + 10
    low = e_real.min().item() - 5
    bins = torch.linspace(low, high, 60)
    axes[1].hist(e_real.clamp(low, high), bins=bins, density=True, histtype="step", label="data")
    axes[1].hist(e_fake.clamp(low, high), bins=bins, density=True, histtype="step",
                 label="samples")
    axes[1].set_xlabel("energy (clipped to the data's range)")
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{energy_name}: {count} configurations")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_run(flow: SetFlow, test: SetData, out: Path, seed: int, count: int = 500) -> list[Path]:
    """All plots of a run, written to ``out``; returns their paths."""
    samples, mask = draw_samples(flow, test, count, seed)
    paths = [plot_sets(test, samples, mask, out / "samples.png")]
    energy_name = test.meta.get("energy")
    if energy_name in PARTICLE_SYSTEMS:
        paths.append(plot_particles(test, samples, energy_name, out / "particles.png"))
    return paths
