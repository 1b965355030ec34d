"""Tests for ActNorm and the set / sequence flow builders: masks, exchangeability, zero COM."""

import contextlib
import math

import pytest
import torch

from flowattn.flows import (
    CNF,
    ActNorm,
    AttentionField,
    EGNNField,
    InverseOptions,
    LogDetOptions,
    SetFlow,
    SetLocation,
    sequence_flow,
    set_flow,
)
from flowattn.flows.geometry import subtract_mean

DT = torch.float64
EXACT = LogDetOptions("exact")


def _jacobian(fn, x):
    m = x.numel()
    return torch.autograd.functional.jacobian(fn, x).reshape(m, m)


def test_actnorm_initialises_from_present_elements_only():
    torch.manual_seed(0)
    x = 3 * torch.randn(4, 6, 2, dtype=DT) + 5
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    x[~mask] = 1e3  # padded values must not enter the statistics
    act = ActNorm(2).double()
    y, _ = act(x, context=mask)
    present = y[mask]
    assert present.mean(0).abs().max() < 1e-10
    assert (present.var(0, unbiased=False) - 1).abs().max() < 1e-5
    assert torch.equal(y[~mask], x[~mask])
    assert bool(act.initialized)


def test_actnorm_logdet_matches_brute_force_and_inverse_round_trips():
    torch.manual_seed(1)
    act = ActNorm(3).double()
    act(torch.randn(8, 5, 3, dtype=DT) * 2 + 1)  # initialise
    act.eval()
    x = torch.randn(1, 5, 3, dtype=DT)
    _, logdet = act(x)
    ref = torch.linalg.slogdet(_jacobian(lambda z: act(z)[0], x))[1]
    assert abs(logdet.item() - ref.item()) < 1e-10
    x_back, inv_logdet = act.inverse(act(x)[0])
    assert (x_back - x).abs().max() < 1e-12 and torch.allclose(inv_logdet, -logdet)


def test_actnorm_zero_com_keeps_centre_and_uses_subspace_dimension():
    torch.manual_seed(2)
    act = ActNorm(2, zero_com=True).double()
    x = subtract_mean(torch.randn(3, 4, 2, dtype=DT) * 3)
    y, logdet = act(x)
    assert y.sum(dim=1).abs().max() < 1e-12
    assert torch.allclose(logdet, torch.full((3,), 3 * act.log_scale.sum().item(), dtype=DT))


def _brute_flow_log_prob(flow, x, zero_com=False):
    """log N(f(x)) + log|det J_f| by a dense Jacobian (restricted to the zero-COM subspace)."""
    n, d = x.shape[-2:]
    xs = x.unsqueeze(0)
    z = flow.transform_to_noise(xs)
    jac = _jacobian(lambda v: flow.transform(v.unsqueeze(0))[0].squeeze(0), x)
    dims = n * d
    if zero_com:
        centre = torch.kron(torch.eye(n, dtype=DT) - 1.0 / n, torch.eye(d, dtype=DT))
        vals, vecs = torch.linalg.eigh(centre)
        basis = vecs[:, vals > 0.5]
        jac = basis.T @ jac @ basis
        dims = (n - 1) * d
    logdet = torch.linalg.slogdet(jac)[1]
    return -0.5 * (z**2).sum() - 0.5 * dims * math.log(2 * math.pi) + logdet


def _trained_actnorm(flow, x, mask=None):
    flow.train()
    with torch.no_grad():
        flow.log_prob(x, mask)
    return flow.eval()


@pytest.mark.parametrize("options", [{}, {"location": True}, {"interaction": "radial"},
                                     {"activation": "clipswish"},
                                     {"activation": "clipswish", "interaction": "linear"}])
def test_set_flow_log_prob_matches_brute_force_jacobian(options):
    torch.manual_seed(3)
    flow = set_flow(dim=2, blocks=2, heads=1, logdet=EXACT, **options).double()
    x = torch.randn(3, 5, 2, dtype=DT)
    _trained_actnorm(flow, 2 * x + 1)
    log_prob = flow.log_prob(x)
    ref = torch.stack([_brute_flow_log_prob(flow, x[b]) for b in range(3)])
    assert (log_prob - ref).abs().max() < 1e-8


