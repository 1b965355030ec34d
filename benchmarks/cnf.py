"""CNF on sets: certified-Lipschitz L2 attention field vs dot-product field, same data and budget.

Both fields have the same width, heads, layers and time network; both CNFs are trained with the
same seed, optimiser and number of steps on sets of 4-8 points in 2-D drawn from a mixture of
Gaussian clusters (all points of a set share one cluster, so a good model must let the points
interact). Reported, at the start and at the end of training:

* function evaluations (NFE) of one forward solve on a fixed evaluation batch (no gradients,
  Hutchinson divergence) and of the training solves (forward and backward);
* wall-clock time per training step;
* test NLL (nats per set and per point) with the exact divergence.

    python benchmarks/cnf.py                    # the recorded configuration (a few minutes)
    python benchmarks/cnf.py --steps 20 --quick # a fast smoke run
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch
from entry import positive_int, run_main

from flowattn.flows.continuous.cnf import CNF
from flowattn.flows.continuous.fields import AttentionField, DotProductField

# ----------------------------------------------------------------------------- configuration
CLUSTERS = 4  # cluster centres on a circle
RADIUS = 3.0  # of that circle
SPREAD = 0.3  # standard deviation of the points around their set's centre
MIN_POINTS, MAX_POINTS = 4, 8
WIDTH, HEADS, LAYERS, TIME_WIDTH = 16, 2, 2, 16
TOLERANCE = 1e-5  # atol = rtol of dopri5, training and evaluation


def make_sets(num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (num, 8, 2) sets and their masks; every set lies around one random centre."""
    sizes = torch.randint(MIN_POINTS, MAX_POINTS + 1, (num,), generator=generator)
    mask = torch.arange(MAX_POINTS)[None, :] < sizes[:, None]
    angle = 2 * math.pi * torch.randint(0, CLUSTERS, (num,), generator=generator) / CLUSTERS
    centre = RADIUS * torch.stack([angle.cos(), angle.sin()], dim=-1)
    points = centre[:, None, :] + SPREAD * torch.randn(num, MAX_POINTS, 2, generator=generator)
    return points * mask[..., None], mask


def build(kind: str, seed: int, divergence: str, generator: torch.Generator) -> CNF:
    torch.manual_seed(seed)  # identical initialisation of the shared parts
    field_class = AttentionField if kind == "L2 (certified)" else DotProductField
    field = field_class(2, heads=HEADS, layers=LAYERS, hidden=WIDTH, time_hidden=TIME_WIDTH)
    return CNF(
        field,
        divergence=divergence,
        generator=generator,
        atol=TOLERANCE,
        rtol=TOLERANCE,
        max_steps=2000,
    )


def eval_nfe(cnf: CNF, x: torch.Tensor, mask: torch.Tensor) -> int:
    divergence = cnf.divergence
    cnf.divergence = "hutchinson"
    with torch.no_grad():
        cnf(x, mask=mask)
    cnf.divergence = divergence
    return cnf.nfe_forward


def test_nll(cnf: CNF, x: torch.Tensor, mask: torch.Tensor, batch: int) -> tuple[float, float]:
    divergence = cnf.divergence
    cnf.divergence = "exact"
    total = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            total += -cnf.log_prob(x[i : i + batch], mask[i : i + batch]).sum().item()
    cnf.divergence = divergence
    return total / x.shape[0], total / mask.sum().item()


