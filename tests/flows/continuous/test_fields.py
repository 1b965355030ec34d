"""Tests of flowattn.flows.continuous.fields: certified bounds, masks, symmetry, causality."""

from __future__ import annotations

import pytest
import torch

from flowattn.flows.continuous.cnf import CNF
from flowattn.flows.continuous.fields import AttentionField, DotProductField
from flowattn.flows.geometry import subtract_mean
from flowattn.lipschitz import jacobian, jacobian_norm, lipschitz_lower_bound

TIGHT = dict(atol=1e-9, rtol=1e-9)


# every test here runs with float64 as the default dtype (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("float64_default")


def make_field(seed=0, **kwargs):
    torch.manual_seed(seed)
    options = dict(dim=2, heads=2, layers=2, hidden=8, time_hidden=8)
    options.update(kwargs)
    return AttentionField(**options)


def one_set(field, t, mask=None):
    """f(., t) as a map on one set (N, D) -> (N, D), as the Jacobian tools expect."""
    return lambda x: field(t, x[None], None if mask is None else mask[None])[0]


# ----------------------------------------------------------------------------- certified bound


@pytest.mark.parametrize("norm", ["inf", 2])
@pytest.mark.parametrize("zero_com", [False, True])
def test_certified_bound_exceeds_the_largest_jacobian_norm_found(norm, zero_com):
    field = make_field(seed=1, norm=norm, zero_com=zero_com)
    n, t = 4, torch.tensor(0.3)
    found, _ = lipschitz_lower_bound(
        one_set(field, t), (n, 2), p=norm, restarts=2, steps=15, lr=0.2,
        generator=torch.Generator().manual_seed(2),
    )
    assert found > 0
    with torch.no_grad():
        bound_at_t, bound = field.lipschitz_bound(n, t=t), field.lipschitz_bound(n)
    assert bound_at_t.item() >= found
    assert bound.item() >= bound_at_t.item()


@pytest.mark.parametrize("norm, n", [("inf", 8), (2, 2)])
def test_certified_bound_is_nearly_attained_by_one_narrow_layer(norm, n):
    """One attention layer of width 1 between unit lift and projection: the field's product
    bound is the attention's own certificate times the gain, within 1.6x of the largest
    Jacobian norm an optimiser finds (1.28 and 1.48 here), so a bound half as large fails."""
    field = make_field(seed=2, dim=1, heads=1, layers=1, hidden=1, time_hidden=4, norm=norm)
    with torch.no_grad():
        field.lift.weight.fill_(1.0)
        field.project.weight.fill_(1.0)
    t = torch.tensor(0.3)
    found, _ = lipschitz_lower_bound(
        one_set(field, t), (n, 1), p=norm, restarts=4, steps=100, lr=0.1,
        generator=torch.Generator().manual_seed(2),
    )
    with torch.no_grad():
        bound = field.lipschitz_bound(n, t=t).item()
    assert found <= bound <= 1.6 * found


@pytest.mark.parametrize("norm", ["inf", 2])
def test_zero_com_multiplies_the_bound_by_the_norm_of_the_centring(norm):
    """Removing the centre of mass is the map I - 11^T/n, of inf-norm 2(n-1)/n and 2-norm 1;
    the centred field's bound is the plain one times exactly that norm."""
    centred, plain = make_field(seed=8, norm=norm, zero_com=True), make_field(seed=8, norm=norm)
    for n in (2, 5, 13):
        centring = torch.eye(n) - torch.full((n, n), 1.0 / n)
        p = float("inf") if norm == "inf" else 2
        factor = torch.linalg.matrix_norm(centring, ord=p)
        assert factor == pytest.approx(2 * (n - 1) / n if norm == "inf" else 1.0, rel=1e-12)
        with torch.no_grad():
            ratio = centred.lipschitz_bound(n) / plain.lipschitz_bound(n)
        assert ratio.item() == pytest.approx(factor.item(), rel=1e-12)