@pytest.mark.parametrize("options", [{}, {"location": True}, {"interaction": "radial"}])
def test_set_flow_log_prob_is_exchangeable(options):
    torch.manual_seed(4)
    flow = set_flow(dim=2, blocks=2, heads=1, logdet=EXACT, **options).double().eval()
    x = torch.randn(4, 6, 2, dtype=DT)
    perm = torch.randperm(6)
    assert (flow.log_prob(x[:, perm]) - flow.log_prob(x)).abs().max() < 1e-10


@pytest.mark.parametrize("options", [{}, {"location": True}, {"interaction": "radial"}])
def test_padded_batch_log_prob_equals_each_set_alone(options):
    torch.manual_seed(5)
    flow = set_flow(dim=2, blocks=2, heads=1, logdet=EXACT, **options).double()
    data = torch.randn(8, 6, 2, dtype=DT)
    _trained_actnorm(flow, data)
    sizes = [6, 3, 1]
    x = torch.randn(3, 6, 2, dtype=DT)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    x_pad = torch.where(mask.unsqueeze(-1), x, torch.full_like(x, 9.0))
    batched = flow.log_prob(x_pad, mask)
    alone = torch.cat([flow.log_prob(x[b : b + 1, :s]) for b, s in enumerate(sizes)])
    assert (batched - alone).abs().max() < 1e-10


@pytest.mark.parametrize("interaction", ["attention", "radial"])
def test_zero_com_flow_keeps_centre_and_matches_subspace_brute_force(interaction):
    torch.manual_seed(6)
    flow = set_flow(dim=2, blocks=2, heads=1, logdet=EXACT, zero_com=True,
                    inverse=InverseOptions(tol=1e-12), interaction=interaction).double()
    x = subtract_mean(torch.randn(3, 4, 2, dtype=DT))
    _trained_actnorm(flow, 1.5 * x)
    z = flow.transform_to_noise(x)
    assert z.sum(dim=1).abs().max() < 1e-12
    log_prob = flow.log_prob(x)
    ref = torch.stack([_brute_flow_log_prob(flow, x[b], zero_com=True) for b in range(3)])
    assert (log_prob - ref).abs().max() < 1e-8
    # translation does not change the density (inputs are projected onto the subspace)
    assert (flow.log_prob(x + 3.0) - log_prob).abs().max() < 1e-10
    with torch.no_grad():
        samples, sample_lp = flow.sample_and_log_prob(5, set_size=4)
    assert samples.sum(dim=1).abs().max() < 1e-10
    assert (flow.log_prob(samples) - sample_lp).abs().max() < 1e-8


def _spline_flow(interaction="attention", seed=0, blocks=2):
    """A set flow with splines whose parameters are random (a fresh coupling is the identity,
    which would hide a missing log-det term)."""
    from flowattn.flows.coupling import SetCoupling

    torch.manual_seed(seed)
    flow = set_flow(dim=2, blocks=blocks, heads=1, hidden=16, logdet=EXACT,
                    interaction=interaction, splines=True,
                    inverse=InverseOptions(tol=1e-12, max_iter=5000)).double()
    with torch.no_grad():
        for module in flow.modules():
            if isinstance(module, SetCoupling):
                for p in module.parameters():
                    p.normal_(0.0, 0.5)
    return flow


def test_set_flow_activation_reaches_every_mlp_branch_and_is_checked():
    from flowattn.branches.mlp import CLipSwish, LipSwish

    for interaction in ("attention", "linear"):
        flow = set_flow(dim=2, blocks=2, heads=1, interaction=interaction,
                        activation="clipswish")
        kinds = {type(m) for m in flow.modules() if isinstance(m, (LipSwish, CLipSwish))}
        assert kinds == {CLipSwish}
    with pytest.raises(ValueError, match="activation must be one of"):
        set_flow(dim=2, blocks=1, heads=1, activation="tanh")


def test_set_flow_splines_sit_after_each_equivariant_map_and_alternate_halves():
    from flowattn.flows import EquivariantLinear
    from flowattn.flows.coupling import SetCoupling

    layers = list(set_flow(dim=2, blocks=3, heads=1, splines=True).transform._transforms)
    couplings = [(i, layer) for i, layer in enumerate(layers) if isinstance(layer, SetCoupling)]
    assert len(couplings) == 3
    assert all(isinstance(layers[i - 1], EquivariantLinear) for i, _ in couplings)
    assert [layer.moved.tolist() for _, layer in couplings] == [[0], [1], [0]]
    none = list(set_flow(dim=2, blocks=2, heads=1, splines=True, interaction="none")
                .transform._transforms)
    assert sum(isinstance(layer, SetCoupling) for layer in none) == 2
    assert not any(isinstance(layer, EquivariantLinear) for layer in none)


