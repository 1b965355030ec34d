"""Tests of flowattn.flows.continuous.cnf: log-dets, masks, regularisers, counters and errors."""

from __future__ import annotations

import math

import pytest
import torch
from nflows.distributions.normal import StandardNormal
from nflows.flows.base import Flow
from nflows.transforms.base import CompositeTransform
from torch import nn
from torchdiffeq import odeint

from flowattn.errors import InputError, ODESolverError
from flowattn.flows.base import standard_normal_log_prob
from flowattn.flows.continuous.cnf import CNF
from flowattn.flows.geometry import sample_probes, subtract_mean

TIGHT = dict(atol=1e-10, rtol=1e-10)


class MeanField(nn.Module):
    """f_i(z, t) = W2 tanh(W1 z_i + U mean_j z_j + t c): equivariant, maskable, non-linear."""

    def __init__(self, dim: int = 2, hidden: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(dim, hidden, generator=g) / dim**0.5)
        self.u = nn.Parameter(torch.randn(dim, hidden, generator=g) / dim**0.5)
        self.c = nn.Parameter(torch.randn(hidden, generator=g))
        self.w2 = nn.Parameter(torch.randn(hidden, dim, generator=g) / hidden**0.5)
        self.dim = dim

    def forward(self, t, z, mask=None):
        w = torch.ones(z.shape[:2], dtype=z.dtype) if mask is None else mask.to(z.dtype)
        mean = (z * w[..., None]).sum(1, keepdim=True) / w.sum(1)[:, None, None]
        return torch.tanh(z @ self.w1 + mean @ self.u + t * self.c) @ self.w2


class LinearField(nn.Module):
    """f_i(z) = z_i A^T, the same linear map on every element."""

    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(a)

    def forward(self, t, z, mask=None):
        return z @ self.a.t()


class CountingField(nn.Module):
    def __init__(self, field: nn.Module):
        super().__init__()
        self.field, self.calls = field, 0

    def forward(self, t, z, mask=None):
        self.calls += 1
        return self.field(t, z, mask)


def flow_map(field, x, t1=1.0, zero_com=False):
    """The solved flow map x -> z(t1), by odeint directly (the ground truth)."""

    def rhs(t, z):
        f = field(t, z)
        return subtract_mean(f) if zero_com else f

    t = torch.tensor([0.0, t1], dtype=x.dtype)
    return odeint(rhs, x, t, **TIGHT)[-1]


def true_logabsdet(field, x, t1=1.0, zero_com=False):
    """log|det| of the flow map's Jacobian at one set x (1, N, D), autograd through odeint."""
    jac = torch.autograd.functional.jacobian(lambda y: flow_map(field, y, t1, zero_com), x)
    jac = jac.reshape(x.numel(), x.numel())
    if zero_com:
        # orthonormal basis of {sum_i z_i = 0}: the map's restriction is Q^T J Q
        n, d = x.shape[1:]
        centred = torch.eye(n, dtype=x.dtype) - 1.0 / n
        q = torch.linalg.svd(torch.kron(centred, torch.eye(d, dtype=x.dtype)))[0]
        q = q[:, : (n - 1) * d]
        jac = q.t() @ jac @ q
    return torch.linalg.slogdet(jac)[1]


# every test here runs with float64 as the default dtype (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("float64_default")


# ----------------------------------------------------------------------------- log-determinant


def test_exact_logabsdet_equals_logdet_of_solved_flow_map():
    field = MeanField()
    x = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(1))
    cnf = CNF(field, t1=1.3, **TIGHT)
    z, logabsdet = cnf(x)
    expected = true_logabsdet(field, x, t1=1.3)
    assert abs(logabsdet[0].item() - expected.item()) < 1e-7
    assert torch.allclose(z, flow_map(field, x, 1.3), atol=1e-8)


