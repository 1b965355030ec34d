"""The flattened nflows baseline of set flows: a normalised density, exact symmetrisation, random
element orders in training, and a short run that learns."""

import math

import pytest
import torch

from flowattn.data import SetData, load_dataset
from flowattn.errors import DataError, InputError
from flowattn.sets.baseline import (
    FlattenedSettings,
    fit_flattened,
    flattened_flow,
    flattened_nll,
    shuffled_batch,
)

SMALL = FlattenedSettings(layers=2, hidden=16, blocks=1, bins=4, batch_size=32, lr=3e-3,
                          warmup=5)


def _perturbed(flow, seed: int):
    """The flow with every parameter moved randomly: far from its near-identity start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flow.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return flow


@pytest.mark.slow
def test_flattened_flow_with_its_standardisation_integrates_to_one():
    # one element in R^2, data far from standard units: the standardisation's log-det counts
    g = torch.Generator().manual_seed(0)
    x = 3.0 + 2.5 * torch.randn(400, 1, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    flow = _perturbed(flattened_flow(SetData(x), SMALL).double(), 1).eval()
    h = 0.15
    axis = torch.arange(-16.0, 22.0, h, dtype=torch.float64)  # the mean +- 7.6 spreads
    grid = torch.cartesian_prod(axis, axis)
    with torch.no_grad():
        mass = flow.log_prob(grid).exp().sum().item() * h * h
    assert mass == pytest.approx(1.0, abs=2e-3)


def _flow_and_pairs():
    """A perturbed flattened flow (float64) of sets of two points in the plane, and five sets."""
    g = torch.Generator().manual_seed(2)
    train = SetData(torch.randn(64, 2, 2, generator=g, dtype=torch.float64))
    torch.manual_seed(0)
    test = SetData(torch.randn(5, 2, 2, generator=g, dtype=torch.float64))
    return _perturbed(flattened_flow(train, SMALL).double(), 3).eval(), test


def test_symmetrised_nll_sums_every_order_when_orders_cover_them():
    flow, test = _flow_and_pairs()
    with torch.no_grad():
        forward = flow.log_prob(test.x.flatten(1))
        swapped = flow.log_prob(test.x.flip(1).flatten(1))
    assert not torch.allclose(forward, swapped)  # the flow itself is not symmetric
    by_hand = -(torch.logaddexp(forward, swapped) - math.log(2)).mean().item()
    assert flattened_nll(flow, test, orders=2) == pytest.approx(by_hand, rel=1e-12)
    # one random order per set: the flow's own NLL in that order, above the symmetrised one
    one = flattened_nll(flow, test, orders=1, seed=5)
    assert -torch.maximum(forward, swapped).mean().item() - 1e-9 <= one
    assert one <= -torch.minimum(forward, swapped).mean().item() + 1e-9
    assert one > flattened_nll(flow, test, orders=2)  # Jensen, strict for this flow


def test_nll_with_reflections_averages_every_order_in_every_mirror_image():
    flow, test = _flow_and_pairs()
    signs = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]],
                         dtype=torch.float64)
    with torch.no_grad():
        log_q = torch.stack([flow.log_prob((x * s).flatten(1)) for s in signs
                             for x in (test.x, test.x.flip(1))])  # (8, 5)
    assert (log_q - log_q[0]).abs().max() > 0.1  # the flow itself is not symmetric
    by_hand = -(torch.logsumexp(log_q, 0) - math.log(8)).mean().item()
    nll = flattened_nll(flow, test, orders=2, reflections=True)
    assert nll == pytest.approx(by_hand, rel=1e-12)
    # exactly invariant: the same NLL for the mirrored sets
    mirrored = SetData(test.x * torch.tensor([-1.0, 1.0], dtype=torch.float64))
    assert flattened_nll(flow, mirrored, orders=2, reflections=True) == pytest.approx(nll)
    assert nll < flattened_nll(flow, test, orders=2)  # Jensen, strict for this flow


def test_training_on_mirrored_sets_runs_and_learns(monkeypatch):
    import flowattn.sets.baseline as baseline

    splits = load_dataset("shape-sets", {"train": 500, "val": 8, "test": 200})
    settings = FlattenedSettings(**{**SMALL.__dict__, "reflections": True})
    torch.manual_seed(0)
    initial = flattened_nll(flattened_flow(splits["train"], settings), splits["test"])
    flow, info = fit_flattened(splits["train"], seconds=120, settings=settings, max_steps=40)
    fitted = flattened_nll(flow, splits["test"], reflections=True)
    assert fitted < initial - 1.0, (initial, fitted)
    # what the flow trains on: sets of positive points come mirrored, each set whole
    seen = []

    def recording(train, settings):
        flow = flattened_flow(train, settings)
        log_prob = flow.log_prob
        flow.log_prob = lambda x: seen.append(x.detach().clone()) or log_prob(x)
        return flow

    monkeypatch.setattr(baseline, "flattened_flow", recording)
    positive = SetData(splits["train"].x.abs() + 0.1)
    for mirrored, options in ((True, settings), (False, SMALL)):
        seen.clear()
        fit_flattened(positive, seconds=120, settings=options, max_steps=3)
        signs = torch.cat(seen).view(-1, 8, 2).sign()  # (sets, N, D)
        assert (signs == signs[:, :1]).all()  # one pattern per set
        negative = (signs[:, 0] < 0).double().mean(0)  # share of sets flipped, per axis
        if mirrored:
            assert ((negative - 0.5).abs() < 0.15).all(), negative
        else:
            assert (negative == 0).all()


def test_shuffled_batches_permute_the_elements_of_each_set_in_fresh_orders():
    x = torch.arange(3 * 5 * 2, dtype=torch.float64).reshape(3, 5, 2)
    batch = shuffled_batch(x, 200, torch.Generator().manual_seed(0))
    orders = set()
    for s in batch:
        source = int(s[0, 0]) // 10  # every feature of set m lies in [10 m, 10 m + 10)
        assert sorted(s[:, 0].tolist()) == x[source, :, 0].tolist()
        assert torch.equal(s[:, 1], s[:, 0] + 1)  # elements move whole
        orders.add(tuple((s[:, 0] - 10 * source).long().tolist()))
    assert len(orders) > 50  # of 120 orders of five elements, not a fixed one


def test_a_short_run_beats_its_initialisation_on_the_test_split():
    splits = load_dataset("shape-sets", {"train": 500, "val": 8, "test": 200})
    torch.manual_seed(0)  # fit_flattened seeds the same initial weights
    initial = flattened_nll(flattened_flow(splits["train"], SMALL), splits["test"])
    flow, info = fit_flattened(splits["train"], seconds=120, settings=SMALL, max_steps=80)
    fitted = flattened_nll(flow, splits["test"])
    assert info["steps"] == 80 and math.isfinite(fitted)
    assert fitted < initial - 2.0, (initial, fitted)  # nats per set of 16 dimensions


def test_sets_of_several_sizes_and_bad_budgets_are_refused_by_name():
    varsize = load_dataset("shape-sets-varsize", {"train": 16, "val": 4, "test": 4})["train"]
    with pytest.raises(DataError, match="several sizes"):
        flattened_flow(varsize)
    train = load_dataset("shape-sets", {"train": 16, "val": 4, "test": 4})["train"]
    with pytest.raises(InputError, match="seconds must be positive, got 0"):
        fit_flattened(train, seconds=0)
    with pytest.raises(InputError, match="orders must be >= 1, got 0"):
        flattened_nll(flattened_flow(train, SMALL), train, orders=0)
