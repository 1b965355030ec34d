"""Tests for pair splines: the tournament, exact log-det, inverse, symmetries, padding, errors."""

import itertools
import math

import pytest
import torch

from flowattn.errors import InputError
from flowattn.flows import PairSplines, set_flow
from flowattn.flows.logdet import LogDetOptions
from flowattn.flows.pairs import round_robin
from flowattn.sets.config import SetsRunConfig

DT = torch.float64


def _layer(dim=3, seed=0, scale=0.6, bins=6, bound=2.0):
    """A layer far from the identity (random spline parameters), in float64."""
    torch.manual_seed(seed)
    layer = PairSplines(dim, bins=bins, bound=bound).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, scale)
    return layer


def _logdet_by_jacobian(layer, x, mask=None):
    """log|det| of the layer's Jacobian with respect to the present elements of x (1, N, D)."""
    present = torch.ones(x.shape[1], dtype=torch.bool) if mask is None else mask[0]

    def restricted(values):
        full = x.clone()
        full[0, present] = values.reshape(-1, x.shape[-1])
        return layer(full, mask)[0][0, present].reshape(-1)

    jac = torch.autograd.functional.jacobian(restricted, x[0, present].reshape(-1))
    return torch.linalg.slogdet(jac)[1]


@pytest.mark.parametrize("n", range(1, 10))
def test_round_robin_meets_every_pair_once_in_disjoint_rounds(n):
    rounds = round_robin(n)
    met = [tuple(sorted(p)) for r in rounds for p in r]
    assert sorted(met) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        players = [i for p in r for i in p]
        assert len(players) == len(set(players))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_round_robin_refuses_no_players():
    with pytest.raises(InputError, match="at least one player"):
        round_robin(0)


def test_starts_as_the_identity():
    x = torch.randn(4, 6, 3, dtype=DT)
    y, logdet = PairSplines(3).double()(x)  # unit slopes, up to the float32 initialisation
    torch.testing.assert_close(y, x, rtol=0, atol=1e-8)
    assert logdet.abs().max() < 1e-6


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 4, 5])
def test_logdet_is_the_exact_jacobian_logdet(dim, n):
    layer = _layer(dim, seed=n)
    x = torch.randn(3, n, dim, dtype=DT)
    _, logdet = layer(x)
    assert logdet.abs().min() > 0.05  # far from the identity
    for i in range(3):
        exact = _logdet_by_jacobian(layer, x[i:i + 1])
        torch.testing.assert_close(logdet[i], exact, rtol=1e-9, atol=1e-9)


def test_inverse_undoes_forward_and_its_logdet():
    layer = _layer(3)
    x = torch.randn(5, 7, 3, dtype=DT)
    y, logdet = layer(x)
    assert (y - x).abs().max() > 0.1
    x_back, logdet_back = layer.inverse(y)
    torch.testing.assert_close(x_back, x, rtol=0, atol=1e-10)
    torch.testing.assert_close(logdet + logdet_back, torch.zeros(5, dtype=DT), rtol=0,
                               atol=1e-10)


def test_keeps_the_centre_of_mass_and_commutes_with_rotations_and_translations():
    layer = _layer(3)
    x = torch.randn(4, 6, 3, dtype=DT)
    y, logdet = layer(x)
    torch.testing.assert_close(y.mean(1), x.mean(1), rtol=0, atol=1e-12)
    rotation = torch.linalg.qr(torch.randn(3, 3, dtype=DT)).Q  # a rotation or a reflection
    shift = torch.randn(1, 1, 3, dtype=DT)
    y_moved, logdet_moved = layer(x @ rotation + shift)
    torch.testing.assert_close(y_moved, y @ rotation + shift, rtol=0, atol=1e-10)
    torch.testing.assert_close(logdet_moved, logdet, rtol=0, atol=1e-10)


def test_is_not_permutation_equivariant():
    """The rounds follow the elements' order (documented): permuting the particles changes the
    log-det in general."""
    layer = _layer(2)
    x = torch.randn(2, 4, 2, dtype=DT)
    _, logdet = layer(x)
    _, logdet_perm = layer(x[:, [2, 0, 3, 1]])
    assert (logdet - logdet_perm).abs().max() > 1e-3