def test_zero_com_logabsdet_equals_logdet_on_the_subspace():
    field = MeanField(seed=3)
    x = subtract_mean(torch.randn(1, 4, 2, generator=torch.Generator().manual_seed(2)))
    cnf = CNF(field, zero_com=True, **TIGHT)
    z, logabsdet = cnf(x)
    assert abs(logabsdet[0].item() - true_logabsdet(field, x, zero_com=True).item()) < 1e-7
    # the flow keeps the state on the subspace
    assert z.sum(dim=1).abs().max() < 1e-12


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
@pytest.mark.parametrize("zero_com", [False, True])
def test_hutchinson_logabsdet_is_unbiased_within_4_standard_errors(probe, zero_com):
    field = MeanField(seed=4)
    x = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(5))
    if zero_com:
        x = subtract_mean(x)
    exact = CNF(field, zero_com=zero_com, **TIGHT)(x)[1][0]
    draws = 600
    cnf = CNF(
        field,
        divergence="hutchinson",
        probe=probe,
        generator=torch.Generator().manual_seed(6),
        zero_com=zero_com,
        atol=1e-8,
        rtol=1e-8,
    )
    estimates = cnf(x.expand(draws, -1, -1).contiguous())[1]
    stderr = estimates.std() / math.sqrt(draws)
    assert stderr > 1e-4  # the estimates really are random
    assert abs((estimates.mean() - exact).item()) < 4 * stderr.item()


def test_hutchinson_probe_is_fixed_for_the_whole_solve():
    # For a linear field the Jacobian is constant, so a probe held fixed over [0, T] gives
    # exactly T eps^T J eps; a probe redrawn at each evaluation would not.
    a = torch.tensor([[0.3, -1.0], [0.7, 0.2]])
    x = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(7))
    cnf = CNF(
        LinearField(a), t1=2.0, divergence="hutchinson",
        generator=torch.Generator().manual_seed(8), **TIGHT,
    )
    logabsdet = cnf(x)[1]
    eps = sample_probes(x.shape, "rademacher", generator=torch.Generator().manual_seed(8),
                        dtype=x.dtype)
    expected = 2.0 * ((eps @ a.t()) * eps).sum(dim=(1, 2))
    assert torch.allclose(logabsdet, expected, atol=1e-9)
    again = CNF(
        LinearField(a), t1=2.0, divergence="hutchinson",
        generator=torch.Generator().manual_seed(8), **TIGHT,
    )(x)[1]
    assert torch.equal(again, logabsdet)


def test_evaluation_probes_are_seeded_and_leave_the_global_rng_alone():
    # In evaluation mode every solve draws its probes from a fresh generator seeded with
    # eval_seed: the same inputs give the same score, whatever the global RNG did in between,
    # and the score is eps^T J eps T for the probes of that seed.
    a = torch.tensor([[0.3, -1.0], [0.7, 0.2]])
    x = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(7))
    cnf = CNF(LinearField(a), t1=2.0, divergence="hutchinson", eval_seed=11, **TIGHT).eval()
    state = torch.get_rng_state()
    first = cnf(x)[1]
    assert torch.equal(torch.get_rng_state(), state)
    torch.randn(100)  # the global RNG moves on; the score does not
    assert torch.equal(cnf(x)[1], first)
    eps = sample_probes(x.shape, "rademacher", generator=torch.Generator().manual_seed(11),
                        dtype=x.dtype)
    assert torch.allclose(first, 2.0 * ((eps @ a.t()) * eps).sum(dim=(1, 2)), atol=1e-9)
    # training mode, and eval_seed=None, keep drawing fresh probes
    for train, seed in ((True, 11), (False, None)):
        other = CNF(LinearField(a), t1=2.0, divergence="hutchinson", eval_seed=seed,
                    **TIGHT).train(train)
        assert not torch.equal(other(x)[1], other(x)[1])
    with pytest.raises(ValueError, match="eval_seed"):
        CNF(LinearField(a), eval_seed=1.5)


# ----------------------------------------------------------------------------- inverse


def test_round_trip_within_1e_minus_4_in_float32_at_default_tolerances():
    field = MeanField(seed=9).float()
    x = 2 * torch.randn(16, 5, 2, generator=torch.Generator().manual_seed(10)).float()
    with torch.no_grad():
        cnf = CNF(field)  # atol = rtol = 1e-5
        z, _ = cnf(x)
        x_back, _ = cnf.inverse(z)
        assert (x_back - x).abs().max() <= 1e-4
        assert (z - x).abs().max() > 1e-2  # the flow did move the points
        # the log-determinant state accumulates the divergence's error over the whole solve,
        # so its round trip needs tighter tolerances for the same 1e-4
        cnf = CNF(field, atol=1e-7, rtol=1e-7)
        z, logabsdet = cnf(x)
        x_back, inverse_logabsdet = cnf.inverse(z)
        assert (x_back - x).abs().max() <= 1e-4
        assert (logabsdet + inverse_logabsdet).abs().max() <= 1e-4


