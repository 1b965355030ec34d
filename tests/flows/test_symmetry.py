"""Tests for the mirror-averaged density of `SetFlow(symmetry="reflections")`: the formula, its
invariance, its normalisation, the Jensen bound training maximises, sampling, and the settings
and training batches of `sets fit --symmetry reflections`."""

import itertools
import math

import pytest
import torch

from flowattn.errors import ConfigError, InputError
from flowattn.flows import SetFlow, coupling_flow
from flowattn.sets.config import SetsRunConfig, build_flow
from flowattn.sets.train import SetsTask
from flowattn.training.distributed import Distributed

SIGNS = [torch.tensor(s, dtype=torch.float64) for s in itertools.product((1.0, -1.0), repeat=2)]


def _mirrored(seed=0):
    torch.manual_seed(seed)
    flow = coupling_flow(2, layers=3, hidden=16, blocks=1, location=False).double()
    with torch.no_grad():  # move the splines away from the identity: an asymmetric q
        for p in flow.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return SetFlow(flow.transform, dim=2, symmetry="reflections").double().eval()


def test_log_prob_is_the_average_of_the_four_mirror_images():
    flow = _mirrored()
    x = torch.randn(5, 4, 2, dtype=torch.float64)
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[1, 3:] = False
    log_q = torch.stack([flow.component_log_prob(x * s, mask) for s in SIGNS])
    expected = torch.log(log_q.exp().mean(0))  # 1/4 sum_S q(X S), written out
    torch.testing.assert_close(flow.log_prob(x, mask), expected)
    # exactly invariant under each reflection, while q itself is not
    for s in SIGNS[1:]:
        torch.testing.assert_close(flow.log_prob(x * s, mask), flow.log_prob(x, mask))
    assert (log_q[1:] - log_q[0]).abs().max() > 0.1
    # Jensen: log p(X) >= the mean of log q(X S), which training maximises
    assert (flow.log_prob(x, mask) >= log_q.mean(0) - 1e-12).all()


def test_mirror_average_integrates_to_one():
    # sets of one point in 2-D: integrate p on a grid that holds all of its mass
    flow = _mirrored(1)
    side = torch.linspace(-9, 9, 361, dtype=torch.float64)
    grid = torch.cartesian_prod(side, side).view(-1, 1, 2)
    cell = (side[1] - side[0]) ** 2
    with torch.no_grad():
        p = flow.log_prob(grid).exp()
        q = flow.component_log_prob(grid).exp()
    assert abs(float(q.sum() * cell) - 1.0) < 2e-3  # the grid holds q's mass ...
    assert abs(float(p.sum() * cell) - 1.0) < 2e-3  # ... and p's: a density, 2^-D included