def train(kind: str, args, data) -> dict:
    train_x, train_mask, eval_x, eval_mask, test_x, test_mask = data
    cnf = build(kind, args.seed, args.divergence, torch.Generator().manual_seed(args.seed + 1))
    params = sum(p.numel() for p in cnf.parameters())
    opt = torch.optim.Adam(cnf.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(args.seed + 2)
    record = {"kind": kind, "params": params, "steps": []}
    record["nfe_eval_start"] = eval_nfe(cnf, eval_x, eval_mask)
    if not args.quick:
        record["nll_start"] = test_nll(cnf, test_x, test_mask, args.batch)
    if kind == "L2 (certified)":
        record["bound_start"] = cnf.field.lipschitz_bound(MAX_POINTS).item()
    for step in range(args.steps):
        idx = torch.randint(0, train_x.shape[0], (args.batch,), generator=batches)
        start = time.perf_counter()
        loss = -cnf.log_prob(train_x[idx], train_mask[idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - start
        record["steps"].append((seconds, cnf.nfe_forward, cnf.nfe_backward, loss.item()))
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"{kind:15s} step {step:4d} loss {loss.item():8.3f} nfe {cnf.nfe_forward:4d}"
                f"+{cnf.nfe_backward:4d} {seconds:6.2f}s",
                flush=True,
            )
    record["nfe_eval_end"] = eval_nfe(cnf, eval_x, eval_mask)
    record["nll_end"] = test_nll(cnf, test_x, test_mask, args.batch)
    if kind == "L2 (certified)":
        record["bound_end"] = cnf.field.lipschitz_bound(MAX_POINTS).item()
    return record


def window(record: dict, which: str, column: int, size: int) -> float:
    steps = record["steps"]
    part = steps[:size] if which == "start" else steps[-size:]
    return statistics.mean(s[column] for s in part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--divergence", default="hutchinson", choices=["exact", "hutchinson"])
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--test-size", type=int, default=1024)
    parser.add_argument("--window", type=int, default=20, help="steps averaged at start/end")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="skip the start-of-training NLL")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(args.seed)
    train_x, train_mask = make_sets(args.train_size, g)
    eval_x, eval_mask = make_sets(256, g)
    test_x, test_mask = make_sets(args.test_size, g)
    data = (train_x, train_mask, eval_x, eval_mask, test_x, test_mask)

    records = [train(kind, args, data) for kind in ("L2 (certified)", "dot-product")]

    w = min(args.window, args.steps)
    print()
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s); steps {args.steps}, batch {args.batch}, lr {args.lr}, "
        f"divergence {args.divergence} (training), dopri5 atol=rtol={TOLERANCE}"
    )
    header = ["", "params", "NFE eval start", "NFE eval end", "NFE train fwd+bwd start",
              "NFE train fwd+bwd end", "s/step start", "s/step end", "test NLL/set",
              "test NLL/point"]
    rows = []
    for r in records:
        nll_set, nll_point = r["nll_end"]
        rows.append([
            r["kind"], str(r["params"]), str(r["nfe_eval_start"]), str(r["nfe_eval_end"]),
            f"{window(r, 'start', 1, w) + window(r, 'start', 2, w):.1f}",
            f"{window(r, 'end', 1, w) + window(r, 'end', 2, w):.1f}",
            f"{window(r, 'start', 0, w):.3f}", f"{window(r, 'end', 0, w):.3f}",
            f"{nll_set:.3f}", f"{nll_point:.3f}",
        ])
    l2, dp = records

    def ratio(key_fn) -> str:
        return f"{key_fn(l2) / key_fn(dp):.2f}"

    rows.append([
        "ratio L2 / DP", ratio(lambda r: r["params"]),
        ratio(lambda r: r["nfe_eval_start"]), ratio(lambda r: r["nfe_eval_end"]),
        ratio(lambda r: window(r, "start", 1, w) + window(r, "start", 2, w)),
        ratio(lambda r: window(r, "end", 1, w) + window(r, "end", 2, w)),
        ratio(lambda r: window(r, "start", 0, w)), ratio(lambda r: window(r, "end", 0, w)),
        "", "",
    ])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if "nll_start" in l2:
        print(f"test NLL/set at initialisation: L2 {l2['nll_start'][0]:.3f}, "
              f"DP {dp['nll_start'][0]:.3f}")
    print(f"certified Lipschitz bound of the L2 field (inf-norm, n={MAX_POINTS}): "
          f"start {l2['bound_start']:.3g}, end {l2['bound_end']:.3g}")
    target = l2["nfe_eval_end"] <= 0.7 * dp["nfe_eval_end"]
    print(f"target NFE(L2) <= 0.7 NFE(DP) at the end of training: "
          f"{'met' if target else 'not met'} ({ratio(lambda r: r['nfe_eval_end'])})")


if __name__ == "__main__":
    run_main(main)