def test_sample_log_prob_equals_log_prob_of_the_samples():
    cnf = CNF(MeanField(seed=11), atol=1e-9, rtol=1e-9)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    x, log_prob = cnf.sample((2, 3, 2), mask=mask, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(cnf.log_prob(x, mask=mask), log_prob, atol=1e-7)
    assert torch.equal(x[1, 2], torch.zeros(2))


def test_nflows_flow_log_prob_equals_cnf_log_prob():
    cnf = CNF(MeanField(seed=12), atol=1e-9, rtol=1e-9)
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(13))
    flow = Flow(cnf, StandardNormal([3, 2]))
    assert torch.allclose(flow.log_prob(x), cnf.log_prob(x), atol=1e-10)


def test_vectors_of_shape_b_d_are_supported():
    field = MeanField(seed=14)
    wrapped = CountingField(field)

    class VectorField(nn.Module):
        def forward(self, t, z):
            return wrapped(t, z[:, None, :])[:, 0, :]

    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(15))
    z, logabsdet = CNF(VectorField(), **TIGHT)(x)
    z_sets, logabsdet_sets = CNF(field, **TIGHT)(x[:, None, :])
    assert torch.allclose(z, z_sets[:, 0], atol=1e-9)
    assert torch.allclose(logabsdet, logabsdet_sets, atol=1e-9)


# ----------------------------------------------------------------------------- masks


def test_padded_batch_equals_each_set_alone_and_padding_stays_fixed():
    field = MeanField(seed=16)
    g = torch.Generator().manual_seed(17)
    sizes = [2, 3, 5]
    sets = [torch.randn(1, n, 2, generator=g) for n in sizes]
    batch = 7 * torch.randn(3, 5, 2, generator=g)  # garbage in the padding
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, s in enumerate(sets):
        batch[i, : s.shape[1]] = s[0]
        mask[i, : s.shape[1]] = True
    for divergence in ("exact", "hutchinson"):
        gen = torch.Generator().manual_seed(3)
        cnf = CNF(field, divergence=divergence, generator=gen, **TIGHT)
        z, logabsdet = cnf(batch, mask=mask)
        assert torch.equal(z[~mask], batch[~mask])
        for i, s in enumerate(sets):
            alone = CNF(field, **TIGHT)(s)
            assert torch.allclose(z[i, : s.shape[1]], alone[0][0], atol=1e-8)
            if divergence == "exact":
                assert abs((logabsdet[i] - alone[1][0]).item()) < 1e-8


def test_mask_passed_as_context_through_composite_transform_equals_mask_keyword():
    field_a, field_b = MeanField(seed=18), MeanField(seed=19)
    x = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(20))
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    chain = CompositeTransform([CNF(field_a, **TIGHT), CNF(field_b, **TIGHT)])
    z, logabsdet = chain(x, context=mask)
    z1, l1 = CNF(field_a, **TIGHT)(x, mask=mask)
    z2, l2 = CNF(field_b, **TIGHT)(z1, mask=mask)
    assert torch.allclose(z, z2, atol=1e-12) and torch.allclose(logabsdet, l1 + l2, atol=1e-12)
    x_back, _ = chain.inverse(z, context=mask)
    assert torch.allclose(x_back, x, atol=1e-7)


def test_exchangeability_permuting_a_set_permutes_z_and_keeps_logabsdet():
    field = MeanField(seed=21)
    x = torch.randn(2, 5, 2, generator=torch.Generator().manual_seed(22))
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    perm = torch.tensor([3, 0, 4, 1, 2])
    cnf = CNF(field, **TIGHT)
    z, logabsdet = cnf(x, mask=mask)
    z_p, logabsdet_p = cnf(x[:, perm], mask=mask[:, perm])
    assert torch.allclose(z_p, z[:, perm], atol=1e-8)
    assert torch.allclose(logabsdet_p, logabsdet, atol=1e-8)