def test_samples_are_mirror_images_of_the_flows_own_samples():
    flow = _mirrored()
    own = SetFlow(flow.transform, dim=2).double().eval()
    with torch.no_grad():
        x = flow.sample(400, 3, generator=torch.Generator().manual_seed(5))
        y = own.sample(400, 3, generator=torch.Generator().manual_seed(5))
    ratio = (x / y).round()
    assert set(ratio.flatten().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(x, y * ratio[:, :1])  # one sign pattern per set
    patterns = (ratio[:, 0] > 0).long() @ torch.tensor([1, 2])
    share = torch.bincount(patterns, minlength=4).double() / 400
    assert (share - 0.25).abs().max() < 0.1
    x, log_p = flow.sample_and_log_prob(8, 3)
    torch.testing.assert_close(log_p, flow.log_prob(x))


def test_symmetry_setting_is_checked_and_rebuilt():
    with pytest.raises(InputError, match="symmetry must be one of"):
        SetFlow(coupling_flow(2, layers=1, hidden=8).transform, dim=2, symmetry="rotations")
    mirrored = SetFlow(coupling_flow(2, layers=1, hidden=8).transform, dim=2,
                       symmetry="reflections")
    with pytest.raises(InputError, match="width D=3, but the module expects D=2"):
        mirrored.log_prob(torch.randn(3, 4, 3))  # named, not a broadcasting error
    with pytest.raises(ConfigError, match="augment none or reflections"):
        SetsRunConfig.build({"flow": "coupling", "symmetry": "reflections",
                             "augment": "rotations"})
    with pytest.raises(ConfigError, match="energy_weight 0 or symmetry none"):
        SetsRunConfig.build({"data": "dw4", "symmetry": "reflections", "energy_weight": 0.1})
    config = SetsRunConfig.build({"flow": "coupling", "symmetry": "reflections"})
    flow = build_flow(config.flow, dim=2, set_size=4, zero_com=False)
    assert flow.symmetry == "reflections" and flow.reflections.shape == (4, 2)
    assert "reflections" not in flow.state_dict()  # derived from the setting, not saved


def test_training_batches_of_a_mirror_averaged_flow_are_mirrored():
    def task(**settings):
        config = SetsRunConfig.build({"data": "shape-sets", "num_train": 64, "val_sets": 8,
                                      "batch_size": 16, "flow": "coupling",
                                      "coupling_layers": 1, **settings})
        return SetsTask(config, Distributed(rank=0, world=1, device=torch.device("cpu")),
                        plots=False)

    plain, mirrored = task(symmetry="none"), task(symmetry="reflections")
    x, _ = plain.batch(torch.Generator().manual_seed(3), plain.dist)
    y, _ = mirrored.batch(torch.Generator().manual_seed(3), mirrored.dist)
    signs = (y[:, 0] / x[:, 0]).round()
    torch.testing.assert_close(y, x * signs.unsqueeze(1))
    assert (signs < 0).any(dim=1).sum() >= 8
    # validation scores the mirror average: its NLL is below the flow's own on the same sets
    mirrored.initialise()
    x = mirrored.val_data.x[:8]  # val_sets
    with torch.no_grad():
        log_p, log_q = mirrored.flow.log_prob(x), mirrored.flow.component_log_prob(x)
    expected = -log_p.mean().item() / (x.shape[1] * x.shape[2])
    assert math.isclose(mirrored.evaluate(mirrored.dist)["loss"], expected, rel_tol=1e-5)
    assert (log_p - log_q).abs().max() > 0  # the average, not q


def test_a_mirror_averaged_run_trains_as_the_augmented_run(tmp_path):
    # the same initialisation and the same mirrored batches: the same parameters, step by
    # step; only what is scored differs (the mirror average against the flow's own density)
    from flowattn.sets.train import fit

    finals, summaries = [], []
    for name, setting in (("augment", {"augment": "reflections", "symmetry": "none"}),
                          ("symmetry", {"symmetry": "reflections"})):
        config = SetsRunConfig.build({"data": "shape-sets", "num_train": 64, "val_sets": 16,
                                      "batch_size": 16, "flow": "coupling",
                                      "coupling_layers": 2, "coupling_hidden": 16,
                                      "steps": 6, "eval_every": 3, "threads": 1, **setting})
        summaries.append(fit(config, tmp_path / name, progress=False, plots=False,
                             tensorboard=False))
        finals.append(torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"])
    for key, value in finals[0].items():
        assert torch.equal(value, finals[1][key]), key
    assert summaries[0]["train_loss"] == summaries[1]["train_loss"]
    assert summaries[1]["test_nll"] < summaries[0]["test_nll"]  # the average scores better


def test_the_mirror_average_is_refused_for_wide_elements_by_its_number_of_passes():
    # 2^D passes of the flow per evaluation: up to D = 10 (1024), refused above by name (at
    # D = 24 the sign patterns alone took gigabytes and the average ran for hours)
    from flowattn.data import reflection_signs

    assert reflection_signs(10).shape == (1024, 10)
    with pytest.raises(InputError, match=r"2\^11 = 2,048 for elements of D = 11 .* up to D = 10"):
        reflection_signs(11)
    flow = coupling_flow(11, layers=1, hidden=8, blocks=1, location=False)
    assert SetFlow(flow.transform, dim=11).symmetry == "none"
    with pytest.raises(InputError, match="offered up to D = 10"):
        SetFlow(flow.transform, dim=11, symmetry="reflections")