def test_certified_bound_holds_for_padded_and_causal_sets():
    x = 3 * torch.randn(5, 2, generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([True, False, True, True, False])
    for causal in (False, True):
        field = make_field(seed=4, causal=causal)
        measured = jacobian_norm(one_set(field, 0.7, mask), x, "inf")
        assert 0 < measured <= field.lipschitz_bound(int(mask.sum()))


def test_bound_accepts_a_tensor_of_set_sizes_and_grows_with_n():
    field = make_field(seed=5)
    bounds = field.lipschitz_bound(torch.tensor([1, 2, 4, 8]))
    assert bounds.shape == (4,)
    assert (bounds[1:] > bounds[:-1]).all()
    assert torch.allclose(bounds[2], field.lipschitz_bound(4))
    with pytest.raises(ValueError, match="n must be >= 1"):
        field.lipschitz_bound(0)


def test_a_full_field_takes_the_full_calls_bound_and_a_causal_one_the_other():
    # in the 2-norm, attention that sees the whole set may use the crowded block columns and
    # the kernel constant (the smaller from 44 elements on); a causal field must not
    full, causal = make_field(seed=5, norm=2), make_field(seed=5, norm=2, causal=True)
    causal.load_state_dict(full.state_dict())
    assert full.lipschitz_bound(2).item() == causal.lipschitz_bound(2).item()  # nothing to crowd
    for n in (8, 64):
        assert full.lipschitz_bound(n).item() < causal.lipschitz_bound(n).item()


def test_max_lipschitz_caps_the_certified_and_the_measured_constant():
    field = make_field(seed=6, max_lipschitz=0.5)
    raw = field.raw_lipschitz_bound(4).item()
    assert raw > 0.5  # the cap is active
    assert torch.allclose(field.lipschitz_bound(4), torch.tensor(0.5))
    capped_t = field.lipschitz_bound(4, t=0.2).item()
    assert capped_t == pytest.approx(field.raw_lipschitz_bound(4, t=0.2).item() * 0.5 / raw)
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(7))
    uncapped = make_field(seed=6)
    scale = 0.5 / raw
    assert torch.allclose(field(0.2, x[None]), scale * uncapped(0.2, x[None]), atol=1e-12)
    assert jacobian_norm(one_set(field, 0.2), x, "inf") <= 0.5


def test_flow_map_of_a_capped_field_is_e_to_the_lt_bi_lipschitz():
    # Gronwall: ||phi(x) - phi(y)|| <= e^{L T} ||x - y|| for the flow map phi of an L-Lipschitz
    # field, and the same for its inverse; checked in the field's own norm (inf).
    cap, t1 = 0.05, 2.0
    field = make_field(seed=8, max_lipschitz=cap)
    g = torch.Generator().manual_seed(9)
    x = 3 * torch.randn(16, 4, 2, generator=g)
    y = x + 0.1 * torch.randn(16, 4, 2, generator=g)
    with torch.no_grad():
        cnf = CNF(field, t1=t1, **TIGHT)
        phi_x, phi_y = cnf(x)[0], cnf(y)[0]
    distance = (x - y).flatten(1).abs().amax(1)
    image = (phi_x - phi_y).flatten(1).abs().amax(1)
    growth = torch.exp(torch.tensor(cap * t1))
    assert (image <= growth * distance).all() and (distance <= growth * image).all()


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("kind", [AttentionField, DotProductField])
def test_field_is_permutation_equivariant_with_masks(kind):
    torch.manual_seed(10)
    field = kind(dim=2, heads=2, layers=2, hidden=8)
    x = torch.randn(2, 5, 2, generator=torch.Generator().manual_seed(11))
    mask = torch.tensor([[True] * 5, [True, False, True, True, False]])
    perm = torch.tensor([4, 2, 0, 3, 1])
    out = field(0.4, x, mask)
    assert torch.allclose(field(0.4, x[:, perm], mask[:, perm]), out[:, perm], atol=1e-12)


@pytest.mark.parametrize("kind", [AttentionField, DotProductField])
def test_padded_elements_get_zero_velocity_and_do_not_influence_others(kind):
    torch.manual_seed(12)
    field = kind(dim=2, heads=2, layers=2, hidden=8)
    x = torch.randn(1, 5, 2, generator=torch.Generator().manual_seed(13))
    mask = torch.tensor([[True, True, False, True, False]])
    out = field(0.1, x, mask)
    assert torch.equal(out[~mask], torch.zeros(2, 2))
    alone = field(0.1, x[:, mask[0]])
    assert torch.allclose(out[mask], alone[0], atol=1e-12)
    garbage = x.clone()
    garbage[~mask] = 100.0
    assert torch.allclose(field(0.1, garbage, mask), out, atol=1e-12)


def test_causal_field_jacobian_is_block_lower_triangular():
    field = make_field(seed=14, causal=True)
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(15))
    jac = jacobian(one_set(field, 0.5), x).reshape(4, 2, 4, 2)
    for i in range(4):
        for j in range(4):
            block = jac[i, :, j, :].abs().max()
            assert (block == 0) if j > i else (block > 1e-4)


def test_zero_com_field_output_has_zero_mean_over_present_elements():
    field = make_field(seed=16, zero_com=True)
    x = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(17))
    mask = torch.tensor([[True] * 4, [True, True, False, True]])
    out = field(0.3, x, mask)
    assert out.sum(dim=1).abs().max() < 1e-12
    assert out.abs().max() > 1e-3
    assert torch.equal(out[1, 2], torch.zeros(2))


def test_time_changes_the_dependence_on_z_not_only_an_offset():
    field = make_field(seed=18)
    with torch.no_grad():
        for p in field.time_net.parameters():
            p.normal_(generator=torch.Generator().manual_seed(19))
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(20))
    j0 = jacobian(one_set(field, 0.0), x)
    j1 = jacobian(one_set(field, 1.0), x)
    assert (j0 - j1).abs().max() > 1e-3


