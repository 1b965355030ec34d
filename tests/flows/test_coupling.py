"""Tests for the set-coupling layer and flow: inverse, exact log-det, exchangeability, padding."""

import math

import pytest
import torch

from flowattn.errors import ConfigError, InputError
from flowattn.flows import SetCoupling, SetLocation, coupling_flow
from flowattn.sets.config import SetsFlow, build_flow

DT = torch.float64


def _layer(parity=0, dim=2, blocks=2, seed=0, zero_com=False):
    """A coupling layer far from the identity: random weights in its zero-initialised head."""
    torch.manual_seed(seed)
    layer = SetCoupling(dim, parity, hidden=16, blocks=blocks, heads=2, bins=6,
                        tail_bound=3.0, zero_com=zero_com).double()
    with torch.no_grad():
        layer.conditioner.head.weight.normal_(0, 0.5)
        layer.conditioner.head.bias.normal_(0, 0.5)
    return layer


def _flow(seed=0, **settings):
    torch.manual_seed(seed)
    flow = coupling_flow(2, **{"layers": 3, "hidden": 16, "blocks": 1, **settings}).double()
    flow.log_prob(torch.randn(32, 6, 2, dtype=DT) * 1.5 + 0.3)  # initialise the ActNorms
    with torch.no_grad():
        for module in flow.modules():
            if isinstance(module, SetCoupling):
                module.conditioner.head.weight.normal_(0, 0.3)
    return flow.eval()


def _mask(batch=3, n=6):
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, 4:] = False
    mask[1, 1] = False
    return mask


def _present_jacobian(fn, x, mask):
    """The Jacobian of fn (1, N, D) -> (1, N, D) with respect to the present elements only."""
    present = mask[0]

    def restricted(values):
        full = x.clone()
        full[0, present] = values
        return fn(full)[0, present]

    jac = torch.autograd.functional.jacobian(restricted, x[0, present])
    m = x[0, present].numel()
    return jac.reshape(m, m)


@pytest.mark.parametrize("parity", [0, 1])
def test_coupling_inverse_round_trips_in_float64_with_masks(parity):
    layer = _layer(parity)
    x = 2 * torch.randn(3, 6, 2, dtype=DT)
    x[0, 0, parity] = 4.0  # beyond the tail bound: the identity there
    mask = _mask()
    y, logdet = layer(x, context=mask)
    assert (y - x).abs().max() > 1e-2  # not the identity
    x_back, inv_logdet = layer.inverse(y, context=mask)
    assert (x_back - x).abs().max() < 1e-10
    assert torch.allclose(inv_logdet, -logdet, atol=1e-10)


def test_coupling_flow_inverse_round_trips_and_samples_log_probs():
    flow = _flow()
    mask = _mask()
    x = torch.randn(3, 6, 2, dtype=DT)
    z = flow.transform_to_noise(x, mask)
    x_back, _ = flow.transform.inverse(z, context=mask)
    assert (x_back - x)[mask].abs().max() < 1e-9
    g = torch.Generator().manual_seed(0)
    samples, log_prob = flow.sample_and_log_prob(3, mask=mask, generator=g)
    assert torch.allclose(flow.log_prob(samples, mask), log_prob, atol=1e-9)


@pytest.mark.parametrize("parity", [0, 1])
def test_coupling_logdet_equals_slogdet_of_exact_jacobian_over_present_elements(parity):
    layer = _layer(parity, dim=3)
    x = torch.randn(1, 5, 3, dtype=DT)
    mask = torch.tensor([[True, True, False, True, True]])
    _, logdet = layer(x, context=mask)
    jac = _present_jacobian(lambda v: layer(v, context=mask)[0], x, mask)
    sign, ref = torch.linalg.slogdet(jac)
    assert sign > 0 and abs(logdet.item() - ref.item()) < 1e-10


def test_coupling_flow_log_prob_equals_change_of_variables_with_exact_jacobian():
    flow = _flow()
    x = torch.randn(1, 5, 2, dtype=DT)
    mask = torch.tensor([[True, False, True, True, True]])
    _, logdet = flow.transform(x, context=mask)
    jac = _present_jacobian(lambda v: flow.transform(v, context=mask)[0], x, mask)
    assert abs(logdet.item() - torch.linalg.slogdet(jac)[1].item()) < 1e-9