# ----------------------------------------------------------------------------- regularisers


def test_rnode_regularisers_of_a_linear_field_match_closed_forms():
    a = torch.tensor([[0.3, -1.0], [0.7, 0.2]])
    x = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(23))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    t1 = 1.5
    cnf = CNF(LinearField(a), t1=t1, regularise=True, **TIGHT)
    cnf(x, mask=mask)
    # int_0^T ||A z(t)||^2 dt with z(t) = exp(tA) x, by composite Simpson on a fine grid
    ts = torch.linspace(0, t1, 2001)
    expm = torch.linalg.matrix_exp(ts[:, None, None] * a)  # (T, 2, 2)
    present = x * mask[..., None]
    velocity = torch.einsum("ij,tjk,bnk->tbni", a, expm, present)
    speed = velocity.pow(2).sum(dim=(2, 3))
    weights = torch.ones(2001)
    weights[1:-1:2], weights[2:-1:2] = 4, 2
    kinetic = (weights[:, None] * speed).sum(0) * (t1 / 2000) / 3
    assert torch.allclose(cnf.kinetic_energy, kinetic, rtol=1e-8)
    # ||J||_F^2 = n ||A||_F^2 over the n present elements, for all t
    assert torch.allclose(cnf.jacobian_frobenius, t1 * mask.sum(1) * a.pow(2).sum(), rtol=1e-9)


def test_hutchinson_frobenius_regulariser_is_unbiased():
    a = torch.tensor([[0.3, -1.0], [0.7, 0.2]])
    draws = 2000
    x = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(24)).expand(draws, -1, -1)
    cnf = CNF(
        LinearField(a), divergence="hutchinson", probe="gaussian", regularise=True,
        generator=torch.Generator().manual_seed(25),
    )
    cnf(x.contiguous())
    estimates = cnf.jacobian_frobenius
    stderr = estimates.std() / math.sqrt(draws)
    assert abs(estimates.mean().item() - 3 * a.pow(2).sum().item()) < 4 * stderr.item()


def test_regularisers_do_not_change_the_solver_steps():
    field = MeanField(seed=26)
    x = 2 * torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(27))
    plain = CNF(field, atol=1e-6, rtol=1e-6)
    regularised = CNF(field, regularise=True, atol=1e-6, rtol=1e-6)
    z, logabsdet = plain(x)
    z_r, logabsdet_r = regularised(x)
    assert regularised.nfe_forward == plain.nfe_forward
    assert torch.equal(z, z_r) and torch.equal(logabsdet, logabsdet_r)
    assert (regularised.kinetic_energy > 0).all() and (regularised.jacobian_frobenius > 0).all()


# ----------------------------------------------------------------------------- adjoint, counters


@pytest.mark.parametrize("divergence", ["exact", "hutchinson"])
def test_adjoint_gradients_equal_direct_gradients(divergence):
    x = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(28))
    mask = torch.tensor([[True] * 4, [True, True, True, False], [True, False, True, True]])
    grads = {}
    for adjoint in (False, True):
        field = MeanField(seed=29)
        # the same seed gives both the same probe; the adjoint must reuse it backwards
        cnf = CNF(
            field, adjoint=adjoint, regularise=True, divergence=divergence,
            generator=torch.Generator().manual_seed(1), **TIGHT,
        )
        z, logabsdet = cnf(x, mask=mask)
        loss = (z.pow(2).sum() - logabsdet.sum() + cnf.kinetic_energy.sum()
                + 0.1 * cnf.jacobian_frobenius.sum())
        loss.backward()
        grads[adjoint] = torch.cat([p.grad.flatten() for p in field.parameters()])
    assert torch.allclose(grads[True], grads[False], rtol=1e-6, atol=1e-8)