def test_dot_product_field_has_the_same_structure_and_no_certificate():
    torch.manual_seed(21)
    dp = DotProductField(dim=3, heads=2, layers=3, hidden=8)
    l2 = AttentionField(dim=3, heads=2, layers=3, hidden=8)
    assert len(dp.attention) == len(l2.attention) == 3
    assert dp.lift.weight.shape == l2.lift.weight.shape
    assert dp(0.0, torch.randn(2, 4, 3)).shape == (2, 4, 3)
    assert not hasattr(dp, "lipschitz_bound")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden": 9, "heads": 2}, "must divide"),
        ({"layers": 0}, "layers"),
        ({"norm": 1}, "norm"),
        ({"max_lipschitz": 0.0}, "max_lipschitz"),
    ],
)
def test_bad_field_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_field(**kwargs)


def test_field_rejects_bad_inputs():
    field = make_field()
    with pytest.raises(ValueError, match="width D=3"):
        field(0.0, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="non-finite"):
        field(0.0, torch.full((1, 2, 2), float("nan")))


# ----------------------------------------------------------------------------- in a CNF


def test_cnf_with_attention_field_logabsdet_equals_logdet_of_flow_map():
    field = make_field(seed=22)
    x = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(23))
    cnf = CNF(field, **TIGHT)
    z, logabsdet = cnf(x)
    jac = torch.autograd.functional.jacobian(lambda y: cnf(y)[0], x).reshape(6, 6)
    # the flow map's Jacobian by autograd through the solver at the same tight tolerance
    assert abs(logabsdet.item() - torch.linalg.slogdet(jac)[1].item()) < 1e-6


def test_cnf_with_zero_com_attention_field_stays_centred_and_round_trips():
    field = make_field(seed=24, zero_com=True, norm=2)
    x = subtract_mean(torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(25)))
    mask = torch.tensor([[True] * 4, [True, True, True, False], [True, False, True, True]])
    x = subtract_mean(x, mask)
    with torch.no_grad():
        cnf = CNF(field, **TIGHT)
        assert cnf.zero_com
        z, logabsdet = cnf(x, mask=mask)
        x_back, inverse_logabsdet = cnf.inverse(z, mask=mask)
    assert (z * mask[..., None]).sum(dim=1).abs().max() < 1e-10
    assert (x_back - x).abs().max() < 1e-6
    assert (logabsdet + inverse_logabsdet).abs().max() < 1e-6


def test_cnf_with_attention_field_padded_batch_equals_each_set_alone():
    field = make_field(seed=26)
    g = torch.Generator().manual_seed(27)
    a, b = torch.randn(1, 2, 2, generator=g), torch.randn(1, 4, 2, generator=g)
    batch = torch.zeros(2, 4, 2)
    batch[0, :2], batch[1] = a[0], b[0]
    mask = torch.tensor([[True, True, False, False], [True] * 4])
    with torch.no_grad():
        cnf = CNF(field, **TIGHT)
        z, logabsdet = cnf(batch, mask=mask)
        za, la = cnf(a)
        zb, lb = cnf(b)
    assert torch.allclose(z[0, :2], za[0], atol=1e-7) and torch.allclose(z[1], zb[0], atol=1e-7)
    assert torch.allclose(logabsdet, torch.cat([la, lb]), atol=1e-7)


def test_causal_cnf_flow_map_is_autoregressive():
    # z_i depends on x_j only for j <= i, and the log-determinant is that of the diagonal blocks
    field = make_field(seed=28, causal=True)
    x = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(29))
    cnf = CNF(field, **TIGHT)
    logabsdet = cnf(x)[1]
    jac = torch.autograd.functional.jacobian(lambda y: cnf(y)[0], x).reshape(3, 2, 3, 2)
    blocks = [torch.linalg.slogdet(jac[i, :, i, :])[1] for i in range(3)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert jac[i, :, j, :].abs().max() < 1e-9
    assert abs(logabsdet.item() - sum(blocks).item()) < 1e-6


@pytest.mark.parametrize("kind", [AttentionField, DotProductField])
def test_cnf_training_step_backpropagates_through_the_divergence(kind):
    # the divergence is differentiated once more: attention must have a double backward
    torch.manual_seed(30)
    field = kind(dim=2, heads=2, layers=2, hidden=8)
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(31))
    for divergence in ("exact", "hutchinson"):
        field.zero_grad()
        cnf = CNF(field, divergence=divergence, regularise=True, atol=1e-5, rtol=1e-5)
        loss = -cnf.log_prob(x).mean() + 0.01 * cnf.kinetic_energy.mean()
        loss.backward()
        grads = [p.grad for p in field.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert sum(g.abs().sum() for g in grads) > 0
        assert 0 < cnf.nfe_backward < cnf.nfe_forward