def test_coupling_is_permutation_equivariant_with_invariant_logdet():
    flow = _flow()
    x = torch.randn(4, 6, 2, dtype=DT)
    mask = _mask(4)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    z, logdet = flow.transform(x, context=mask)
    z_perm, logdet_perm = flow.transform(x[:, perm], context=mask[:, perm])
    assert torch.allclose(z_perm, z[:, perm], atol=1e-12)
    assert torch.allclose(logdet_perm, logdet, atol=1e-12)


def test_coupling_padding_passes_through_and_is_ignored():
    flow = _flow()
    layer = _layer()
    mask = _mask()
    x = torch.randn(3, 6, 2, dtype=DT)
    other = x.clone()
    other[~mask] = 1e3 * torch.randn(int((~mask).sum()), 2, dtype=DT)
    for transform in (layer, flow.transform):
        y, logdet = transform(x, context=mask)
        y_other, logdet_other = transform(other, context=mask)
        assert torch.equal(y[~mask], x[~mask]) and torch.equal(y_other[~mask], other[~mask])
        assert torch.allclose(y[mask], y_other[mask], atol=1e-12)
        assert torch.allclose(logdet, logdet_other, atol=1e-12)
    # a padded element counts for nothing: the same set without its padding
    short = x[:1, :4]
    assert torch.allclose(flow.log_prob(x[:1], mask[:1]), flow.log_prob(short), atol=1e-10)


def test_coupling_conditioner_sees_other_elements_but_blocks_zero_does_not():
    x = torch.randn(1, 5, 2, dtype=DT)
    moved = x.clone()
    moved[0, 1:, 1] += 0.5  # the kept features of the *other* elements
    for blocks, interacts in ((2, True), (0, False)):
        layer = _layer(0, blocks=blocks)
        change = (layer(moved)[0][0, 0, 0] - layer(x)[0][0, 0, 0]).abs()
        assert (change > 1e-6) == interacts


