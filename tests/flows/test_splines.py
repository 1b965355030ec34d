"""Tests for the branch-free rational-quadratic spline: nflows' values and gradients, the
derivative, the inverse, the tails, and one graph under torch.compile."""

import pytest
import torch
from nflows.transforms.splines.rational_quadratic import (
    DEFAULT_MIN_BIN_WIDTH,
    unconstrained_rational_quadratic_spline,
)

from flowattn.flows.splines import _knots, rational_quadratic

DT = torch.float64
BOUND = 2.0


def _case(seed=0, shape=(7, 5), bins=6, scale=1.5):
    """Spline parameters far from the identity and inputs inside, outside, at both ends and at
    inner knots of the spline's interval, in float64."""
    g = torch.Generator().manual_seed(seed)
    w = scale * torch.randn(*shape, bins, generator=g, dtype=DT)
    h = scale * torch.randn(*shape, bins, generator=g, dtype=DT)
    d = scale * torch.randn(*shape, bins - 1, generator=g, dtype=DT)
    x = 1.5 * BOUND * (2 * torch.rand(*shape, generator=g, dtype=DT) - 1)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = -BOUND, BOUND, 0.0, 3 * BOUND
    return x, w, h, d


def _nflows(x, w, h, d, inverse=False):
    return unconstrained_rational_quadratic_spline(
        x, w, h, d, inverse=inverse, tails="linear", tail_bound=BOUND)


@pytest.mark.parametrize("inverse", [False, True])
def test_values_and_gradients_are_nflows(inverse):
    x, w, h, d = _case()
    leaves = [t.clone().requires_grad_() for t in (x, w, h, d)]
    ours = rational_quadratic(*leaves, bound=BOUND, inverse=inverse)
    theirs = _nflows(*leaves, inverse=inverse)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(x), torch.randn_like(x)
    grads = [torch.autograd.grad(sum((o * v).sum() for o, v in zip(out, weights, strict=True)),
                                 leaves) for out in (ours, theirs)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_an_input_at_an_inner_knot_goes_to_the_same_bin_as_in_nflows():
    x, w, h, d = _case(seed=1)
    x = _knots(w, BOUND, DEFAULT_MIN_BIN_WIDTH)[0][..., 3]  # exactly on the third inner knot
    for a, b in zip(rational_quadratic(x, w, h, d, BOUND), _nflows(x, w, h, d),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_log_slope_is_the_derivative():
    x, w, h, d = _case(seed=2)
    x = x.clamp(-1.9, 1.9).requires_grad_()  # away from the ends, where the tails meet it
    y, logslope = rational_quadratic(x, w, h, d, BOUND)
    (slope,) = torch.autograd.grad(y.sum(), x)  # elementwise map: the gradient is dy/dx
    torch.testing.assert_close(logslope, slope.log(), rtol=1e-10, atol=1e-10)


def test_inverse_round_trip_and_log_slopes_cancel():
    x, w, h, d = _case(seed=3)
    y, forward = rational_quadratic(x, w, h, d, BOUND)
    x_back, backward = rational_quadratic(y, w, h, d, BOUND, inverse=True)
    torch.testing.assert_close(x_back, x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(backward, -forward, rtol=1e-9, atol=1e-9)


def test_identity_outside_the_interval_and_the_ends_fixed():
    x, w, h, d = _case(seed=4)
    y, logslope = rational_quadratic(x, w, h, d, BOUND)
    outside = x.abs() > BOUND
    assert outside.any() and (~outside).any()
    assert torch.equal(y[outside], x[outside])
    assert torch.equal(logslope[outside], torch.zeros_like(logslope[outside]))
    ends = torch.tensor([-BOUND, BOUND], dtype=DT).expand(7, 2)
    y_ends, log_ends = rational_quadratic(ends, w[:, :2], h[:, :2], d[:, :2], BOUND)
    torch.testing.assert_close(y_ends, ends, rtol=0, atol=1e-12)
    torch.testing.assert_close(log_ends, torch.zeros_like(log_ends), rtol=0, atol=1e-12)
    # inside, the spline is far from the identity
    assert (y[~outside] - x[~outside]).abs().max() > 0.1


def test_float32_has_no_nan_at_the_ends_and_in_the_tails():
    x, w, h, d = (t.float() for t in _case(seed=5, scale=4.0))
    x = torch.cat([x, torch.full_like(x[:1], 1e30), torch.full_like(x[:1], -BOUND)])
    w, h, d = (torch.cat([t, t[:2]]) for t in (w, h, d))
    for inverse in (False, True):
        y, logslope = rational_quadratic(x, w, h, d, BOUND, inverse=inverse)
        assert torch.isfinite(y).all() and torch.isfinite(logslope).all()


@pytest.mark.parametrize("inverse", [False, True])
def test_one_graph_under_compile(inverse):
    """No data-dependent branch or shape: the whole spline is one graph (nflows' is not)."""
    x, w, h, d = _case(seed=6)
    explained = torch._dynamo.explain(
        lambda *a: rational_quadratic(*a, bound=BOUND, inverse=inverse))(x, w, h, d)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    theirs = torch._dynamo.explain(lambda *a: _nflows(*a, inverse=inverse))(x, w, h, d)
    assert theirs.graph_break_count > 0


@pytest.mark.parametrize("inverse", [False, True])
def test_the_centroid_flows_spline_layer_is_nflows_layer(inverse):
    """SetLocation's autoregressive spline gives nflows' values with nflows' state dict."""
    from nflows.transforms import MaskedPiecewiseRationalQuadraticAutoregressiveTransform

    from flowattn.flows.layers import _AutoregressiveSpline

    settings = dict(features=3, hidden_features=16, context_features=2, num_bins=6,
                    tails="linear", tail_bound=BOUND)
    torch.manual_seed(0)
    ours = _AutoregressiveSpline(**settings).double()
    theirs = MaskedPiecewiseRationalQuadraticAutoregressiveTransform(**settings).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.5)  # far from the identity
    theirs.load_state_dict(ours.state_dict())
    x, context = 1.5 * torch.randn(9, 3, dtype=DT), torch.randn(9, 2, dtype=DT)
    a = ours.inverse(x, context) if inverse else ours(x, context)
    b = theirs.inverse(x, context) if inverse else theirs(x, context)
    assert (a[0] - x).abs().max() > 0.1
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10)
