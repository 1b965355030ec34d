"""Set flows as Boltzmann generators: importance weights, ``sample --energy``, ``floor``."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from nflows.transforms import IdentityTransform

from flowattn.cli import main
from flowattn.data import dw4_energy, load_npz
from flowattn.data.partition import harmonic_log_partition
from flowattn.errors import InputError
from flowattn.flows import set_flow
from flowattn.flows.setflow import SetFlow
from flowattn.sets import SetsRunConfig, fit, load_flow
from flowattn.sets.boltzmann import BoltzmannSample, boltzmann_sample, boltzmann_summary
from flowattn.training.device import NO_COMPILER, cpp_compiler


def harmonic(stiffness):
    def energy(x):
        diff = x.unsqueeze(-2) - x.unsqueeze(-3)
        return 0.25 * stiffness * diff.pow(2).sum((-3, -2, -1))
    return energy


def test_a_flow_equal_to_the_boltzmann_density_gets_equal_weights_and_the_exact_log_z():
    # the identity flow in zero-CoM mode is N(0, I) on V, the Boltzmann density of the
    # harmonic energy with k n = 1: every weight is Z, the ESS is 1
    n, dim = 4, 3
    flow = SetFlow(IdentityTransform(), dim, zero_com=True)
    sample = boltzmann_sample(flow, harmonic(1 / n), 300, n, torch.Generator().manual_seed(0))
    truth = harmonic_log_partition(n, dim, 1 / n)
    torch.testing.assert_close(sample.log_w, torch.full((300,), truth), rtol=0, atol=1e-5)
    summary = boltzmann_summary(sample)
    assert summary["ess"] == pytest.approx(1)
    assert summary["log_z"] == pytest.approx(truth, abs=1e-5)
    # the reweighted mean energy is the sample mean, near equipartition d / 2
    assert summary["mean_energy"] == pytest.approx(summary["sample_mean_energy"])
    assert abs(summary["mean_energy"] - 4.5) < 3 * summary["mean_energy_error"]


def test_weights_against_a_wider_target_recover_its_mean_energy_and_log_z():
    # q = N(0, I) on V, p ∝ exp(-k/2 Σ_{i<j} ||x_i - x_j||^2) with k n = 0.8 (wider):
    # E_p[E] = d / 2 and log Z in closed form, both within the reported errors
    n, dim = 3, 2
    k = 0.8 / n
    flow = SetFlow(IdentityTransform(), dim, zero_com=True)
    sample = boltzmann_sample(flow, harmonic(k), 4000, n, torch.Generator().manual_seed(1))
    summary = boltzmann_summary(sample)
    assert 0.5 < summary["ess"] < 1
    assert abs(summary["mean_energy"] - 2.0) < 3 * summary["mean_energy_error"]
    truth = harmonic_log_partition(n, dim, k)
    assert abs(summary["log_z"] - truth) < 3 * summary["log_z_error"]


def test_weights_of_a_trained_flow_are_minus_energy_minus_its_exact_log_density():
    flow = set_flow(2, 1, 1, zero_com=True, norm="2", interaction="radial").double()
    sample = boltzmann_sample(flow, dw4_energy, 16, 4, torch.Generator().manual_seed(0),
                              batch_size=5)
    assert sample.x.shape == (16, 4, 2)
    torch.testing.assert_close(sample.x.sum(1), torch.zeros(16, 2, dtype=torch.float64),
                               atol=1e-10, rtol=0)
    flow.eval()
    with torch.no_grad():
        torch.testing.assert_close(sample.log_w, -dw4_energy(sample.x) - flow.log_prob(sample.x))
    assert flow.training is False


def test_boltzmann_sample_refuses_a_flow_outside_the_zero_com_subspace():
    flow = SetFlow(IdentityTransform(), 2, zero_com=False)
    with pytest.raises(InputError, match="zero-centre-of-mass"):
        boltzmann_sample(flow, dw4_energy, 4, 4)


def test_close_pairs_are_counted_per_configuration():
    x = torch.tensor([[[0.0, 0.0], [0.5, 0.0], [3.0, 0.0]],
                      [[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]]])
    sample = BoltzmannSample(x, torch.zeros(2), torch.zeros(2), torch.tensor([0.0, -math.inf]))
    summary = boltzmann_summary(sample)
    assert summary["close_pairs"] == 0.5
    assert summary["close_pairs_reweighted"] == 1.0  # all the weight is on the close one
    # p(close) = 1, q(close) = (1 + 1/2) / 3: kl = log 2
    assert summary["close_pairs_kl"] == pytest.approx(math.log(2))


def test_close_pairs_bound_the_distance_from_the_floor_when_p_never_has_them():
    # half of the samples hold a close pair, none of the weight does: p(close) = 0, so
    # KL(p || q) >= -log(1 - q(close)), q(close) = (50 + 1/2) / 101
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0]]).repeat(100, 1, 1)
    x[:50, 1, 0] = 0.5
    log_w = torch.zeros(100)
    log_w[:50] = -math.inf
    summary = boltzmann_summary(BoltzmannSample(x, torch.zeros(100), torch.zeros(100), log_w))
    assert summary["close_pairs"] == 0.5 and summary["close_pairs_reweighted"] == 0.0
    assert summary["close_pairs_kl"] == pytest.approx(-math.log(1 - 50.5 / 101))


# --- the command line ------------------------------------------------------------------------

SMALL = {"train": 64, "val": 32, "test": 40}


@pytest.fixture
def small_particles(monkeypatch, tmp_path):
    """Built-in particle data in small splits, cached under a temporary home."""
    from flowattn.data import PARTICLE_SYSTEMS, registry

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("dw4", "gaussian-sets"):
        monkeypatch.setitem(registry.DEFAULT_SIZES, name, dict(SMALL))
    # a short sampler: these tests need configurations, not equilibrium
    short = dataclasses.replace(PARTICLE_SYSTEMS["dw4"], burn_in=50, thin=2)
    monkeypatch.setitem(PARTICLE_SYSTEMS, "dw4", short)


def tiny_run(tmp_path: Path, data: str) -> Path:
    """Two training steps of a one-block flow (no plots: they would take most of the time)."""
    config = SetsRunConfig.build({"data": data, "blocks": 1, "hidden": 8, "steps": 2,
                                  "compile": False,  # eager: these tests are about sampling
                                  "batch_size": 8, "eval_every": 2, "checkpoint_every": 2,
                                  "val_sets": 16, "warmup": 1, "radial_basis": 8})
    out = tmp_path / f"run-{data}"
    fit(config, out, progress=False, tensorboard=False, plots=False)
    return out


def test_sample_energy_writes_weights_beside_the_samples_and_reports_the_ess(
        tmp_path, capsys, small_particles):
    run = tiny_run(tmp_path, "dw4")
    capsys.readouterr()
    out = tmp_path / "samples.npz"
    assert main(["sets", "sample", "--checkpoint", str(run), "--num", "50", "--energy",
                 "--batch-size", "16", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    # drawn and scored 16 at a time (four batches), reported as it goes (a log: one last line)
    progress = [line for line in captured.err.splitlines() if line.startswith("sampling")]
    assert len(progress) == 1 and "configuration 50/50 (100%)" in progress[0]
    assert "Kish ESS" in printed and "reweighted" in printed and "closer than 0.85" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert f"at least {result['close_pairs_kl']:.3f} nats above the entropy floor" in printed
    with np.load(out) as archive:
        x, log_w = torch.from_numpy(archive["x"]), torch.from_numpy(archive["log_w"])
        energy, log_q = torch.from_numpy(archive["energy"]), torch.from_numpy(archive["log_q"])
    assert x.shape == (50, 4, 2) and x.dtype == torch.float64 and log_w.shape == (50,)
    torch.testing.assert_close(energy, dw4_energy(x))
    torch.testing.assert_close(log_w, -energy - log_q)
    # log q is the flow's own density at the written samples
    flow, _ = load_flow(run)
    with torch.no_grad():
        torch.testing.assert_close(log_q, flow.double().log_prob(x))
    ess = (log_w.logsumexp(0) * 2 - (2 * log_w).logsumexp(0)).exp() / 50
    assert result["ess"] == pytest.approx(ess.item())
    assert result["system"] == "dw4" and 1 / 50 <= result["ess"] <= 1
    assert load_npz(out).x.shape == (50, 4, 2)  # still an ordinary file of sets


def test_sample_energy_scores_a_continuous_flows_exact_trace_in_small_batches(
        tmp_path, monkeypatch, small_particles):
    # the exact trace solves every configuration of a batch together with N D products per
    # field evaluation: 512 // (N D) at a time unless --batch-size says (LJ13: 13, DW4: 64)
    from flowattn.sets import boltzmann
    from flowattn.sets.cli import energy_batch_size
    from flowattn.sets.config import SetsFlow, build_flow

    cnf = build_flow(SetsFlow(flow="cnf", field_hidden=4, field_layers=1), 3, 13, True)
    assert energy_batch_size(cnf, 39) == 13
    # the trace of the weights, not the run's own evaluation setting, decides
    probed = SetsFlow(flow="cnf", field_hidden=4, field_layers=1, eval_divergence="hutchinson")
    assert energy_batch_size(build_flow(probed, 3, 13, True), 39) == 13
    assert energy_batch_size(cnf, 39, "hutchinson") == 1000
    assert energy_batch_size(build_flow(SetsFlow(blocks=1), 3, 13, True), 39) == 1000
    config = SetsRunConfig.build({"data": "dw4", "flow": "cnf", "objective": "matching",
                                  "field_hidden": 4, "field_layers": 1, "steps": 1,
                                  "batch_size": 8, "eval_every": 1, "val_sets": 4,
                                  "warmup": 1})
    run = tmp_path / "cnf"
    fit(config, run, progress=False, tensorboard=False, plots=False)
    seen = []
    sample = boltzmann.boltzmann_sample
    monkeypatch.setattr(boltzmann, "boltzmann_sample",
                        lambda *a, **k: seen.append(k["batch_size"]) or sample(*a, **k))
    for extra, expected in (((), 64), (("--batch-size", "3"), 3)):
        assert main(["sets", "sample", "--checkpoint", str(run), "--num", "4", "--energy",
                     "--no-progress", "--out", str(tmp_path / "s.npz"), *extra]) == 0
        assert seen.pop() == expected


def test_weights_of_a_continuous_flow_take_the_exact_trace_whatever_its_evaluation_setting(
        tmp_path, capsys, monkeypatch, small_particles):
    # a one-probe log q is unbiased but exp(-E - log q) is not: --energy scores exactly unless
    # asked, and a probed trace, when asked, draws new probes for every batch
    config = SetsRunConfig.build({"data": "dw4", "flow": "cnf", "objective": "matching",
                                  "field_hidden": 4, "field_layers": 1, "steps": 1,
                                  "batch_size": 8, "eval_every": 1, "val_sets": 4,
                                  "warmup": 1, "eval_divergence": "hutchinson"})
    run = tmp_path / "cnf"
    fit(config, run, progress=False, tensorboard=False, plots=False)
    from flowattn.flows.continuous import cnf as cnf_module

    flow, _ = load_flow(run)
    flow = flow.double()
    cnf = next(m for m in flow.modules() if isinstance(m, cnf_module.CNF))
    assert cnf.eval_divergence == "hutchinson"
    generators = []  # the probes' generator of every evaluation-mode solve
    own = cnf_module.evaluation_generator
    monkeypatch.setattr(cnf_module, "evaluation_generator",
                        lambda *a: generators.append(own(*a)) or generators[-1])

    def weights(divergence):
        return boltzmann_sample(flow, dw4_energy, 6, 4, torch.Generator().manual_seed(1),
                                batch_size=3, divergence=divergence)

    exact = weights("exact")
    generators.clear()
    probed = weights("hutchinson")
    # the two batches of three draw on one stream of probes, not on one probe pattern each
    assert len(generators) >= 2 and all(g is generators[0] for g in generators)
    assert cnf.eval_divergence == "hutchinson"  # the flow's own setting is restored
    torch.testing.assert_close(exact.x, probed.x)  # the same draws
    cnf.eval_divergence = "exact"
    with torch.no_grad():
        torch.testing.assert_close(exact.log_q, flow.log_prob(exact.x))
    assert (probed.log_q - exact.log_q).abs().min() > 1e-6  # every score carries probe noise
    with pytest.raises(InputError, match="divergence"):
        weights("auto")
    for extra, trace in (((), "exact"), (("--divergence", "hutchinson"), "hutchinson")):
        out = tmp_path / f"{trace}.npz"
        assert main(["sets", "sample", "--checkpoint", str(run), "--num", "6", "--energy",
                     "--no-progress", "--batch-size", "3", "--seed", "1", "--out", str(out),
                     *extra]) == 0
        with np.load(out) as archive:
            log_q = torch.from_numpy(archive["log_q"])
        torch.testing.assert_close(log_q, (exact if trace == "exact" else probed).log_q)
    assert "Hutchinson's trace" in capsys.readouterr().out
    code = main(["sets", "sample", "--checkpoint", str(run), "--num", "6", "--divergence",
                 "exact", "--out", str(tmp_path / "plain.npz")])
    assert code == 2 and "without --energy" in capsys.readouterr().err
    residual = tiny_run(tmp_path, "dw4")  # its log-dets are its own: no trace to choose
    capsys.readouterr()
    code = main(["sets", "sample", "--checkpoint", str(residual), "--num", "6", "--energy",
                 "--divergence", "exact", "--out", str(tmp_path / "residual.npz")])
    assert code == 2 and "continuous flow's trace" in capsys.readouterr().err


def test_sample_energy_on_data_without_an_energy_is_one_clear_line(tmp_path, capsys,
                                                                   small_particles):
    run = tiny_run(tmp_path, "gaussian-sets")
    capsys.readouterr()
    code = main(["sets", "sample", "--checkpoint", str(run), "--num", "5", "--energy",
                 "--out", str(tmp_path / "s.npz")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "'gaussian-sets', whose energy is unknown" in err
    assert not (tmp_path / "s.npz").exists()


def test_floor_prints_the_entropy_floor_with_its_error(tmp_path, capsys, small_particles):
    assert main(["sets", "floor", "--data", "dw4", "--chains", "100", "--stages", "20",
                 "--no-progress", "--json"]) == 0
    printed = capsys.readouterr().out
    assert "entropy floor" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["nll"] == pytest.approx(result["mean_energy"] + result["log_z"])
    assert result["error"] > 0 and result["nll_per_dim"] == pytest.approx(result["nll"] / 6)
    # a warning exactly when fewer than 30 of the 100 chains carry the weight
    assert ("warning: only" in printed) == (result["ess"] * 100 < 30)
    assert main(["sets", "floor", "--data", "gaussian-sets"]) == 2
    assert "no known energy" in capsys.readouterr().err
    assert main(["sets", "floor", "--data", "lj55"]) == 2  # refused before any sampling
    assert "'lj55' has no annealing settings" in capsys.readouterr().err


def test_sample_energy_refuses_another_set_size_or_a_single_sample(tmp_path, capsys,
                                                                   small_particles):
    run = tiny_run(tmp_path, "dw4")
    capsys.readouterr()
    out = str(tmp_path / "s.npz")
    assert main(["sets", "sample", "--checkpoint", str(run), "--num", "5", "--energy",
                 "--set-size", "5", "--out", out]) == 2
    assert "--set-size 5 with --energy: dw4 has 4 particles" in capsys.readouterr().err
    assert main(["sets", "sample", "--checkpoint", str(run), "--num", "1", "--energy",
                 "--out", out]) == 2
    assert "--energy needs --num >= 2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# training by energy: the reverse KL E_q[E_reg(x) + log q(x)] beside the NLL


def test_regularised_energy_is_the_energy_below_high_logarithmic_above_and_never_nan():
    from flowattn.sets.boltzmann import ENERGY_LIMIT, regularised_energy

    def energy(x):  # E = sum of squares: values and gradients known in closed form
        return x.pow(2).sum((-2, -1))

    x = torch.tensor([[[1.0, 0.0]], [[0.0, 5.0]], [[float("inf"), 0.0]], [[3.0, 0.0]]],
                     dtype=torch.float64, requires_grad=True)
    e = regularised_energy(energy, x, high=9.0)
    expected = torch.tensor([1.0, 9.0 + math.log(1 + 25.0 - 9.0),
                             9.0 + math.log1p(ENERGY_LIMIT - 9.0), 9.0], dtype=torch.float64)
    torch.testing.assert_close(e.detach(), expected, rtol=1e-12, atol=0)
    e.sum().backward()
    grad = x.grad
    assert torch.isfinite(grad).all()  # the infinite row passes no gradient, not NaN
    torch.testing.assert_close(grad[0], torch.tensor([[2.0, 0.0]], dtype=torch.float64))
    # above high: dE_reg/dx = E'(x) / (1 + E - high)
    torch.testing.assert_close(grad[1], torch.tensor([[0.0, 10.0 / 17.0]], dtype=torch.float64))
    assert (grad[2] == 0).all()
    torch.testing.assert_close(grad[3], torch.tensor([[6.0, 0.0]], dtype=torch.float64))


def test_regularised_energy_of_lj13_with_overlapping_particles_keeps_finite_gradients():
    from flowattn.data import lj13_energy
    from flowattn.sets.boltzmann import regularised_energy

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 13, 3, generator=g) * 1.5).requires_grad_(True)  # float32
    with torch.no_grad():
        x[1, 1] = x[1, 0]  # coincident: E = inf (NaN)
        x[2, 1] = x[2, 0] + 1e-3  # E ~ 1e36: finite in float32 at most just, its gradient not
    regularised_energy(lj13_energy, x, 100.0).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1:] == 0).all() and x.grad[0].abs().sum() > 0


def _small_particle_flow(coupling: bool):
    from flowattn.flows.inverse import InverseOptions
    from flowattn.flows.residual import InvertibleResidual
    from flowattn.sets.config import build_flow

    settings = {"data": "dw4", "blocks": 2, "radial_basis": 8}
    if coupling:
        settings.update(coupling_layers=1, coupling_hidden=8, coupling_blocks=1)
    torch.manual_seed(0)
    flow = build_flow(SetsRunConfig.build(settings).flow, 2, 4, True).double().eval()
    with torch.no_grad():  # away from the initialisation (a zero last layer hides mistakes)
        for p in flow.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for module in flow.modules():  # solve the inverses to rounding: finite differences need it
        if isinstance(module, InvertibleResidual):
            module.inverse_options = InverseOptions("anderson", tol=1e-13, max_iter=5000)
        if hasattr(module, "tol") and isinstance(module.tol, float):
            module.tol = 1e-14
    return flow


@pytest.mark.parametrize("coupling", [False, True], ids=["resflow", "with-coupling"])
def test_the_reverse_kl_gradient_through_the_inverse_matches_finite_differences(coupling):
    # L(θ) = mean over fixed base draws z of E_reg(f_θ⁻¹(z)) + log q_θ(f_θ⁻¹(z)): the samples
    # depend on θ only through the inverse, so a sample drawn without a graph (or an inverse
    # without implicit gradients) gets this derivative wrong
    from flowattn.flows.base import sample_standard_normal
    from flowattn.sets.boltzmann import regularised_energy

    flow = _small_particle_flow(coupling)
    z = sample_standard_normal((6, 4, 2), None, True, torch.Generator().manual_seed(1),
                               dtype=torch.float64) * 0.8

    def loss():
        x, log_q = flow.from_noise(z)
        return (regularised_energy(dw4_energy, x, 30.0) + log_q).mean()

    params = [p for p in flow.parameters() if p.requires_grad]
    value = loss()
    grads = torch.autograd.grad(value, params, allow_unused=True)
    g = torch.Generator().manual_seed(2)
    direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    analytic = sum((d * gr).sum() for d, gr in zip(direction, grads, strict=True)
                   if gr is not None)
    eps = 1e-5
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, d in zip(params, direction, strict=True):
                p.add_(sign * eps * d)
            values.append(loss())
            for p, d in zip(params, direction, strict=True):
                p.sub_(sign * eps * d)
    numeric = (values[0] - values[1]) / (2 * eps)
    assert abs(float(analytic)) > 1e-2  # the direction moves the loss
    assert float(analytic) == pytest.approx(float(numeric), rel=1e-5)


def _energy_task(settings):
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "dw4", "blocks": 1, "radial_basis": 8,
                                  "batch_size": 8, "val_sets": 16, "compile": False,
                                  **settings})
    torch.manual_seed(0)
    return SetsTask(config, Distributed(rank=0, world=1, device=torch.device("cpu")),
                    plots=False)


def test_the_memory_check_of_training_by_energy_counts_and_names_its_samples(
        small_particles, monkeypatch):
    from flowattn.errors import ConfigError
    from flowattn.sets import train as sets_train
    from flowattn.training import memory

    task = _energy_task({"energy_weight": 0.5, "energy_samples": 5})
    monkeypatch.setattr(memory, "available_memory", lambda device: 1.0)
    # no room for a batch (the flow's gradients and optimiser state left out)
    monkeypatch.setattr(sets_train, "state_bytes", lambda model, average=False: 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r", 13 items\).*use less memory per item "
                                          r"\(batch_size \(--batch-size\) \+ "
                                          r"energy_samples \(--energy-samples\) 1 alone"):
        task.check_memory()


def test_training_by_energy_adds_the_weighted_reverse_kl_per_dimension(small_particles):
    from flowattn.flows.base import set_dims
    from flowattn.sets.boltzmann import regularised_energy

    task = _energy_task({"energy_weight": 0.5, "energy_samples": 5, "energy_max": 20.0})
    batch = task.batch(torch.Generator().manual_seed(3), task.dist)
    x, mask, z = batch
    assert x.shape == (8, 4, 2) and z.shape == (5, 4, 2)
    torch.testing.assert_close(z.sum(1), torch.zeros(5, 2), rtol=0, atol=1e-6)  # on V
    again = task.batch(torch.Generator().manual_seed(3), task.dist)  # the generator's draws
    assert torch.equal(again[2], z) and torch.equal(again[0], x)
    objective, nll, count = task.loss(task.forward_module, batch)
    samples, log_q = task.flow.from_noise(z)
    dims = set_dims(x, mask, True).double().mean()
    reverse = (regularised_energy(dw4_energy, samples, 20.0) + log_q).mean()
    assert count == 8 and dims == 6
    torch.testing.assert_close(objective, nll + 0.5 * reverse / 6, rtol=1e-5, atol=1e-6)
    stats = task.train_stats()
    assert stats["reverse_kl"] == pytest.approx(float(reverse.detach()), rel=1e-5)
    objective.backward()
    assert all(torch.isfinite(p.grad).all() for p in task.flow.parameters()
               if p.grad is not None)

    plain = _energy_task({})  # no weight: no draws, the NLL alone, no statistics
    batch = plain.batch(torch.Generator().manual_seed(3), plain.dist)
    assert len(batch) == 2
    objective, nll, _ = plain.loss(plain.forward_module, batch)
    assert objective is nll and plain.train_stats() == {}


@pytest.mark.slow
@pytest.mark.skipif(cpp_compiler() is None, reason=NO_COMPILER)
def test_a_compiled_run_writes_the_checkpoint_of_the_eager_run(tmp_path, small_particles,
                                                               capsys):
    """DW4 compiles by default: the compiled log-density (by energy too, beside the eager
    inverse) trains the parameters the eager one does, and the run resumes without it."""
    from flowattn.training.checkpoint import read_checkpoint

    settings = {"data": "dw4", "blocks": 1, "radial_basis": 8, "steps": 3, "batch_size": 8,
                "eval_every": 3, "checkpoint_every": 3, "val_sets": 16, "warmup": 1,
                "energy_weight": 0.1}
    assert SetsRunConfig.build(settings).train.compile  # the data set's default
    summaries, states = {}, {}
    for compile in (False, True):
        out = tmp_path / f"compile-{compile}"
        capsys.readouterr()
        summaries[compile] = fit(SetsRunConfig.build({**settings, "compile": compile}), out,
                                 progress=False, tensorboard=False, plots=False)
        states[compile] = read_checkpoint(out, "sets")
        printed = capsys.readouterr()
        assert ("torch.compile: the first steps compile" in printed.out + printed.err) == compile
    assert states[True]["config"]["train"]["compile"] is True
    assert summaries[True]["val_loss"] == pytest.approx(summaries[False]["val_loss"], rel=1e-5)
    reference = states[False]["model"]
    assert list(states[True]["model"]) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(states[True]["model"][key], value, rtol=1e-4, atol=1e-6,
                                   msg=key)
    resumed = fit(SetsRunConfig.build({**settings, "compile": False, "steps": 5}),
                  tmp_path / "compile-True", resume=True, progress=False, tensorboard=False,
                  plots=False)
    assert resumed["step"] == 5 and not resumed["diverged"]


def test_a_run_trained_by_energy_logs_the_reverse_kl(tmp_path, small_particles):
    config = SetsRunConfig.build({"data": "dw4", "blocks": 1, "radial_basis": 8, "steps": 4,
                                  "batch_size": 8, "eval_every": 4, "checkpoint_every": 4,
                                  "log_every": 2, "val_sets": 16, "warmup": 1,
                                  "energy_weight": 0.1, "compile": False})
    summary = fit(config, tmp_path / "run", progress=False, tensorboard=False, plots=False)
    assert math.isfinite(summary["test_nll"])
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert train and all(math.isfinite(r["reverse_kl"]) for r in train)


def test_a_finished_run_resumes_trained_by_energy_and_nothing_else_may_change(
        tmp_path, small_particles):
    """Fine-tuning by energy: a maximum-likelihood run resumed with a larger ``steps`` and an
    energy weight trains on with the reverse KL (logged from the resumed steps only)."""
    from flowattn.errors import ConfigError

    settings = {"data": "dw4", "blocks": 1, "radial_basis": 8, "steps": 4, "batch_size": 8,
                "eval_every": 4, "checkpoint_every": 2, "log_every": 1, "val_sets": 16,
                "warmup": 1, "compile": False}
    out = tmp_path / "run"
    first = fit(SetsRunConfig.build(settings), out, progress=False, tensorboard=False,
                plots=False)
    assert first["step"] == 4
    tuned = {**settings, "steps": 6, "energy_weight": 0.1, "energy_samples": 4,
             "energy_max": 50.0}
    summary = fit(SetsRunConfig.build(tuned), out, resume=True, progress=False,
                  tensorboard=False, plots=False)
    assert summary["step"] == 6 and math.isfinite(summary["test_nll"])
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "train"]
    assert [r["step"] for r in train if "reverse_kl" in r] == [5, 6]
    assert all(math.isfinite(r["reverse_kl"]) for r in train if "reverse_kl" in r)
    with pytest.raises(ConfigError, match="blocks"):
        fit(SetsRunConfig.build({**tuned, "steps": 8, "blocks": 2}), out, resume=True,
            progress=False, tensorboard=False, plots=False)
    # and switched off again: the weight 0 and no draws
    plain = {**tuned, "steps": 8, "energy_weight": 0.0, "energy_samples": None}
    assert fit(SetsRunConfig.build(plain), out, resume=True, progress=False,
               tensorboard=False, plots=False)["step"] == 8
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "train"]
    assert [r["step"] for r in train if "reverse_kl" in r] == [5, 6]
    assert [r["step"] for r in train if r["step"] > 6] == [7, 8]


@pytest.mark.parametrize("settings,message", [
    ({"data": "gaussian-sets", "energy_weight": 0.1}, "needs a known energy"),
    ({"data": "dw4", "flow": "cnf", "energy_weight": 0.1}, "residual and coupling flows"),
    ({"data": "dw4", "energy_samples": 8}, "give energy_weight > 0"),
])
def test_training_by_energy_is_refused_where_it_cannot_run(settings, message):
    from flowattn.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        SetsRunConfig.build(settings)


def test_training_by_energy_needs_a_draw_for_every_process(small_particles):
    from flowattn.errors import ConfigError
    from flowattn.sets.train import SetsTask
    from flowattn.training.distributed import Distributed

    config = SetsRunConfig.build({"data": "dw4", "blocks": 1, "radial_basis": 8,
                                  "energy_weight": 0.1, "energy_samples": 1})
    with pytest.raises(ConfigError, match="energy_samples=1 is smaller than the number of "
                       "processes \\(2\\)"):
        SetsTask(config, Distributed(rank=0, world=2, device=torch.device("cpu")), plots=False)


def test_the_configs_particle_data_are_the_particle_systems():
    from flowattn.data import PARTICLE_SYSTEMS
    from flowattn.sets.config import PARTICLE_DATA

    assert set(PARTICLE_DATA) == set(PARTICLE_SYSTEMS)