def test_moves_a_pair_by_the_spline_of_its_log_distance():
    """Two particles: the distance becomes exp(S(log r)) along the same axis, the midpoint stays,
    and the log-det is log S'(s) + D (S(s) - s) -- checked against a finite difference of S."""
    layer = _layer(3)
    d = torch.tensor([0.3, -0.4, 1.2], dtype=DT)  # r = 1.3
    mid = torch.tensor([0.5, 0.1, -0.2], dtype=DT)
    x = torch.stack([mid + d / 2, mid - d / 2])[None]
    y, logdet = layer(x)
    d_new = y[0, 0] - y[0, 1]
    torch.testing.assert_close((y[0, 0] + y[0, 1]) / 2, mid)
    torch.testing.assert_close(d_new / d_new.norm(), d / d.norm())

    def spline_of_log(s):
        r = math.exp(s)
        pair = torch.stack([d / d.norm() * r / 2, -d / d.norm() * r / 2])[None]
        out = layer(pair)[0][0]
        return math.log(float((out[0] - out[1]).norm().detach()))

    s, h = math.log(1.3), 1e-5
    slope = (spline_of_log(s + h) - spline_of_log(s - h)) / (2 * h)
    s_new = spline_of_log(s)
    assert abs(s_new - s) > 0.01
    assert float(logdet[0].detach()) == pytest.approx(math.log(slope) + 3 * (s_new - s), abs=1e-7)


def test_padded_elements_stay_and_leave_the_logdet():
    layer = _layer(2)
    x = torch.randn(2, 5, 2, dtype=DT)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    y, logdet = layer(x, mask)
    torch.testing.assert_close(y[0, 3:], x[0, 3:], rtol=0, atol=0)
    _, logdet_alone = layer(x[:1, :3])
    torch.testing.assert_close(logdet[0], logdet_alone[0])
    torch.testing.assert_close(logdet[0], _logdet_by_jacobian(layer, x[:1], mask[:1]))
    x_back, _ = layer.inverse(y, mask)
    torch.testing.assert_close(x_back, x, rtol=0, atol=1e-10)


def test_coincident_particles_stay_with_finite_gradients():
    layer = _layer(3)
    pair = torch.ones(1, 2, 3, dtype=DT)
    y, logdet = layer(pair)  # r = 0: below e^{-B}, where the spline is the identity
    torch.testing.assert_close(y, pair, rtol=0, atol=0)
    assert logdet.abs().max() < 1e-6
    x = torch.zeros(1, 3, 3, dtype=DT)
    x[0, 2] = torch.tensor([1.0, 0.5, 0.0], dtype=DT)
    x.requires_grad_(True)
    y, logdet = layer(x)
    (y.square().sum() + logdet.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_bad_settings_and_input_are_refused():
    with pytest.raises(InputError, match="dim and bins"):
        PairSplines(0)
    with pytest.raises(InputError, match="bound must be positive"):
        PairSplines(3, bound=0.0)
    with pytest.raises(InputError, match="3"):
        PairSplines(3)(torch.randn(2, 4, 2))


def test_in_a_particle_flow_and_its_settings():
    torch.manual_seed(0)
    flow = set_flow(2, blocks=2, heads=1, zero_com=True, norm="2", interaction="radial",
                    mlp=False, pair_splines=True, logdet=LogDetOptions("exact")).double()
    assert sum(isinstance(m, PairSplines) for m in flow.modules()) == 2
    x = torch.randn(8, 4, 2, dtype=DT)
    x = x - x.mean(1, keepdim=True)
    log_prob = flow.log_prob(x)
    assert torch.isfinite(log_prob).all()
    config = SetsRunConfig.build({"data": "dw4", "pair_splines": True})
    assert config.flow.pair_splines
    with pytest.raises(ValueError, match="pair_splines is a setting of residual flows"):
        SetsRunConfig.build({"data": "dw4", "flow": "cnf", "pair_splines": True})