@pytest.mark.parametrize("interaction", ["attention", "none"])
def test_set_flow_with_splines_log_prob_matches_brute_force_and_inverts(interaction):
    flow = _spline_flow(interaction, seed=3)
    x = torch.randn(3, 5, 2, dtype=DT)
    _trained_actnorm(flow, 2 * x + 1)
    log_prob = flow.log_prob(x)
    ref = torch.stack([_brute_flow_log_prob(flow, x[b]) for b in range(3)])
    assert (log_prob - ref).abs().max() < 1e-8
    # the random splines bend their inputs, so their log-dets are far from zero
    from flowattn.flows.coupling import SetCoupling

    spline_logdets = [layer(x)[1] for layer in flow.transform._transforms
                      if isinstance(layer, SetCoupling)]
    assert min(ld.abs().max().item() for ld in spline_logdets) > 0.1
    with torch.no_grad():
        z = flow.transform_to_noise(x)
        back, _ = flow._inverse(z, None)
    assert (back - x).abs().max() < 1e-5


def test_set_flow_with_splines_is_exchangeable_and_masks_padding():
    flow = _spline_flow(seed=4)
    data = torch.randn(8, 6, 2, dtype=DT)
    _trained_actnorm(flow, data)
    x = torch.randn(3, 6, 2, dtype=DT)
    perm = torch.randperm(6)
    assert (flow.log_prob(x[:, perm]) - flow.log_prob(x)).abs().max() < 1e-10
    sizes = [6, 3, 1]
    mask = torch.arange(6).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)
    x_pad = torch.where(mask.unsqueeze(-1), x, torch.full_like(x, 9.0))
    alone = torch.cat([flow.log_prob(x[b : b + 1, :s]) for b, s in enumerate(sizes)])
    assert (flow.log_prob(x_pad, mask) - alone).abs().max() < 1e-10


def test_set_flow_splines_refuse_one_dimensional_elements_and_zero_com():
    with pytest.raises(ValueError, match="D >= 2"):
        set_flow(dim=1, blocks=1, heads=1, splines=True)
    with pytest.raises(ValueError, match="zero_com"):
        set_flow(dim=2, blocks=1, heads=1, splines=True, zero_com=True, norm="2")


def test_sequence_flow_causal_log_prob_matches_brute_force_and_is_causal():
    torch.manual_seed(7)
    flow = sequence_flow(dim=2, blocks=2, heads=1, causal=True).double().eval()
    x = torch.randn(2, 6, 2, dtype=DT)
    log_prob = flow.log_prob(x)
    ref = torch.stack([_brute_flow_log_prob(flow, x[b]) for b in range(2)])
    assert (log_prob - ref).abs().max() < 1e-8
    # causality: changing the last element leaves the noise of the earlier ones unchanged
    x2 = x.clone()
    x2[:, -1] += 1.0
    z1, z2 = flow.transform_to_noise(x), flow.transform_to_noise(x2)
    assert (z1[:, :-1] - z2[:, :-1]).abs().max() < 1e-12
    assert (z1[:, -1] - z2[:, -1]).abs().max() > 1e-3


def test_sample_inverts_transform_to_noise_and_state_dict_reloads():
    torch.manual_seed(8)
    flow = set_flow(dim=2, blocks=2, heads=1).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        samples = flow.sample(4, set_size=5, generator=gen)
        z = flow.transform_to_noise(samples)
    base = torch.randn(4, 5, 2, generator=torch.Generator().manual_seed(0))
    assert (z - base).abs().max() < 1e-5
    clone = set_flow(dim=2, blocks=2, heads=1).eval()
    clone.load_state_dict(flow.state_dict())
    x = torch.randn(3, 5, 2)
    with torch.no_grad():
        assert torch.allclose(clone.log_prob(x), flow.log_prob(x))
    assert isinstance(flow.to("cpu"), SetFlow)