def test_coupling_flow_short_fit_lowers_the_nll():
    torch.manual_seed(0)
    # sets of points on one of two lines: y_i = +-x_i, a dependence between elements
    sign = torch.where(torch.rand(256, 1, 1) < 0.5, 1.0, -1.0)
    t = torch.randn(256, 6, 1)
    x = torch.cat([t, sign * t + 0.1 * torch.randn(256, 6, 1)], dim=-1)
    flow = coupling_flow(2, layers=2, hidden=16, blocks=1, location=False, linear=False)
    opt = torch.optim.Adam(flow.parameters(), lr=1e-2)
    flow.log_prob(x)  # ActNorm initialisation
    with torch.no_grad():
        before = -flow.log_prob(x).mean().item()
    for _ in range(60):
        batch = x[torch.randint(256, (64,))]
        loss = -flow.log_prob(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = -flow.log_prob(x).mean().item()
    assert after < before - 3.0, (before, after)


def test_coupling_refuses_bad_settings_where_they_enter():
    with pytest.raises(InputError, match="dim >= 2"):
        SetCoupling(1)
    with pytest.raises(InputError, match="heads=3 must divide"):
        SetCoupling(2, hidden=16, heads=3)
    with pytest.raises(InputError, match="parity"):
        SetCoupling(2, parity=2)
    with pytest.raises(InputError, match="tail_bound"):
        SetCoupling(2, tail_bound=0.0)
    with pytest.raises(InputError, match="width D=3"):
        SetCoupling(2)(torch.randn(2, 4, 3))
    with pytest.raises(InputError, match="layers must be >= 1"):
        coupling_flow(2, layers=0)


def test_coupling_config_builds_and_refuses_what_it_cannot_do():
    flow = build_flow(SetsFlow(flow="coupling", coupling_layers=2, coupling_hidden=8,
                               coupling_blocks=1, coupling_bins=4), 2, 8, False)
    couplings = [m for m in flow.modules() if isinstance(m, SetCoupling)]
    assert len(couplings) == 2 and couplings[0].bins == 4
    assert flow.log_prob(torch.randn(3, 8, 2)).shape == (3,)
    particles = build_flow(SetsFlow(flow="coupling", coupling_layers=2, coupling_hidden=8),
                           3, 4, True)
    assert particles.zero_com and all(m.zero_com for m in particles.modules()
                                      if isinstance(m, SetCoupling))
    assert not any(isinstance(m, SetLocation) for m in particles.modules())  # as for resflow
    with pytest.raises(ConfigError, match="D >= 2"):
        build_flow(SetsFlow(flow="coupling"), 1, 4, False)
    with pytest.raises(ConfigError, match="heads=3 must divide"):
        build_flow(SetsFlow(flow="coupling", heads=3), 3, 4, False)
    with pytest.raises(ValueError, match="coupling_layers is a setting of coupling flows"):
        SetsFlow(flow="cnf", coupling_layers=4)
    with pytest.raises(ValueError, match="give coupling_layers too"):
        SetsFlow(flow="resflow", coupling_hidden=32)
    with pytest.raises(ValueError, match="residual-flow setting"):
        SetsFlow(flow="coupling", interaction="linear")
    with pytest.raises(ValueError, match="setting of continuous flows"):
        SetsFlow(flow="coupling", field="egnn")


# ----------------------------------------------------------------- particles (zero_com)


def _centred(x, mask=None):
    w = torch.ones(x.shape[:2], dtype=x.dtype) if mask is None else mask.to(x.dtype)
    mean = (x * w[..., None]).sum(1, keepdim=True) / w.sum(1)[:, None, None]
    return torch.where(w[..., None] > 0, x - mean, x)


def _subspace_jacobian(fn, x, mask):
    """The Jacobian of fn on the zero-centre-of-mass subspace of the present elements of the
    one set in x, in an orthonormal basis of that subspace: ((n - 1) D, (n - 1) D)."""
    jac = _present_jacobian(fn, x, mask)
    n, d = int(mask.sum()), x.shape[-1]
    centre = torch.eye(n, dtype=DT) - 1.0 / n
    basis_n = torch.linalg.svd(centre)[0][:, : n - 1].contiguous()
    basis = torch.kron(basis_n, torch.eye(d, dtype=DT))
    return basis.T @ jac @ basis


def _randomise_heads(flow, x):
    """Initialise the ActNorms on x and move every coupling off the identity; eval mode."""
    flow.log_prob(1.5 * x)
    with torch.no_grad():
        for module in flow.modules():
            if isinstance(module, SetCoupling):
                module.conditioner.head.weight.normal_(0, 0.3)
    flow.eval()


def _subspace_log_prob(flow, x):
    """log p of the one configuration x (1, n, D) in the E-NF convention, brute force: log N(z)
    on the (n - 1) D subspace plus the log-det of the Jacobian in a basis of it."""
    n, d = x.shape[1:]
    restricted = _subspace_jacobian(lambda v: flow.transform_to_noise(v), x,
                                    torch.ones(1, n, dtype=torch.bool))
    z = flow.transform_to_noise(x)
    return (-0.5 * z.square().sum() - 0.5 * (n - 1) * d * math.log(2 * math.pi)
            + torch.linalg.slogdet(restricted)[1]).item()


@pytest.mark.parametrize("parity,dim", [(0, 2), (1, 2), (0, 3), (1, 3)])
def test_zero_com_coupling_logdet_is_the_determinant_on_the_subspace(parity, dim):
    # the re-centring term log (1/n) sum_i 1/s'(x_i) is what makes it exact: without it the
    # log-det would be that of the map on all of R^{n D}, which leaves the subspace
    layer = _layer(parity, dim=dim, zero_com=True)
    mask = torch.tensor([[True, True, False, True, True, True]])
    x = _centred(1.5 * torch.randn(1, 6, dim, dtype=DT), mask)
    y, logdet = layer(x, context=mask)
    assert (y[0, mask[0]].sum(0)).abs().max() < 1e-12  # outputs stay centred
    restricted = _subspace_jacobian(lambda v: layer(v, context=mask)[0], x, mask)
    sign, ref = torch.linalg.slogdet(restricted)
    assert sign > 0 and abs(logdet.item() - ref.item()) < 1e-10
    plain = layer.zero_com
    layer.zero_com = False  # the uncorrected log-det differs by more than rounding
    assert abs(layer(x, context=mask)[1].item() - ref.item()) > 1e-3
    layer.zero_com = plain


def test_zero_com_coupling_inverse_round_trips_with_its_implicit_derivative():
    layer = _layer(0, zero_com=True)
    mask = _mask()
    x = _centred(2 * torch.randn(3, 6, 2, dtype=DT), mask)
    x[0, 0, 0] += 4.0  # beyond the tail bound for one element
    x = _centred(x, mask)
    y, logdet = layer(x, context=mask)
    x_back, inv_logdet = layer.inverse(y, context=mask)
    assert (x_back - x).abs().max() < 1e-10
    assert torch.allclose(inv_logdet, -logdet, atol=1e-10)
    # the inverse's Jacobian on the subspace is the inverse of the forward one: the bisection
    # carries no graph, so this checks the Newton step that gives the shift its derivative
    one = mask[:1]
    forward = _subspace_jacobian(lambda v: layer(v, context=one)[0], x[:1], one)
    backward = _subspace_jacobian(lambda v: layer.inverse(v, context=one)[0], y[:1], one)
    eye = torch.eye(forward.shape[0], dtype=DT)
    assert (backward @ forward - eye).abs().max() < 1e-8


def test_zero_com_coupling_flow_density_is_exchangeable_translation_invariant_and_samples():
    torch.manual_seed(1)
    flow = coupling_flow(3, layers=3, hidden=16, blocks=1, location=False,
                         zero_com=True).double()
    x = _centred(torch.randn(4, 5, 3, dtype=DT))
    _randomise_heads(flow, x)
    log_prob = flow.log_prob(x)
    perm = torch.tensor([2, 4, 0, 1, 3])
    assert torch.allclose(flow.log_prob(x[:, perm]), log_prob, atol=1e-10)
    assert torch.allclose(flow.log_prob(x + 2.5), log_prob, atol=1e-10)
    assert abs(log_prob[0].item() - _subspace_log_prob(flow, x[:1])) < 1e-9
    samples, sample_log_prob = flow.sample_and_log_prob(
        6, set_size=5, generator=torch.Generator().manual_seed(2))
    assert samples.sum(1).abs().max() < 1e-10
    assert torch.allclose(flow.log_prob(samples), sample_log_prob, atol=1e-8)
    with pytest.raises(InputError, match="centroid"):
        coupling_flow(2, zero_com=True)  # location defaults to True: refused by name


def test_residual_flow_with_coupling_layers_is_exact_on_the_subspace():
    # resflow + coupling_layers: the residual blocks, then set couplings on the base side
    torch.manual_seed(3)
    flow = build_flow(SetsFlow(blocks=2, coupling_layers=2, coupling_hidden=8,
                               coupling_blocks=1), 2, 4, True).double()
    kinds = [type(t).__name__ for t in flow.transform._transforms]
    assert kinds[-3:] == ["ActNorm", "EquivariantLinear", "SetCoupling"]
    assert kinds.count("SetCoupling") == 2 and "RadialInteraction" in str(flow)
    x = _centred(torch.randn(3, 4, 2, dtype=DT))
    _randomise_heads(flow, x)
    assert abs(flow.log_prob(x[:1]).item() - _subspace_log_prob(flow, x[:1])) < 1e-8
    plain = build_flow(SetsFlow(blocks=2), 2, 4, True)
    assert not any(isinstance(m, SetCoupling) for m in plain.modules())


@pytest.mark.slow
def test_coupling_fit_evaluates_samples_and_reloads_through_the_command_line(tmp_path, capsys):
    import json

    import numpy as np

    from flowattn.cli import main
    from flowattn.sets import load_flow

    out = tmp_path / "run"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"flow": "coupling", "coupling_layers": 2, "coupling_hidden": 8,
                                  "coupling_blocks": 1, "eval_every": 4, "val_sets": 16,
                                  "warmup": 1}))
    assert main(["sets", "fit", "--data", "shape-sets-varsize", "--num-train", "64",
                 "--batch-size", "8", "--no-progress", "--steps", "4",
                 "--out", str(out), "--config", str(config)]) == 0
    assert "true NLL" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    flow, record = load_flow(out)
    assert record["config"].flow.flow == "coupling"
    assert sum(isinstance(m, SetCoupling) for m in flow.modules()) == 2
    from flowattn.data import load_dataset
    from flowattn.sets.train import evaluate

    test = load_dataset("shape-sets-varsize", {"train": 64, "val": 16, "test": 2000})["test"]
    assert abs(evaluate(flow, test)["nll"] - summary["test_nll"]) < 1e-4  # reloaded exactly
    samples = tmp_path / "samples.npz"
    assert main(["sets", "sample", "--checkpoint", str(out), "--num", "5", "--out",
                 str(samples)]) == 0
    x = np.load(samples)["x"]
    assert x.shape == (5, 10, 2) and np.isfinite(x).all()
