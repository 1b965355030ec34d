"""Tests for flowattn.branches.mlp: LipSwish, SpectralLinear and the LipschitzMLP branch."""

import pytest
import torch

from flowattn.branches.mlp import (
    CLIPSWISH_MAX_GAIN,
    LIPSWISH_MAX_SLOPE,
    CLipSwish,
    LipschitzMLP,
    LipSwish,
    SpectralLinear,
)


def _slope(beta: float) -> torch.Tensor:
    x = torch.linspace(-30, 30, 600001, dtype=torch.float64)
    s = torch.sigmoid(beta * x)
    return (s + beta * x * s * (1 - s)) / 1.1


@pytest.mark.parametrize("beta", [0.1, 1.0, 7.0])
def test_lipswish_slope_is_below_certified_bound_and_bound_is_tight(beta):
    slope = _slope(beta).abs().max()
    act = LipSwish()
    with torch.no_grad():
        act.rho.fill_(float(torch.log(torch.expm1(torch.tensor(beta, dtype=torch.float64)))))
    bound = act.lipschitz_bound()
    assert bound == LIPSWISH_MAX_SLOPE / 1.1
    assert slope <= bound <= slope * (1 + 1e-5)  # the module's constant is met, not loose


def _with_beta(act, beta: float):
    with torch.no_grad():
        act.rho.fill_(float(torch.log(torch.expm1(torch.tensor(beta, dtype=torch.float64)))))
    return act


@pytest.mark.parametrize("beta", [0.1, 1.0, 7.0])
def test_clipswish_gain_is_below_certified_bound_and_bound_is_tight(beta):
    """The Jacobian of x -> [phi(x), phi(-x)] at one coordinate is the column
    [s(beta x), -s(-beta x)] / 1.1044: its largest length over x is the certificate."""
    act = _with_beta(CLipSwish().double(), beta)
    x = torch.linspace(-30, 30, 600001, dtype=torch.float64, requires_grad=True)
    first, second = act(x.view(1, -1)).chunk(2, dim=-1)  # each half's Jacobian is diagonal
    columns = [torch.autograd.grad(half.sum(), x, retain_graph=True)[0]
               for half in (first, second)]
    gain = torch.stack(columns).pow(2).sum(0).sqrt().max()  # the halves of one coordinate
    bound = act.lipschitz_bound()
    assert bound == CLIPSWISH_MAX_GAIN / 1.1044 < 1
    assert gain <= bound <= gain * (1 + 1e-5)


def test_clipswish_slopes_and_pullback_are_the_jacobian_of_the_activation():
    act = _with_beta(CLipSwish().double(), 1.7)
    x = torch.linspace(-6, 6, 7, dtype=torch.float64).view(1, 7)
    out, slope = act.forward_and_slope(x)
    assert torch.equal(out, act(x)) and out.shape == (1, 14)
    jac = torch.autograd.functional.jacobian(lambda v: act(v.view(1, 7))[0], x[0])  # (14, 7)
    assert slope.shape == (1, 7)  # the first half's; the second's is slope - 1 / 1.1044
    assert torch.allclose(slope[0], torch.diag(jac[:7]), rtol=1e-13, atol=1e-15)
    assert torch.allclose(slope[0] - 1 / 1.1044, torch.diag(jac[7:]), rtol=1e-13, atol=1e-15)
    assert torch.count_nonzero(jac[:7] - torch.diag(torch.diag(jac[:7]))) == 0
    assert torch.count_nonzero(jac[7:] - torch.diag(torch.diag(jac[7:]))) == 0
    g = torch.randn(3, 1, 14, dtype=torch.float64)
    assert torch.allclose(act.pullback(g, slope), g @ jac, rtol=1e-13, atol=1e-15)


def test_lipswish_certified_bound_is_below_one_and_activation_has_learnable_beta():
    act = LipSwish()
    assert act.lipschitz_bound() < 1
    assert torch.nn.functional.softplus(act.rho).item() == pytest.approx(1.0, abs=1e-4)
    assert act.rho.requires_grad


def test_spectral_linear_eval_normalises_to_exact_coeff():
    torch.manual_seed(0)
    lin = SpectralLinear(6, 5, coeff=0.7).double()
    with torch.no_grad():
        lin.weight.mul_(10)
    lin.eval()
    sigma = torch.linalg.matrix_norm(lin.effective_weight(), ord=2)
    assert abs(sigma.item() - 0.7) < 1e-12
    assert abs(lin.lipschitz_bound().item() - 0.7) < 1e-12


