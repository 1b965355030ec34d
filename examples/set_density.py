"""Fit a residual flow to sets with the Python API, score held-out sets, sample new ones.

The same job as ``flowattn sets fit``, written out: data, flow, optimiser, one loop.

    python examples/set_density.py [--quick]
"""

import argparse

import torch

from flowattn.data import gaussian_sets
from flowattn.flows import LogDetOptions, set_flow
from flowattn.flows.base import set_dims


def main(quick: bool) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    train, test = gaussian_sets(2000, generator=g), gaussian_sets(500, generator=g)

    flow = set_flow(dim=2, blocks=2 if quick else 4, heads=1, hidden=32,
                    logdet=LogDetOptions("exact"))
    optimiser = torch.optim.Adam(flow.parameters(), lr=3e-3)
    steps = 20 if quick else 600
    for step in range(steps):
        x = train.x[torch.randint(len(train), (64,), generator=g)]
        loss = -flow.log_prob(x).mean() / set_dims(x).mean()  # nats per dimension
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:4d}: training NLL {loss.item():.4f} nats/dim")

    flow.eval()  # deterministic, exact log-likelihood
    nll = -flow.log_prob(test.x).mean().item() / 16
    print(f"test NLL {nll:.4f} nats/dim, true {test.mean_true_nll() / 16:.4f} nats/dim")
    samples = flow.sample(5, set_size=8, generator=torch.Generator().manual_seed(1))
    print("five sampled sets, shape", tuple(samples.shape))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
