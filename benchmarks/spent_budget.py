"""How much of its Lipschitz budget does each contractive attention branch of a trained set flow
use?

A contractive attention branch f = c F / bound(F) is certified Lip(f) <= c in its norm. The
certificate is only useful if the trained branch actually moves its input at a rate near c
somewhere on the data. For a finished ``flowattn sets fit`` run this script feeds training sets
through the flow, captures the input of every contractive attention module (a forward
pre-hook), and computes the exact Jacobian norm of the module at each captured set in the
module's own norm ("inf", "2,inf" or 2; float64). It prints, per module, the largest and the
median Jacobian norm over the sets and the largest as a fraction of the coefficient c.

    python benchmarks/spent_budget.py RUN_DIR [--sets 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from entry import run_main

from flowattn.attention.contractive import ContractiveAttention
from flowattn.data import load_dataset
from flowattn.lipschitz import jacobian_norm
from flowattn.sets.train import load_flow


def captured_inputs(flow, x, mask):
    """The (x, mask) each contractive attention module of ``flow`` sees on the batch.

    A residual block calls its branch either directly or through the branch's ``linearise``
    (its closed-form Jacobian products), so both entry points are watched."""
    seen, restore = {}, []
    for name, module in flow.named_modules():
        if not isinstance(module, ContractiveAttention):
            continue
        for entry in ("forward", "linearise"):
            original = getattr(module, entry, None)
            if original is None:  # no closed-form products (e.g. lifted attention)
                continue

            def watched(x, mask=None, *args, name=name, module=module, original=original,
                        **kwargs):
                seen.setdefault(name, (module, x.detach(), mask))
                return original(x, mask, *args, **kwargs)

            setattr(module, entry, watched)  # an instance attribute shadows the method
            restore.append((module, entry))
    try:
        with torch.no_grad():
            flow.log_prob(x, mask)
    finally:
        for module, entry in restore:
            delattr(module, entry)
    return seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished `flowattn sets fit` run folder")
    parser.add_argument("--sets", type=int, default=512, help="training sets to evaluate on")
    args = parser.parse_args(argv)
    flow, record = load_flow(args.run)
    flow = flow.double()
    config = record["config"]
    sizes = None if config.data.num_train is None else {"train": config.data.num_train}
    data = load_dataset(config.data.data, sizes, seed=config.train.seed)["train"]
    count = min(args.sets, len(data))
    x = data.x[:count].double()
    mask = None if data.mask is None else data.mask[:count]
    seen = captured_inputs(flow, x, mask)
    if not seen:
        print("no contractive attention module in this flow", file=sys.stderr)
        return 1
    print("| module | norm | c | largest Jacobian norm | median | largest / c |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (module, inputs, masks) in seen.items():
        values = []
        for i in range(inputs.shape[0]):
            m = None if masks is None else masks[i : i + 1]
            keep = slice(None) if m is None else m[0]

            def f(z, module=module, m=m, row=inputs[i : i + 1], keep=keep):
                full = row.clone()
                full[0, keep] = z
                return module(full, m)[0, keep]

            values.append(float(jacobian_norm(f, inputs[i, keep], module.norm)))
        top = max(values)
        print(f"| {name} | {module.norm} | {module.coeff:g} | {top:.3f} | "
              f"{statistics.median(values):.3f} | {top / module.coeff:.2f} |")
    return 0


if __name__ == "__main__":
    run_main(main)