def test_spectral_linear_power_iteration_persists_and_converges_in_training():
    torch.manual_seed(1)
    lin = SpectralLinear(8, 8, coeff=0.9).double()
    with torch.no_grad():
        lin.weight.mul_(5)
    lin.train()
    u0 = lin.u.clone()
    lin(torch.randn(2, 8, dtype=torch.float64))
    assert not torch.equal(u0, lin.u)  # the buffer is updated in place by a training call
    for _ in range(200):
        lin(torch.randn(2, 8, dtype=torch.float64))
    exact = torch.linalg.matrix_norm(lin.weight, ord=2)
    estimate = lin.sigma(update=False)
    assert estimate <= exact + 1e-12  # power iteration never overestimates
    assert (exact - estimate) / exact < 1e-6
    # the certificate is the exact norm of the applied matrix, an upper bound on the estimate
    assert lin.lipschitz_bound() >= 0.9 * estimate / exact - 1e-12
    assert "u" in lin.state_dict() and "v" in lin.state_dict()


def test_spectral_linear_certificate_is_an_upper_bound_even_when_power_iteration_lags():
    torch.manual_seed(2)
    lin = SpectralLinear(10, 10, coeff=0.9, n_power_iterations=1).double().train()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(10, 10, dtype=torch.float64) * 3)
        lin.u.copy_(torch.nn.functional.normalize(torch.randn(10, dtype=torch.float64), dim=0))
        lin.v.copy_(torch.nn.functional.normalize(torch.randn(10, dtype=torch.float64), dim=0))
    applied = lin.effective_weight(update=False)
    true_norm = torch.linalg.matrix_norm(applied, ord=2)
    assert true_norm > 0.9  # a lagging estimate under-normalises ...
    assert abs(lin.lipschitz_bound() - true_norm) < 1e-12  # ... and the certificate says so


@pytest.mark.parametrize("activation", ["lipswish", "clipswish"])
def test_lipschitz_mlp_bound_below_coeff_and_above_measured_jacobian_norm(activation):
    torch.manual_seed(3)
    mlp = LipschitzMLP(3, [16, 16], coeff=0.9, activation=activation).double().eval()
    for layer in mlp.layers:
        with torch.no_grad():
            layer.weight.mul_(4)  # force every layer onto its normalisation
    bound = mlp.lipschitz_bound(7)
    assert bound < 0.9 + 1e-9
    x = (torch.randn(256, 1, 3, dtype=torch.float64) * 2).requires_grad_(True)
    out = mlp(x)
    # pointwise map: the VJP with e_d summed over the batch gives row d of every Jacobian
    rows = [torch.autograd.grad(out[..., d].sum(), x, retain_graph=True)[0] for d in range(3)]
    jac = torch.cat(rows, dim=1)  # (256, 3, 3)
    measured = torch.linalg.matrix_norm(jac, ord=2).max()
    assert measured <= bound


def test_lipschitz_mlp_bound_is_attained_by_a_chain_at_the_slopes_maximum():
    """A width-1 chain whose every pre-activation sits at LipSwish's steepest point at x = 0:
    there the derivative is the product of the applied weights and of the largest slopes, that
    is the certificate itself (so a certificate any lower would be exceeded)."""
    mlp = LipschitzMLP(1, [1, 1], coeff=0.9).double().eval()
    u = torch.linspace(2.3, 2.5, 200001, dtype=torch.float64)  # u sigmoid(u) is steepest here
    steepest = u[torch.argmax(torch.sigmoid(u) * (1 + u * (1 - torch.sigmoid(u))))]
    with torch.no_grad():
        for layer, weight in zip(mlp.layers, (0.7, -0.8, 0.6), strict=True):
            layer.weight.fill_(weight)
        betas = [torch.nn.functional.softplus(act.rho) for act in mlp.activations]
        mlp.layers[0].bias.fill_(steepest / betas[0])
        first = mlp.activations[0](mlp.layers[0].bias.view(1, 1))
        mlp.layers[1].bias.copy_(steepest / betas[1] - mlp.layers[1].effective_weight() @ first[0])
    x = torch.zeros(1, 1, 1, dtype=torch.float64, requires_grad=True)
    (derivative,) = torch.autograd.grad(mlp(x).sum(), x)
    bound = mlp.lipschitz_bound()
    assert abs(derivative.item()) <= bound
    assert abs(derivative.item()) >= bound * (1 - 1e-5)


