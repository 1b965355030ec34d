"""Tests for flowattn.flows.inverse: per-set fixed-point / Anderson inverses and their errors."""

import pytest
import torch

from flowattn.flows.inverse import (
    InverseNotConverged,
    anderson_inverse,
    fixed_point_inverse,
    residual_inverse,
)

SOLVERS = [fixed_point_inverse, anderson_inverse]


def hard_branch(c: float, n: int = 4, d: int = 3, dtype=torch.float32, seed: int = 0):
    """g(x) = c tanh(vec(x) A) with A symmetric, eigenvalues in [-1, -0.2]: near x = 0 the
    Jacobian has an eigenvalue close to -c, the slowest case for the plain iteration."""
    gen = torch.Generator().manual_seed(seed)
    m = n * d
    a = torch.randn(m, m, generator=gen, dtype=torch.float64)
    _, vecs = torch.linalg.eigh(a + a.T)
    a = (vecs @ torch.diag(-torch.linspace(0.2, 1.0, m, dtype=torch.float64)) @ vecs.T).to(dtype)

    def g(x, mask=None):
        out = c * torch.tanh(x.reshape(x.shape[0], -1) @ a).reshape(x.shape)
        return out if mask is None else out * mask.unsqueeze(-1).to(out.dtype)

    return g


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("c", [0.9, 0.97])
def test_inverse_round_trip_float32_within_1e_5_for_coeff_up_to_0_97(solver, c):
    torch.manual_seed(0)
    g = hard_branch(c)
    x = 0.5 * torch.randn(16, 4, 3)
    y = x + g(x)
    x_rec = solver(g, y, tol=1e-7, max_iter=2000)
    assert (x_rec - x).abs().max() <= 1e-5
    y_rec = x_rec + g(x_rec)
    assert (y_rec - y).abs().max() <= 1e-5


def test_anderson_needs_at_least_three_times_fewer_evaluations_at_coeff_0_97():
    torch.manual_seed(1)
    g = hard_branch(0.97, dtype=torch.float64)
    x = 0.5 * torch.randn(16, 4, 3, dtype=torch.float64)
    y = x + g(x)
    _, plain = fixed_point_inverse(g, y, tol=1e-6, max_iter=5000, return_stats=True)
    _, anderson = anderson_inverse(g, y, tol=1e-6, max_iter=5000, return_stats=True)
    assert plain["evaluations"] >= 3 * anderson["evaluations"]


@pytest.mark.parametrize("solver", SOLVERS)
def test_convergence_is_per_set_easy_sets_stop_early(solver):
    g = hard_branch(0.97, dtype=torch.float64)
    x = torch.zeros(3, 4, 3, dtype=torch.float64)
    x[0] = 0.5  # a hard set; the others start at their solution x = y = 0 (g(0) = 0)
    y = x + g(x)
    x_rec, stats = solver(g, y, tol=1e-10, max_iter=5000, return_stats=True)
    assert stats["iterations"][1:].max() == 1
    assert stats["iterations"][0] > 5
    assert stats["evaluations"] == int(stats["iterations"].sum())
    assert (x_rec - x).abs().max() < 1e-8


@pytest.mark.parametrize("solver", SOLVERS)
def test_non_convergence_raises_with_residual_and_iteration_count(solver):
    g = hard_branch(0.97)
    y = torch.randn(4, 4, 3)
    with pytest.raises(InverseNotConverged) as info:
        solver(g, y, tol=1e-7, max_iter=2)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.iterations == 2 and err.unconverged >= 1 and err.residual > 1e-7
    assert "did not converge" in str(err)


def test_expanding_branch_is_reported_not_returned():
    def g(x, mask=None):  # Lipschitz 1.5: the iteration diverges
        return -1.5 * x

    with pytest.raises(InverseNotConverged):
        fixed_point_inverse(g, torch.randn(2, 3, 2), max_iter=50)


