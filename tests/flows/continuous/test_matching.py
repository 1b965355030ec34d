"""Flow matching: the loss against the straight path's velocity, its minimiser (the marginal
velocity, in closed form for Gaussian data), the zero-centre-of-mass and padded cases, fields
that take one time per set, and a CNF trained by matching to its data's likelihood."""

import math

import pytest
import torch
from torch import nn

from flowattn.errors import InputError
from flowattn.flows import CNF, AttentionField, EGNNField, SetFlow


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class ScaledField(nn.Module):
    """f(t, z) = k c(t) z / T with c the marginal velocity's coefficient for data N(0, s^2 I)
    and base N(0, I) on the straight path: E[z - x | x_t = y] = c(t) y with
    c = (tau - (1 - tau) s^2) / ((1 - tau)^2 s^2 + tau^2), tau = t / T."""

    def __init__(self, sigma: float, t1: float, k: float = 1.0):
        super().__init__()
        self.sigma, self.t1, self.k = sigma, t1, k

    def coefficient(self, t):
        tau, s2 = t / self.t1, self.sigma ** 2
        return (tau - (1 - tau) * s2) / ((1 - tau) ** 2 * s2 + tau ** 2) / self.t1

    def forward(self, t, z, mask=None):
        t = torch.as_tensor(t, dtype=z.dtype).reshape(-1, *([1] * (z.dim() - 1)))
        return self.k * self.coefficient(t) * z


