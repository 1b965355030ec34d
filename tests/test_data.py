"""flowattn.data: closed-form densities, .npz input, particle energies and the sampler."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.distributions import MultivariateNormal

from flowattn.data import (
    PARTICLE_SYSTEMS,
    DataError,
    ParticleSystem,
    SetData,
    cluster_sets,
    cluster_sets_log_prob,
    dw4_energy,
    gaussian_sets,
    gaussian_sets_log_prob,
    lj13_energy,
    lj55_energy,
    load_dataset,
    load_npz,
    metropolis,
    particle_data,
    repulsive_log_normaliser,
    repulsive_sets,
    save_npz,
)
from flowattn.errors import InputError

# ----------------------------------------------------------------------------- known densities


def test_gaussian_sets_density_equals_the_multivariate_normal_it_defines():
    sigma, tau, dim = 0.7, 1.3, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, dim, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    ours = gaussian_sets_log_prob(x, mask, sigma, tau)
    for b in range(5):
        n = int(mask[b].sum())
        ones = torch.ones(n, n, dtype=torch.float64)
        cov = sigma**2 * torch.eye(n, dtype=torch.float64) + tau**2 * ones
        mvn = MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov)
        expected = sum(mvn.log_prob(x[b, :n, d]) for d in range(dim))
        assert math.isclose(ours[b].item(), expected.item(), rel_tol=1e-12)


def test_cluster_sets_density_equals_the_mixture_it_defines():
    k, radius, scale = 3, 2.0, 0.4
    data = cluster_sets(6, min_size=2, max_size=5, clusters=k, radius=radius, scale=scale,
                        generator=torch.Generator().manual_seed(1))
    x = data.x.double()
    ours = cluster_sets_log_prob(x, data.mask, k, radius, scale)
    for b in range(6):
        pts = x[b, data.mask[b]]
        terms = []
        for c in range(k):
            angle = 2 * math.pi * c / k
            centre = torch.tensor([radius * math.cos(angle), radius * math.sin(angle)],
                                  dtype=torch.float64)
            normal = torch.distributions.Normal(centre, scale)
            terms.append(normal.log_prob(pts).sum())
        expected = torch.logsumexp(torch.stack(terms), 0) - math.log(k)
        assert math.isclose(ours[b].item(), expected.item(), rel_tol=1e-12)


@pytest.mark.parametrize("make", [gaussian_sets, cluster_sets])
def test_true_densities_are_exchangeable_and_ignore_padding(make):
    data = make(20, generator=torch.Generator().manual_seed(2))
    lp = data.true_log_prob(data.x, data.mask)
    perm = torch.randperm(data.set_size, generator=torch.Generator().manual_seed(3))
    mask = None if data.mask is None else data.mask[:, perm]
    torch.testing.assert_close(data.true_log_prob(data.x[:, perm], mask), lp)
    if data.mask is not None:
        junk = data.x + 100.0 * (~data.mask[..., None])
        torch.testing.assert_close(data.true_log_prob(junk, data.mask), lp)


def test_iid_densities_are_products_of_the_exact_one_element_marginals():
    g = torch.Generator().manual_seed(11)
    data = gaussian_sets(5, sigma=0.7, tau=1.3, generator=g)
    x = data.x.double()
    marginal = torch.distributions.Normal(0.0, math.hypot(0.7, 1.3))
    torch.testing.assert_close(data.iid_log_prob(x, None), marginal.log_prob(x).sum((1, 2)))
    data = cluster_sets(5, min_size=2, max_size=6, clusters=3, radius=2.0, scale=0.4,
                        generator=g)
    x = data.x.double()
    angles = 2 * math.pi * torch.arange(3, dtype=torch.float64) / 3
    centres = 2.0 * torch.stack([angles.cos(), angles.sin()], 1)
    per_cluster = torch.distributions.Normal(centres, 0.4).log_prob(x[:, :, None]).sum(-1)
    per_element = torch.logsumexp(per_cluster, -1) - math.log(3)  # (M, N)
    expected = (per_element * data.mask).sum(1)
    torch.testing.assert_close(data.iid_log_prob(x, data.mask), expected)


@pytest.mark.parametrize("name", ["gaussian-sets", "cluster-sets"])
def test_best_iid_nll_of_the_synthetic_sets_is_above_the_true_nll(name):
    test = load_dataset(name, {"train": 1, "val": 1})["test"]
    gap = test.mean_iid_nll() - test.mean_true_nll()
    assert gap > 5.0  # nats per set: 14.1 (gaussian-sets), 6.1 (cluster-sets)
    assert test.subset(torch.arange(10)).iid_log_prob is test.iid_log_prob


def test_cluster_sets_have_variable_sizes_within_range():
    data = cluster_sets(500, min_size=3, max_size=8, generator=torch.Generator().manual_seed(4))
    sizes = data.sizes()
    assert sizes.min() == 3 and sizes.max() == 8


# ----------------------------------------------------------------------------- .npz files


def test_npz_round_trip_with_mask(tmp_path):
    x = torch.randn(4, 3, 2)
    mask = torch.tensor([[True, True, False]] * 4)
    x = x * mask[..., None]
    save_npz(tmp_path / "d.npz", x, mask)
    data = load_npz(tmp_path / "d.npz")
    assert data.name == "d"  # the data set's name: the file's stem
    torch.testing.assert_close(data.x, x)
    assert torch.equal(data.mask, mask)
    assert [p.name for p in tmp_path.iterdir()] == ["d.npz"]  # no temporary left behind


def _write(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "arrays,message",
    [
        ({"y": np.zeros((2, 3, 2))}, "missing key 'x'"),
        ({"x": np.zeros((2, 3))}, r"shape \(M, N, D\)"),
        ({"x": np.full((2, 3, 2), np.nan)}, "NaN or Inf"),
        ({"x": np.array([[[np.inf, 0.0]]])}, "NaN or Inf"),
        ({"x": np.zeros((2, 3, 2)), "mask": np.ones((2, 4), bool)}, "mask must have shape"),
        # 0-d arrays keep their shape in the message (a 0-d mask was reported as (1,), a 0-d
        # x raised a TypeError)
        ({"x": np.zeros((2, 3, 2)), "mask": np.array(True)},
         r"mask must have shape \(M, N\) = \(2, 3\), got \(\)$"),
        ({"x": np.array(1.5)}, r"x must have shape \(M, N, D\), got shape \(\)$"),
        ({"x": np.zeros((2, 3, 2)), "mask": np.ones((2, 3))}, "boolean"),
        ({"x": np.zeros((0, 3, 2))}, "empty"),
        ({"x": np.zeros((2, 3, 2)), "mask": np.zeros((2, 3), bool)}, "no present element"),
        ({"x": np.zeros((2, 3, 2), dtype=np.int64)}, "floating point"),
        ({"x": np.array([np.zeros((3, 2)), np.zeros((4, 2))], dtype=object)},
         r"Python objects.*padded to \(M, N, D\) and a boolean mask"),
    ],
)
def test_malformed_npz_raises_a_one_line_data_error(tmp_path, arrays, message):
    path = _write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=message) as err:
        load_npz(path)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"{path}: ")  # the file, not only its stem


def test_values_finite_in_the_file_but_not_in_float32_are_named_as_such(tmp_path):
    x = np.random.default_rng(0).normal(size=(3, 4, 2)) * 1e40  # float64, finite
    with pytest.raises(DataError, match=r"too large for torch.float32 \(\|x\| up to"):
        load_npz(_write(tmp_path / "huge.npz", x=x))
    assert torch.isfinite(load_npz(_write(tmp_path / "ok.npz", x=x / 1e10)).x).all()


def test_big_endian_and_extended_precision_arrays_are_read_as_their_values(tmp_path):
    # torch reads neither a byte order other than the machine's nor numpy's long double: both
    # are converted, and a long double beyond float64's range is refused by its own value
    x = np.random.default_rng(0).normal(size=(4, 3, 2))
    expected = torch.from_numpy(x).float()
    for dtype in (">f4", ">f8", np.longdouble):
        data = load_npz(_write(tmp_path / "x.npz", x=x.astype(dtype)))
        assert data.x.dtype == torch.float32
        assert torch.allclose(data.x, expected, rtol=1e-6, atol=0), dtype
    if np.finfo(np.longdouble).max > np.finfo(np.float64).max:  # not where it is float64
        huge = x.astype(np.longdouble)
        huge[0, 0, 0] = np.longdouble("1e400")
        with pytest.raises(DataError, match=r"\(\|x\| up to 1.00e\+400\)"):
            load_npz(_write(tmp_path / "huge.npz", x=huge))


def test_missing_or_corrupt_file_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_npz(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK not a zip")
    with pytest.raises(DataError, match="not a readable"):
        load_npz(tmp_path / "junk.npz")


def test_files_that_are_not_npz_archives_are_named_by_what_they_are(tmp_path):
    # a .npy file gave "'numpy.ndarray' object does not support the context manager
    # protocol", a text file numpy's advice to load pickled data unsafely
    np.save(tmp_path / "x.npy", np.ones((2, 3, 2)))
    with pytest.raises(DataError, match=r"x.npy is a .npy file \(one array\), not an .npz "
                       r"archive: save the sets with numpy.savez\(path, x=x\)"):
        load_npz(tmp_path / "x.npy")
    (tmp_path / "text.npz").write_text("1 2 3\n")
    with pytest.raises(DataError, match=r"text.npz is not an .npz archive \(numpy.savez writes "
                       r"a zip file; this one starts with b'1 2 3\\n'\)"):
        load_npz(tmp_path / "text.npz")
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(DataError, match="empty.npz is not an .npz archive .*this one is empty"):
        load_npz(tmp_path / "empty.npz")
    (tmp_path / "folder.npz").mkdir()
    with pytest.raises(DataError, match="cannot read .*folder.npz: Is a directory"):
        load_npz(tmp_path / "folder.npz")


def test_a_file_of_one_set_or_an_empty_name_is_refused_for_fitting(tmp_path):
    path = _write(tmp_path / "one.npz", x=np.ones((1, 3, 2)))
    assert len(load_npz(path)) == 1  # it can be scored
    with pytest.raises(DataError, match=f"{path} holds 1 set: fitting needs at least 2"):
        load_dataset(str(path))
    with pytest.raises(DataError, match="data is empty: give a built-in data set or a .npz"):
        load_dataset("")


def test_nan_in_padding_is_allowed_and_zeroed(tmp_path):
    x = np.ones((2, 3, 2))
    x[0, 2] = np.nan
    mask = np.array([[True, True, False], [True, True, True]])
    data = load_npz(_write(tmp_path / "p.npz", x=x, mask=mask))
    assert torch.isfinite(data.x).all() and (data.x[0, 2] == 0).all()


def test_unknown_dataset_name_lists_the_known_ones():
    with pytest.raises(DataError, match="dw4"):
        load_dataset("dw5")


def test_npz_path_is_split_into_train_and_validation(tmp_path):
    save_npz(tmp_path / "s.npz", torch.randn(50, 4, 3))
    splits = load_dataset(str(tmp_path / "s.npz"))
    assert len(splits["train"]) == 45 and len(splits["val"]) == 5


def test_set_data_rejects_inconsistent_arrays():
    with pytest.raises(DataError, match="mask must have shape"):
        SetData(torch.zeros(2, 3, 1), torch.ones(3, 2, dtype=torch.bool))


# ----------------------------------------------------------------------------- particles


def _random_rotation(dim, g):
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@pytest.mark.parametrize("energy,n,dim", [(dw4_energy, 4, 2), (lj13_energy, 13, 3),
                                          (lj55_energy, 55, 3)])
def test_energies_are_invariant_to_rotation_translation_and_permutation(energy, n, dim):
    g = torch.Generator().manual_seed(5)
    x = 2 * torch.randn(3, n, dim, generator=g, dtype=torch.float64)
    e = energy(x)
    rot = _random_rotation(dim, g)
    shift = torch.randn(1, 1, dim, generator=g, dtype=torch.float64)
    perm = torch.randperm(n, generator=g)
    torch.testing.assert_close(energy(x @ rot.T + shift), e)
    torch.testing.assert_close(energy(x[:, perm]), e)


def test_dw4_pair_energy_has_its_minima_at_the_double_well():
    # 0.9 u^4 - 4 u^2 is minimal at u^2 = 4 / 1.8, value -4^2 / (4 * 0.9)
    u = math.sqrt(4 / 1.8)
    x = torch.tensor([[[0.0, 0.0], [4 + u, 0.0]]], dtype=torch.float64)
    assert math.isclose(dw4_energy(x).item(), -16 / 3.6, rel_tol=1e-12)


def test_lj13_pair_minimum_is_at_unit_distance():
    def pair(r):
        x = torch.zeros(1, 2, 3, dtype=torch.float64)
        x[0, 1, 0] = r
        return lj13_energy(x).item() - 0.5 * 2 * (r / 2) ** 2

    assert math.isclose(pair(1.0), -2.0, rel_tol=1e-12)
    assert pair(0.98) > pair(1.0) and pair(1.02) > pair(1.0)


def test_metropolis_reproduces_the_dw4_equilibrium_mean_energy():
    system = PARTICLE_SYSTEMS["dw4"]
    x, stats = metropolis(system, 6000, chains=300, generator=torch.Generator().manual_seed(6))
    assert x.shape == (6000, 4, 2)
    torch.testing.assert_close(x.sum(1), torch.zeros(6000, 2, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    energy = dw4_energy(x)
    assert abs(energy.mean().item() - system.mean_energy) < 0.25, energy.mean().item()
    assert 0.2 < stats["acceptance"] < 0.5


def test_lj55_energy_is_the_pair_sum_written_out():
    g = torch.Generator().manual_seed(7)
    x = 1.5 * torch.randn(2, 55, 3, generator=g, dtype=torch.float64)
    expected = []
    for config in x:
        total = 0.0
        for i in range(55):
            for j in range(i + 1, 55):
                r = (config[i] - config[j]).norm().item()
                total += 2.0 * (r ** -12 - 2.0 * r ** -6)
        centred = config - config.mean(0)
        expected.append(total + 0.5 * centred.pow(2).sum().item())
    torch.testing.assert_close(lj55_energy(x), torch.tensor(expected, dtype=torch.float64))


def _three_particle_cluster(moves: str, chains: int) -> ParticleSystem:
    return dataclasses.replace(PARTICLE_SYSTEMS["lj13"], particles=3, burn_in=300, thin=5,
                               moves=moves, chains=chains, initial_step=0.1)


def test_one_particle_moves_sample_the_same_density_as_joint_moves():
    # A 3-particle Lennard-Jones cluster (6 degrees of freedom) sampled both ways: the mean
    # energy and the mean squared radius agree within their errors (one batch per chain).
    # Without recentring or without the harmonic term in a move's energy change they do not.
    def statistics(moves):
        system = _three_particle_cluster(moves, 400)
        x, stats = metropolis(system, 40_000, generator=torch.Generator().manual_seed(8))
        assert 0.2 < stats["acceptance"] < 0.5
        assert x.sum(1).abs().max() < 1e-12  # zero centre of mass
        values = torch.stack([lj13_energy(x), x.pow(2).sum((1, 2))], -1).reshape(400, -1, 2)
        per_chain = values.mean(1)
        return per_chain.mean(0), per_chain.std(0) / math.sqrt(400)

    joint, joint_error = statistics("all")
    single, single_error = statistics("particle")
    z = (joint - single).abs() / torch.hypot(joint_error, single_error)
    assert (z < 4).all(), (joint, single, z)


def test_one_particle_moves_are_refused_without_a_pair_energy():
    system = dataclasses.replace(PARTICLE_SYSTEMS["dw4"], moves="particle")
    with pytest.raises(InputError, match="pair energy"):
        metropolis(system, 4, chains=2)


def test_lj55_samples_are_zero_centred_configurations_of_55_particles():
    system = dataclasses.replace(PARTICLE_SYSTEMS["lj55"], burn_in=5, thin=1)
    assert system.moves == "particle" and system.chains == 100
    x, stats = metropolis(system, 20, generator=torch.Generator().manual_seed(9))
    assert x.shape == (20, 55, 3) and x.dtype == torch.float64
    assert x.sum(1).abs().max() < 1e-11 and torch.isfinite(lj55_energy(x)).all()
    assert 0 < stats["acceptance"] < 1


def test_cache_keys_of_dw4_and_lj13_are_those_of_earlier_versions(tmp_path):
    # the sampler settings added later (moves, chains) must not move existing caches
    for name, count, key in (("dw4", 64, "4afd57ec671a"), ("lj13", 32, "715cb57ba711")):
        (tmp_path / f"{name}-train-{count}-{key}.npz").parent.mkdir(exist_ok=True)
        save_npz(tmp_path / f"{name}-train-{count}-{key}.npz",
                 torch.zeros(count, PARTICLE_SYSTEMS[name].particles,
                             PARTICLE_SYSTEMS[name].dim))
        data = particle_data(name, {"train": count}, seed=1, cache_dir=tmp_path, chains=10)
        assert data["train"].meta["cache"].endswith(f"-{key}.npz")  # found, not sampled
        assert data["train"].x.abs().max() == 0


def test_particle_data_is_cached_and_zero_centred(tmp_path):
    sizes = {"train": 50, "test": 20}
    first = particle_data("dw4", sizes, seed=1, cache_dir=tmp_path, chains=10)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2
    second = particle_data("dw4", sizes, seed=1, cache_dir=tmp_path, chains=10)
    torch.testing.assert_close(first["train"].x, second["train"].x)
    assert first["train"].zero_com and not torch.equal(first["train"].x[:20],
                                                       first["test"].x)
    assert first["test"].x.sum(1).abs().max() < 1e-5


def test_split_sizes_must_be_positive_integers_of_splits_the_data_set_has():
    for sizes, match in (({"train": 0}, "train split must be an integer >= 1, got 0"),
                         ({"train": -3}, "got -3"), ({"train": 2.5}, "got 2.5"),
                         ({"tran": 10}, r"splits \['tran'\] that 'gaussian-sets' does not have")):
        with pytest.raises(InputError, match=match):
            load_dataset("gaussian-sets", sizes)
    with pytest.raises(InputError, match="min_size=5 exceeds max_size=3"):
        cluster_sets(5, min_size=5, max_size=3)
    with pytest.raises(InputError, match="clusters must be an integer >= 1"):
        cluster_sets(5, clusters=0)
    with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
        next(cluster_sets(5).batches(0))


def test_padding_may_hold_nan_and_the_exact_densities_ignore_it():
    x = torch.randn(2, 3, 2)
    mask = torch.tensor([[True, True, False]] * 2)
    clean = SetData(x.clone(), mask, true_log_prob=lambda a, m: cluster_sets_log_prob(
        a, m, 4, 3.0, 0.5))
    x[:, 2] = float("nan")
    padded = dataclasses.replace(clean, x=x)
    assert padded.mean_true_nll() == clean.mean_true_nll()  # it was NaN
    assert torch.equal(padded.x[:, 2], torch.zeros(2, 2))


def test_a_normaliser_lost_to_cancellation_is_refused_and_so_is_an_endless_sampler():
    # the alternating sum over 2^15 graphs came out negative (a math domain error), or at
    # 1e-13 where Monte Carlo gives 1e-28, and the sampler then never returned
    for length in (2.5, 3.0, 4.0):
        with pytest.raises(InputError, match="lost to cancellation"):
            repulsive_log_normaliser(6, 1, 1.0, length, 1.0)
    assert math.isfinite(repulsive_log_normaliser(6, 1, 1.0, 0.4, 1.0))  # the defaults
    with pytest.raises(InputError, match="would take about .* proposals"):
        repulsive_sets(10**5, length=1.0)
