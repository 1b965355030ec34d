"""Pictures of a few sets of every built-in synthetic data set, for the documentation.

Draws four test sets of each of ``gaussian-sets``, ``cluster-sets``, ``shape-sets``,
``shape-sets-varsize`` and ``repulsive-sets`` (points on a line: one set per row), each set in
its own colour over the grey cloud of 500 sets, and writes ``docs/img/data_sets.png``::

    python docs/data_sets.py                  # or: python docs/data_sets.py OUT.png

This file is not part of the site (``exclude_docs`` in mkdocs.yml).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from flowattn.data import load_dataset  # noqa: E402

NAMES = ["gaussian-sets", "cluster-sets", "shape-sets", "shape-sets-varsize", "repulsive-sets"]


def main(out: Path) -> None:
    fig, axes = plt.subplots(1, len(NAMES), figsize=(4 * len(NAMES), 4.3))
    for ax, name in zip(axes, NAMES, strict=True):
        test = load_dataset(name, {"train": 1, "val": 1, "test": 500})["test"]
        mask = test.mask if test.mask is not None else torch.ones(test.x.shape[:2], dtype=bool)
        x = test.x
        line = test.dim == 1
        if line:  # one set per row
            x = torch.cat([x, torch.arange(len(test), dtype=x.dtype)[:, None, None]
                           .expand_as(x)], -1)
            x, mask = x[:40], mask[:40]
        ax.scatter(*x[mask].T, s=2, c="0.8", rasterized=True)
        for b, marker in enumerate("osD^"):
            ax.scatter(*x[b, mask[b]].T, s=40, marker=marker, edgecolors="k", linewidths=0.4)
        nll = f"true NLL {test.mean_true_nll():.2f}, best i.i.d. {test.mean_iid_nll():.2f}"
        ax.set_title(f"{name}\n{nll} nats/set", fontsize=10)
        if line:
            ax.set_ylabel("set")
        else:
            ax.set_aspect("equal", adjustable="datalim")
    fig.suptitle("four sets of each data set in colour, 500 sets in grey (40 rows for points on "
                 "a line)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    default = Path(__file__).parent / "img" / "data_sets.png"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