def test_clipswish_mlp_bound_is_attained_by_a_chain_at_the_gains_maximum():
    """One input, one pre-activation at the point where CLipSwish's column [s(u), -s(-u)] is
    longest, and a read-out row along that column: the derivative at x = 0 is the product of
    the applied norms and the activation's constant, the certificate itself."""
    mlp = LipschitzMLP(1, [1], coeff=0.9, activation="clipswish").double().eval()
    act = mlp.activations[0]
    u = torch.linspace(-2.5, -2.3, 200001, dtype=torch.float64)
    _, slope = act.forward_and_slope(u / torch.nn.functional.softplus(act.rho))
    column = torch.stack([slope, slope - 1 / 1.1044])  # (2, points): both halves' slopes
    best = torch.argmax(column.pow(2).sum(0))
    with torch.no_grad():
        mlp.layers[0].weight.fill_(0.7)
        mlp.layers[0].bias.fill_(float(u[best] / torch.nn.functional.softplus(act.rho)))
        mlp.layers[1].weight.copy_(column[:, best].view(1, 2))  # along the column
    x = torch.zeros(1, 1, 1, dtype=torch.float64, requires_grad=True)
    (derivative,) = torch.autograd.grad(mlp(x).sum(), x)
    bound = mlp.lipschitz_bound()
    assert abs(derivative.item()) <= bound
    assert abs(derivative.item()) >= bound * (1 - 1e-5)


def test_lipschitz_mlp_is_pointwise_and_zeroes_padded_rows():
    torch.manual_seed(4)
    mlp = LipschitzMLP(2, 8, coeff=0.8).double()
    x = torch.randn(3, 5, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out = mlp(x, mask=mask)
    assert (out[~mask] == 0).all()
    alone = mlp(x[:1, :3])
    assert torch.allclose(out[:1, :3], alone, atol=1e-14)
    assert LipschitzMLP.jacobian_structure == "pointwise"


def test_lipschitz_mlp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="coeff"):
        LipschitzMLP(2, 8, coeff=1.0)
    with pytest.raises(ValueError, match="hidden"):
        LipschitzMLP(2, [], coeff=0.5)
    with pytest.raises(ValueError, match="width"):
        LipschitzMLP(2, 8)(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="mode"):
        SpectralLinear(2, 2, mode="fast")
    with pytest.raises(ValueError, match="activation must be one of"):
        LipschitzMLP(2, 8, activation="relu")


def test_lipswish_slope_is_the_derivative_of_the_activation():
    act = LipSwish().double()
    with torch.no_grad():
        act.rho.fill_(0.3)
    x = torch.linspace(-8, 8, 101, dtype=torch.float64, requires_grad=True)
    out, slope = act.forward_and_slope(x)
    (grad,) = torch.autograd.grad(act(x).sum(), x)
    assert torch.equal(out, act(x))
    assert torch.allclose(slope, grad, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("activation", ["lipswish", "clipswish"])
@pytest.mark.parametrize("masked", [False, True])
def test_mlp_linearise_gives_forward_and_the_autograd_vjp_in_float64(masked, activation):
    torch.manual_seed(0)
    mlp = LipschitzMLP(3, [16, 8], coeff=0.9, activation=activation).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 5) < 0.7 if masked else None
    if masked:
        mask[:, 0] = True
    mlp.eval()  # one fixed normalisation for both calls
    out, vjp = mlp.linearise(x, mask)
    assert torch.equal(out, mlp(x, mask))
    w = torch.randn(2, 4, 5, 3, dtype=torch.float64)  # a leading batch of vectors
    auto = torch.stack([torch.autograd.grad(out, x, wi, retain_graph=True)[0] for wi in w])
    assert torch.allclose(vjp(w), auto, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("activation", ["lipswish", "clipswish"])
def test_mlp_linearise_product_is_differentiable_like_a_double_backward(activation):
    torch.manual_seed(1)
    mlp = LipschitzMLP(2, 8, coeff=0.9, activation=activation).double().eval()
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    u, v = torch.randn(2, 3, 4, 2, dtype=torch.float64)
    out, vjp = mlp.linearise(x)
    wrt = [x, *mlp.parameters()]
    mine = torch.autograd.grad((vjp(u) * v).sum(), wrt, allow_unused=True)
    (first,) = torch.autograd.grad(mlp(x), x, u, create_graph=True)
    double = torch.autograd.grad((first * v).sum(), wrt, allow_unused=True)
    for a, b, t in zip(mine, double, wrt, strict=True):
        a = torch.zeros_like(t) if a is None else a  # the last bias does not enter J
        b = torch.zeros_like(t) if b is None else b
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-13)