def test_counters_count_forward_and_backward_field_evaluations():
    counting = CountingField(MeanField(seed=30))
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(31))
    cnf = CNF(counting, adjoint=True, seminorm=False)
    z, logabsdet = cnf(x)
    assert cnf.nfe_forward == counting.calls > 0
    assert cnf.nfe_backward == 0
    (z.pow(2).sum() - logabsdet.sum()).backward()
    assert cnf.nfe_backward == counting.calls - cnf.nfe_forward > 0
    backward_without_seminorm = cnf.nfe_backward

    seminorm = CNF(CountingField(MeanField(seed=30)), adjoint=True, seminorm=True)
    z, logabsdet = seminorm(x)
    (z.pow(2).sum() - logabsdet.sum()).backward()
    assert 0 < seminorm.nfe_backward <= backward_without_seminorm

    direct = CNF(CountingField(MeanField(seed=30)))
    z, logabsdet = direct(x)
    (z.pow(2).sum() - logabsdet.sum()).backward()
    # every accepted evaluation is backpropagated once; the probe evaluation of the initial
    # step-size selection is not
    assert 0 < direct.nfe_backward < direct.nfe_forward


# ----------------------------------------------------------------------------- errors


class Blowup(nn.Module):
    """dz/dt = z^2: from z(0) = 1 the solution 1 / (1 - t) leaves every bound at t = 1."""

    def forward(self, t, z, mask=None):
        return z.pow(2)


class NaNAfterHalf(nn.Module):
    def forward(self, t, z, mask=None):
        return z * (float("nan") if t > 0.5 else 1.0)


class HugeConstant(nn.Module):
    def forward(self, t, z, mask=None):
        return torch.full_like(z, 1.5e308)


@pytest.mark.parametrize("adjoint", [False, True])
def test_step_size_underflow_is_reported_with_its_cause(adjoint):
    with pytest.raises(ODESolverError, match="step size underflow") as info:
        CNF(Blowup(), t1=2.0, adjoint=adjoint)(torch.ones(1, 1, 1))
    assert info.value.cause == "step size underflow"


class PoisonedAfterForward(nn.Module):
    """A linear field whose evaluations turn bad once ``poison`` is set (for the adjoint)."""

    def __init__(self, mode: str):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))
        self.mode, self.poison = mode, False

    def forward(self, t, z, mask=None):
        if not self.poison:
            return self.w * z
        if self.mode == "nan":
            return z * float("nan")
        return -10 * self.w * z.pow(2)  # blows up when integrated backwards from z(1) > 0


@pytest.mark.parametrize("mode, cause", [("nan", "non-finite vector field"),
                                         ("blowup", "step size underflow")])
def test_adjoint_backward_solve_failures_are_reported_with_their_cause(mode, cause):
    field = PoisonedAfterForward(mode)
    cnf = CNF(field, adjoint=True)
    z, logabsdet = cnf(torch.ones(1, 2, 1))
    field.poison = True
    with pytest.raises(ODESolverError, match=cause) as info:
        (z.sum() + logabsdet.sum()).backward()
    assert info.value.cause == cause


def test_non_finite_vector_field_is_reported_with_its_cause_and_time():
    with pytest.raises(ODESolverError, match=r"non-finite vector field .* at t=0\.5") as info:
        CNF(NaNAfterHalf())(torch.ones(1, 1, 1))
    assert info.value.cause == "non-finite vector field"


def test_non_finite_state_is_reported_with_its_cause():
    cnf = CNF(HugeConstant(), t1=4.0, solver="euler", solver_options={"step_size": 1.0})
    with pytest.raises(ODESolverError, match="non-finite state") as info:
        cnf(torch.zeros(1, 1, 1))
    assert info.value.cause == "non-finite state"


def test_too_many_steps_is_reported_with_its_cause():
    with pytest.raises(ODESolverError, match="too many steps") as info:
        CNF(MeanField(), max_steps=2, **TIGHT)(torch.randn(2, 3, 2))
    assert info.value.cause == "too many steps"