def test_sampling_solves_for_the_points_without_their_log_dets(monkeypatch):
    # the inverse's log-det (a series of up to a hundred Jacobian products per block, each
    # holding N x N attention weights) made 5 samples of 1000 elements take minutes and 100,000
    # elements exhaust the memory; sample_and_log_prob still computes them
    from flowattn.flows import logdet, residual

    torch.manual_seed(8)
    flow = set_flow(dim=2, blocks=2, heads=1).eval()
    with torch.no_grad():
        x, log_prob = flow.sample_and_log_prob(3, set_size=4,
                                               generator=torch.Generator().manual_seed(0))
    assert torch.allclose(log_prob, flow.log_prob(x), atol=1e-4)

    def refuse(*args, **kwargs):
        raise AssertionError("a log-det was computed")

    for module in (residual, logdet):
        for name in ("precise_series_logdet", "exact_logdet", "series_logdet",
                     "jacobian_logdet", "roulette_logdet", "memory_efficient_logdet"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    with torch.no_grad():
        again = flow.sample(3, set_size=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, x)
    assert not residual._POINTS_ONLY.on  # the context has ended


def test_masked_sampling_leaves_padding_at_zero():
    flow = set_flow(dim=2, blocks=1, heads=1).eval()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        x = flow.sample(2, mask=mask, generator=torch.Generator().manual_seed(1))
    assert (x[~mask] == 0).all() and (x[mask].abs() > 0).all()


def test_flows_reject_bad_inputs():
    flow = set_flow(dim=2, blocks=1, heads=1)
    with pytest.raises(ValueError, match="non-finite"):
        flow.log_prob(torch.tensor([[[float("inf"), 0.0]]]))
    with pytest.raises(ValueError, match="width"):
        flow.log_prob(torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match="empty"):
        flow.log_prob(torch.randn(2, 3, 2), torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match="set_size"):
        flow.sample(2)
    with pytest.raises(ValueError, match="blocks"):
        set_flow(dim=2, blocks=0, heads=1)


def test_default_set_flow_trains_in_float32_with_the_roulette_estimator():
    torch.manual_seed(9)
    flow = set_flow(dim=4, blocks=1, heads=2, logdet=LogDetOptions(n_exact_terms=1)).train()
    x = torch.randn(3, 20, 4)  # N D = 80 > exact_max_dim: "auto" uses roulette + Neumann
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, 15:] = False
    loss = -flow.log_prob(x, mask).mean()
    loss.backward()
    grads = [p.grad for p in flow.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# ----------------------------------------------------------------------------- checkpoints

ACTNORM = ["initialized", "log_scale", "shift"]
LU = ["log_diag", "lower", "upper"]
MLP = ["activations.0.rho"] + [f"layers.{i}.{p}" for i in (0, 1) for p in ("bias", "u", "v",
                                                                            "weight")]
L2 = ["attention.w_o", "attention.w_q", "attention.w_v"]
RADIAL = ["centres", "weight"]
MANYBODY = ["centres", "in_bias", "in_weight", "linear", "out_weight"]


def _keys(prefix, names):
    return [f"{prefix}.{name}" for name in names]


def _layer(i, names):
    return _keys(f"transform._transforms.{i}", names)


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            lambda: set_flow(dim=2, blocks=1, heads=1),
            _layer(0, ACTNORM) + _layer(1, [f"{m}.{p}" for m in ("deviation", "mean") for p in LU])
            + _keys("transform._transforms.2._transforms.0.branch", L2)
            + _keys("transform._transforms.2._transforms.1.branch", MLP),
        ),
        (
            lambda: set_flow(dim=2, blocks=2, heads=1, interaction="radial", zero_com=True,
                             norm="2", manybody=True, radial_max_slope=3.0, radial_inverse=True,
                             radial_basis=4),
            _layer(0, ACTNORM) + _layer(1, [f"deviation.{p}" for p in LU])
            + _layer(2, [f"residual.branch.branch.{p}" for p in RADIAL])
            + _layer(3, [f"branch.{p}" for p in MANYBODY])
            + _layer(4, [f"branch.{p}" for p in MLP])
            + _layer(5, ACTNORM) + _layer(6, [f"deviation.{p}" for p in LU])
            + _layer(7, [f"block.residual.branch.branch.{p}" for p in RADIAL])
            + _layer(8, [f"branch.{p}" for p in MANYBODY])
            + _layer(9, [f"branch.{p}" for p in MLP]),
        ),
        (
            lambda: sequence_flow(dim=2, blocks=1, heads=1),
            _layer(0, ACTNORM) + _keys("transform._transforms.1._transforms.0.branch", L2)
            + _keys("transform._transforms.1._transforms.1.branch", MLP),
        ),
        (
            lambda: SetFlow(CNF(AttentionField(2, layers=1, hidden=4)), 2),
            _keys("transform.field", ["attention.0.w_o", "attention.0.w_q", "attention.0.w_v",
                                      "lift.bias", "lift.weight", "project.bias",
                                      "project.weight", "time_net.0.bias", "time_net.0.weight",
                                      "time_net.2.bias", "time_net.2.weight"]),
        ),
        (
            lambda: SetFlow(CNF(EGNNField(2, hidden=4, layers=1, zero_com=True)), 2, True),
            _keys("transform.field", ["embed_time.bias", "embed_time.weight"])
            + _keys("transform.field.layers.0", [
                "displacement.0.bias", "displacement.0.weight", "displacement.2.weight",
                "gate.bias", "gate.weight", "message.0.bias", "message.0.weight",
                "message.2.bias", "message.2.weight", "update.0.bias", "update.0.weight",
                "update.2.bias", "update.2.weight"]),
        ),
    ],
)
def test_state_dict_keys_match_saved_checkpoints(make, expected):
    # Checkpoints store these keys: a renamed attribute or a reordered layer would orphan them.
    assert sorted(make().state_dict()) == sorted(expected + STANDARDISATION)