@pytest.mark.parametrize("solver", SOLVERS)
def test_warm_start_at_the_solution_converges_in_one_iteration(solver):
    g = hard_branch(0.9, dtype=torch.float64)
    x = 0.5 * torch.randn(5, 4, 3, dtype=torch.float64)
    y = x + g(x)
    _, cold = solver(g, y, tol=1e-9, return_stats=True)
    _, warm = solver(g, y, x0=x, tol=1e-9, return_stats=True)
    assert int(warm["iterations"].max()) == 1 < int(cold["iterations"].max())


@pytest.mark.parametrize("solver", SOLVERS)
def test_padded_elements_are_returned_unchanged_and_do_not_affect_the_rest(solver):
    torch.manual_seed(2)
    w = 0.8 * torch.linalg.qr(torch.randn(2, 2, dtype=torch.float64))[0]

    def g(x, mask=None):  # mean-field coupling over present elements
        m = torch.ones(x.shape[:2], dtype=x.dtype) if mask is None else mask.to(x.dtype)
        mean = (x * m.unsqueeze(-1)).sum(1, keepdim=True) / m.sum(1).reshape(-1, 1, 1)
        return 0.5 * torch.tanh((x + mean) @ w) * m.unsqueeze(-1)

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    y = torch.randn(2, 4, 2, dtype=torch.float64)
    x = solver(g, y, mask, tol=1e-12)
    assert torch.equal(x[0, 3], y[0, 3])
    alone = solver(g, y[:1, :3], tol=1e-12)
    assert (x[0, :3] - alone[0]).abs().max() < 1e-10


def test_implicit_gradient_of_the_inverse_equals_inverse_jacobian():
    torch.manual_seed(3)
    g = hard_branch(0.9, n=2, d=2, dtype=torch.float64)
    y = (0.5 * torch.randn(1, 2, 2, dtype=torch.float64)).requires_grad_(True)
    x = residual_inverse(g, y, method="anderson", tol=1e-12)
    jac_inv = torch.stack(
        [torch.autograd.grad(x.flatten()[i], y, retain_graph=True)[0].flatten() for i in range(4)]
    )
    x_star = x.detach()
    jac_g = torch.autograd.functional.jacobian(lambda z: g(z.reshape(1, 2, 2)).flatten(), x_star)
    expected = torch.linalg.inv(torch.eye(4, dtype=torch.float64) + jac_g.reshape(4, 4))
    assert (jac_inv - expected).abs().max() < 1e-9


def test_implicit_gradient_wrt_branch_parameters_passes_gradcheck():
    torch.manual_seed(4)
    y = 0.5 * torch.randn(2, 3, 2, dtype=torch.float64)
    w0 = 0.7 * torch.linalg.qr(torch.randn(2, 2, dtype=torch.float64))[0]

    def inverse_of(w):
        return residual_inverse(lambda x, m: torch.tanh(x @ w), y, tol=1e-13, max_iter=500)

    assert torch.autograd.gradcheck(inverse_of, (w0.requires_grad_(True),), atol=1e-6)


def test_solvers_reject_bad_arguments():
    g = hard_branch(0.5)
    y = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="tol"):
        fixed_point_inverse(g, y, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        anderson_inverse(g, y, max_iter=0)
    with pytest.raises(ValueError, match="x0"):
        anderson_inverse(g, y, x0=torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="method must be"):
        residual_inverse(g, y, method="newton")


def test_anderson_survives_collinear_residuals_in_float32():
    # For a linear branch every residual is a multiple of the first, so the Anderson system is
    # rank-deficient; in float32 a tiny regulariser is below resolution and would leave it
    # exactly singular. The solver must still converge.
    y = torch.randn(64, 4, 2, generator=torch.Generator().manual_seed(0))
    x = anderson_inverse(lambda z, m: 0.5 * z, y, tol=1e-6, max_iter=200)
    torch.testing.assert_close(x + 0.5 * x, y, rtol=0, atol=1e-5)