@pytest.mark.parametrize(
    "inputs, kwargs, message",
    [
        (torch.tensor([[[float("nan"), 0.0]]]), {}, "non-finite"),
        (torch.tensor([[[float("inf"), 0.0]]]), {}, "non-finite"),
        ([[0.0, 1.0]], {}, "must be a torch.Tensor"),
        (torch.zeros(2), {}, r"shape \(B, N, D\) or \(B, D\)"),
        (torch.zeros(2, 3, 5), {}, "width D=5"),
        (torch.zeros(2, 3, 2, dtype=torch.long), {}, "floating point"),
        (torch.zeros(2, 3, 2), {"mask": torch.ones(2, 4, dtype=torch.bool)}, "mask must have"),
        (torch.zeros(2, 3, 2), {"mask": torch.ones(2, 3)}, "torch.bool"),
        (torch.zeros(2, 3, 2), {"mask": torch.zeros(2, 3, dtype=torch.bool)}, "empty"),
        (torch.zeros(2, 3, 2), {"context": torch.ones(2, 7)}, "no conditioning context"),
        (torch.zeros(2, 2), {"mask": torch.ones(2, 2, dtype=torch.bool)}, "needs \\(B, N, D\\)"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_problem(inputs, kwargs, message):
    cnf = CNF(MeanField())
    with pytest.raises(ValueError, match=message):
        cnf(inputs, **kwargs)
    with pytest.raises(ValueError, match=message):
        cnf.inverse(inputs, **kwargs)


def test_zero_com_rejects_uncentred_inputs():
    cnf = CNF(MeanField(), zero_com=True)
    with pytest.raises(ValueError, match="centred"):
        cnf(torch.randn(2, 3, 2) + 1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"t1": 0.0}, "t1"),
        ({"t1": float("nan")}, "t1"),
        ({"solver": "rk45"}, "unknown solver"),
        ({"solver": "rk4"}, "step_size"),
        ({"atol": -1.0}, "atol"),
        ({"divergence": "approx"}, "divergence"),
        ({"probe": "uniform"}, "probe"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CNF(MeanField(), **kwargs)


def test_fixed_grid_solver_runs_and_counts_its_evaluations():
    cnf = CNF(MeanField(), solver="rk4", solver_options={"step_size": 0.25})
    z, logabsdet = cnf(torch.randn(2, 3, 2))
    assert cnf.nfe_forward == 16  # 4 steps x 4 stages
    assert torch.isfinite(z).all() and torch.isfinite(logabsdet).all()


def test_log_prob_uses_the_zero_com_base_density():
    field = MeanField(seed=32)
    x = subtract_mean(torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(33)))
    cnf = CNF(field, zero_com=True, **TIGHT)
    z, logabsdet = cnf(x)
    expected = standard_normal_log_prob(z, zero_com=True) + logabsdet
    assert torch.allclose(cnf.log_prob(x), expected, atol=1e-12)


def test_a_cnf_refuses_another_dtype_than_its_field_and_shapes_its_field_cannot_take():
    from flowattn.flows import AttentionField

    cnf = CNF(AttentionField(dim=2, heads=1, layers=1, hidden=8).float())
    x = torch.randn(3, 4, 2, dtype=torch.float32)
    for call in (cnf, cnf.inverse, cnf.matching_loss):
        with pytest.raises(InputError, match="dtype torch.float64, but the AttentionField's "
                                             "weights are torch.float32"):
            call(x.double())  # the field's own check is off inside the solve: refused here
        with pytest.raises(InputError, match=r"shape \(B, N, D\) for the field AttentionField"):
            call(torch.randn(3, 4, 2, 1))
    with pytest.raises(InputError, match=r"shape \(B, N, D\) for the field"):
        cnf(torch.randn(3, 2))  # a field of sets takes no (B, D) vectors
    with pytest.raises(InputError, match=r"shape \(B, N, D\) or \(B, D\) for the field"):
        CNF(MeanField())(torch.randn(3, 4, 2, 1, dtype=torch.float64))


@pytest.mark.parametrize("step", [0.0, -0.1, float("nan"), "0.1"])
def test_fixed_grid_solvers_need_a_finite_positive_step(step):
    with pytest.raises(InputError, match="step size of solver 'euler' must be a finite number"):
        CNF(MeanField(), solver="euler", solver_options={"step_size": step})
    with pytest.raises(InputError, match="max_steps must be an integer >= 1, got 2.5"):
        CNF(MeanField(), max_steps=2.5)
    with pytest.raises(InputError, match="max_steps bounds the steps of an adaptive solver"):
        CNF(MeanField(), solver="rk4", solver_options={"step_size": 0.1}, max_steps=10)