def test_flows_saved_before_the_standardisation_load_as_unstandardised():
    old = set_flow(dim=2, blocks=1, heads=1).state_dict()  # keeps the modules' versions
    for key in [k for k in old if k.startswith("standardisation.")]:
        del old[key]
    flow = set_flow(dim=2, blocks=1, heads=1)
    flow.standardise(torch.randn(16, 4, 2) * 5 + 3)
    flow.load_state_dict(old)  # strict: the missing keys are the identity's
    assert float(flow.standardisation.log_scale.abs().max()) == 0.0
    assert float(flow.standardisation.shift.abs().max()) == 0.0


STANDARDISATION = ["standardisation.initialized", "standardisation.log_scale",
                   "standardisation.shift"]


def test_state_dict_keys_of_a_flow_with_set_location():
    keys = sorted(set_flow(dim=2, blocks=1, heads=1, interaction="linear", location=True)
                  .state_dict())
    # the centroid flow is nflows' spline stack: its inner keys are nflows' own
    location = sorted(SetLocation(2).state_dict())
    assert location and all(k.startswith("centroid_flow._transforms.") for k in location)
    assert sorted(_layer(0, location) + _layer(1, ACTNORM)
                  + _layer(2, [f"{m}.{p}" for m in ("deviation", "mean") for p in LU])
                  + _layer(3, [f"branch.{p}" for p in MLP]) + STANDARDISATION) == keys


@pytest.mark.parametrize("build", [set_flow, sequence_flow])
def test_set_flow_evaluates_its_blocks_certificates_once_with_each_blocks_values(
        build, certificate_calls, monkeypatch):
    # a deep flow's alike attention blocks share one batched certificate evaluation
    # (shared_certificates, for the causal calls of a sequence flow too) for sets without
    # padding: same log-densities and derivatives as each block evaluating its own; with
    # padding each block takes its own table of counts
    torch.manual_seed(0)
    flow = build(dim=2, blocks=3, heads=2, logdet=EXACT).double().eval()
    x = torch.randn(4, 5, 2, dtype=DT, requires_grad=True)
    wrt = [x, *flow.parameters()]
    calls = certificate_calls(flow)
    shared = flow.log_prob(x)
    shared_grads = torch.autograd.grad(shared.sum(), wrt, allow_unused=True)
    assert calls[0] == 1
    monkeypatch.setattr(SetFlow, "_shared_certificates",
                        lambda self, x, mask: contextlib.nullcontext())
    own = flow.log_prob(x)
    own_grads = torch.autograd.grad(own.sum(), wrt, allow_unused=True)
    assert calls[0] == 1 + 3
    assert torch.allclose(shared, own, rtol=1e-12, atol=1e-12)
    for a, b in zip(shared_grads, own_grads, strict=True):
        assert (a is None) == (b is None)
        assert a is None or torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    monkeypatch.undo()
    calls = certificate_calls(flow)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[0, 3:] = False
    flow.log_prob(x.detach(), mask)
    assert calls[0] == 3