class TanhField(nn.Module):
    """A nonlinear field with one time per set: f(t, z) = (1 + t) tanh(z W)."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(randn(dim, dim, seed=7))

    def forward(self, t, z, mask=None):
        t = torch.as_tensor(t, dtype=z.dtype).reshape(-1, 1, 1)
        return (1 + t) * torch.tanh(z @ self.w)


def test_matching_loss_is_the_squared_error_against_the_straight_path_velocity():
    cnf = CNF(TanhField(2), t1=2.0)
    x, z, t = randn(5, 3, 2, seed=1), randn(5, 3, 2, seed=2), 2.0 * torch.rand(5).double()
    loss = cnf.matching_loss(x, noise=z, times=t)
    u = (z - x) / 2.0  # the path x + (t / T)(z - x) moves at (z - x) / T
    path = x + t.reshape(-1, 1, 1) * u
    expected = (cnf.field(t, path) - u).pow(2).sum(dim=(1, 2))
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    assert cnf.field.w.grad is not None and cnf.field.w.grad.abs().max() > 0


@pytest.mark.parametrize("t", [0.1, 0.5, 0.8])
def test_matching_loss_is_minimised_by_the_marginal_velocity(t):
    # E l(k) - E l(1) = (k - 1)^2 E||v*(x_t)||^2: the marginal velocity is the minimiser, and
    # the excess of a scaled field is its squared distance to it (Monte Carlo, 400 000 sets)
    sigma, t1, count = 0.5, 1.5, 400_000
    x, z = sigma * randn(count, 2, 3, seed=3), randn(count, 2, 3, seed=4)
    times = torch.full((count,), t * t1, dtype=torch.float64)
    losses = {k: CNF(ScaledField(sigma, t1, k), t1=t1).matching_loss(x, noise=z, times=times)
              .mean() for k in (0.8, 1.0, 1.2)}
    tau = t
    variance = (1 - tau) ** 2 * sigma ** 2 + tau ** 2  # of each coordinate of x_t
    c = ScaledField(sigma, t1).coefficient(torch.tensor(tau * t1, dtype=torch.float64))
    v2 = c ** 2 * variance * 6
    for k in (0.8, 1.2):
        excess = losses[k] - losses[1.0]
        assert excess > 0
        torch.testing.assert_close(excess, (k - 1) ** 2 * v2, rtol=0.05, atol=0.0)


def test_zero_com_matching_projects_the_noise_and_is_invariant_under_rotations_and_permutations():
    torch.manual_seed(0)
    field = EGNNField(2, hidden=8, layers=2).double()
    cnf = CNF(field)
    x = randn(4, 5, 2, seed=1)
    x = x - x.mean(dim=1, keepdim=True)
    z, t = randn(4, 5, 2, seed=2), torch.rand(4, dtype=torch.float64)
    loss = cnf.matching_loss(x, noise=z, times=t)
    centred = z - z.mean(dim=1, keepdim=True)
    torch.testing.assert_close(cnf.matching_loss(x, noise=centred, times=t), loss)
    q, _ = torch.linalg.qr(randn(2, 2, seed=5))
    perm = torch.tensor([2, 0, 4, 1, 3])
    torch.testing.assert_close(cnf.matching_loss(x @ q.T, noise=z @ q.T, times=t), loss)
    torch.testing.assert_close(cnf.matching_loss(x[:, perm], noise=z[:, perm], times=t), loss)
    with pytest.raises(InputError, match="inputs must be centred"):
        cnf.matching_loss(x + 1.0, noise=z, times=t)


def test_padded_elements_add_nothing_to_the_matching_loss():
    torch.manual_seed(0)
    cnf = CNF(EGNNField(2, hidden=8, layers=2).double())
    x, z, t = randn(1, 3, 2, seed=1), randn(1, 3, 2, seed=2), torch.tensor([0.4]).double()
    x = x - x.mean(dim=1, keepdim=True)
    alone = cnf.matching_loss(x, noise=z, times=t)
    padded = torch.cat([x, 7.0 + randn(1, 2, 2, seed=3)], dim=1)
    noise = torch.cat([z, randn(1, 2, 2, seed=4)], dim=1)
    mask = torch.tensor([[True, True, True, False, False]])
    torch.testing.assert_close(cnf.matching_loss(padded, mask, noise=noise, times=t), alone)


def test_matching_loss_refuses_draws_of_the_wrong_shape():
    cnf = CNF(TanhField(2))
    x = randn(3, 4, 2)
    with pytest.raises(InputError, match="noise must be a tensor of the inputs' shape"):
        cnf.matching_loss(x, noise=randn(3, 4, 3))
    with pytest.raises(InputError, match=r"times must be a tensor of shape \(3,\)"):
        cnf.matching_loss(x, times=torch.rand(4).double())


def test_matching_loss_refuses_times_off_the_path_and_non_finite_draws():
    # times beyond t1 trained past the noise, silently; NaN gave a loss of NaN
    cnf = CNF(TanhField(2))
    x = randn(3, 4, 2)
    with pytest.raises(InputError, match=r"times must lie in \[0, t1\] = \[0, 1\]"):
        cnf.matching_loss(x, times=torch.full((3,), 5.0, dtype=torch.float64))
    with pytest.raises(InputError, match="times contains 3 non-finite"):
        cnf.matching_loss(x, times=torch.full((3,), float("nan"), dtype=torch.float64))
    with pytest.raises(InputError, match="noise contains 24 non-finite"):
        cnf.matching_loss(x, noise=torch.full_like(x, float("nan")))
    with pytest.raises(InputError, match="times must be a tensor of shape"):
        cnf.matching_loss(x, times=0.5)
    with pytest.raises(InputError, match="noise has dtype torch.float32"):
        cnf.matching_loss(x, noise=x.float())
    loss = cnf.matching_loss(x, times=torch.rand(3))  # float32 times serve a float64 flow
    assert loss.dtype == torch.float64 and torch.isfinite(loss).all()


@pytest.mark.parametrize("make", [
    lambda: EGNNField(2, hidden=8, layers=2),
    lambda: AttentionField(2, heads=1, layers=2, hidden=8),
], ids=["egnn", "attention"])
def test_fields_take_one_time_per_set(make):
    torch.manual_seed(0)
    field = make().double()
    z, t = randn(3, 4, 2), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    together = field(t, z)
    for b in range(3):
        torch.testing.assert_close(together[b : b + 1], field(t[b], z[b : b + 1]))
    assert (together[0] - field(t[1], z[:1])[0]).abs().max() > 1e-6  # time matters
    with pytest.raises(InputError, match="one time or one per set"):
        field(torch.rand(2).double(), z)


def test_a_cnf_trained_by_matching_reaches_its_data_likelihood():
    # centred sets of 4 points in 2-D, each coordinate N(0, 0.5^2) on the subspace: the true
    # NLL is 6 (1/2 log(2 pi s^2) + 1/2) nats; the untrained flow scores 0.32 nats/dim worse
    sigma, dims = 0.5, 6
    torch.manual_seed(0)
    flow = SetFlow(CNF(EGNNField(2, hidden=16, layers=2)), dim=2, zero_com=True)
    generator = torch.Generator().manual_seed(0)
    optimiser = torch.optim.Adam(flow.parameters(), lr=3e-3)

    def data(count):
        x = sigma * torch.randn(count, 4, 2, generator=generator)
        return x - x.mean(dim=1, keepdim=True)

    truth = 0.5 * math.log(2 * math.pi * sigma ** 2) + 0.5
    test = data(512)
    flow.eval()
    with torch.no_grad():  # scored without a graph of the solve: 0.5 GB instead of 4
        before = -flow.log_prob(test).mean().item() / dims
    flow.train()
    for _ in range(300):
        loss = flow.matching_loss(data(128), generator=generator).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    flow.eval()
    with torch.no_grad():
        after = -flow.log_prob(test).mean().item() / dims
    assert before - truth > 0.25
    assert abs(after - truth) < 0.03, (before, after, truth)
