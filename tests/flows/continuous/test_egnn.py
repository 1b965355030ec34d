"""EGNNField: E(n) equivariance, padding, the centre of mass, the displacement bound, and a CNF
built on it (invariant density, round trip, exact likelihood in evaluation mode)."""

import math

import pytest
import torch

from flowattn.flows import CNF, EGNNField


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def field(zero_com=True, scale=1.0, **kwargs):
    """A float64 field with its near-zero output layers enlarged, so that it moves elements."""
    torch.manual_seed(0)
    f = EGNNField(2, hidden=8, layers=2, zero_com=zero_com, **kwargs).double()
    with torch.no_grad():
        for layer in f.layers:
            layer.displacement[-1].weight.normal_(0.0, scale)
    return f


def orthogonal(dim, seed):
    q, _ = torch.linalg.qr(randn(dim, dim, seed=seed))
    return q


@pytest.mark.parametrize("zero_com", [True, False])
def test_field_commutes_with_rotations_reflections_translations_and_permutations(zero_com):
    f, z = field(zero_com), randn(3, 5, 2)
    q = orthogonal(2, seed=2)
    reflect = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
    perm = torch.tensor([3, 0, 4, 1, 2])
    t = torch.tensor(0.3, dtype=torch.float64)
    out = f(t, z)
    assert out.abs().max() > 1e-2  # the test is not vacuous
    torch.testing.assert_close(f(t, z @ q.T), out @ q.T)
    torch.testing.assert_close(f(t, z @ reflect), out @ reflect)
    torch.testing.assert_close(f(t, z + randn(1, 1, 2, seed=3)), out)
    torch.testing.assert_close(f(t, z[:, perm]), out[:, perm])


def test_field_depends_on_time():
    f, z = field(), randn(2, 4, 2)
    assert (f(0.0, z) - f(1.0, z)).abs().max() > 1e-3


def test_zero_com_output_has_zero_centre_of_mass():
    f = field(zero_com=True)
    total = f(0.5, randn(4, 6, 2)).sum(1)
    torch.testing.assert_close(total, torch.zeros(4, 2, dtype=torch.float64))


def test_padded_set_moves_like_the_set_alone_and_padding_stays_put():
    f = field()
    z = randn(2, 5, 2)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    padded = f(0.4, z, mask)
    alone = f(0.4, z[:1, :3])
    torch.testing.assert_close(padded[:1, :3], alone)
    assert padded[0, 3:].abs().max() == 0


def test_each_element_moves_at_most_coords_range_per_neighbour():
    # |(x_i - x_j) / (|x_i - x_j| + 1)| < 1 and |c tanh| <= c = coords_range / L per layer
    f = field(zero_com=False, scale=50.0, coords_range=2.0)
    z = 5 * randn(64, 6, 2)
    speed = f(0.5, z).norm(dim=-1)
    assert speed.max() <= 2.0 * 5  # coords_range (n - 1)
    assert speed.max() > 0.5 * 2.0  # the large weights saturate the tanh: the bound is relevant


def test_first_message_map_equals_the_linear_map_of_the_concatenated_pair_features():
    # the layer never forms [h_i, h_j, |x_i - x_j|^2, |z_i - z_j|^2]; the literal map does
    f = field()
    layer = f.layers[0]
    h = randn(3, 5, 8, seed=4).requires_grad_()
    dist_sq, start_sq = randn(3, 5, 5, 1, seed=5).square(), randn(3, 5, 5, 1, seed=6).square()
    n = h.shape[1]
    pairs = torch.cat([h[:, :, None].expand(-1, -1, n, -1), h[:, None].expand(-1, n, -1, -1),
                       dist_sq, start_sq], dim=-1)
    literal = layer.message[0](pairs)
    split = layer._first_message_layer(h, dist_sq, start_sq)
    torch.testing.assert_close(split, literal, rtol=1e-12, atol=1e-12)
    probe = randn(*literal.shape, seed=7)
    grads = torch.autograd.grad((literal * probe).sum(), [h, layer.message[0].weight])
    split_grads = torch.autograd.grad((split * probe).sum(), [h, layer.message[0].weight])
    for got, want in zip(split_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("times", ["one", "per set"])
def test_passes_of_a_few_sets_give_the_field_and_gradients_of_one_pass(monkeypatch, times):
    from flowattn import passes

    f, z = field(), randn(5, 6, 2, seed=8)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1, 4:] = mask[4, 2:] = False
    t = torch.tensor(0.4, dtype=torch.float64) if times == "one" else randn(5, seed=9).abs()

    def run():
        z_ = z.clone().requires_grad_()
        out = f(t, z_, mask)
        loss = (out * randn(*out.shape, seed=10)).sum()
        inputs = [z_, *f.parameters()]  # the last layer's feature update is unused
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        pairs = zip(inputs, grads, strict=True)
        return out, [torch.zeros_like(x) if g is None else g for x, g in pairs]

    whole, whole_grads = run()
    pair_bytes = 6 * 6 * 8 * 8  # one set of N = 6, H = 8 in float64
    monkeypatch.setattr(passes, "PAIR_BYTES", 2 * pair_bytes)
    assert f._chunk(z) == 2  # passes of 2, 2 and 1 sets
    chunked, chunked_grads = run()
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    for got, want in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(passes, "PAIR_BYTES", 1)
    assert f._chunk(z) == 1  # at least one set a pass


def test_starts_near_the_identity():
    f = EGNNField(2).double()
    assert f(0.5, randn(8, 4, 2)).abs().max() < 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dim": 0}, "dim"), ({"dim": 2, "hidden": 0}, "hidden"),
     ({"dim": 2, "layers": 1.5}, "layers"), ({"dim": 2, "coords_range": -1.0}, "coords_range"),
     ({"dim": 2, "eps": 0.0}, "eps")],
)
def test_bad_settings_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EGNNField(**kwargs)


def test_wrong_feature_dimension_is_an_error():
    with pytest.raises(ValueError, match="z"):
        field()(0.0, randn(2, 4, 3))


def cnf(**kwargs):
    return CNF(field(scale=0.3), atol=1e-8, rtol=1e-8, **kwargs)


def centred(x):
    return x - x.mean(1, keepdim=True)


def test_cnf_density_is_invariant_under_rotations_and_permutations():
    flow = cnf().eval()
    x = centred(randn(3, 4, 2))
    base = flow(x)[1]
    q = orthogonal(2, seed=5)
    torch.testing.assert_close(flow(x @ q.T)[1], base, atol=1e-7, rtol=1e-7)
    torch.testing.assert_close(flow(x[:, [2, 0, 3, 1]])[1], base, atol=1e-7, rtol=1e-7)


def test_cnf_round_trip_and_exact_logdet_equals_logdet_of_the_flow_map():
    flow = cnf().eval()
    x = centred(randn(2, 3, 2))
    z, logdet = flow(x)
    assert logdet.abs().min() > 1e-2  # the flow is not the identity
    x_back, inverse_logdet = flow.inverse(z)
    torch.testing.assert_close(x_back, x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(inverse_logdet, -logdet, atol=1e-6, rtol=1e-6)
    # log|det dz/dx| on the zero-centre-of-mass subspace, from the Jacobian of the solved map in
    # an orthonormal basis of that subspace
    basis = torch.linalg.qr(torch.eye(3, dtype=torch.float64) - 1 / 3)[0][:, :2]  # (3, 2)

    def flow_map(u):  # coordinates (2, 2) on the subspace -> the same coordinates of z
        return basis.T @ flow((basis @ u.reshape(2, 2))[None])[0][0]

    for b in range(2):
        u = (basis.T @ x[b]).reshape(-1)
        jac = torch.autograd.functional.jacobian(lambda v: flow_map(v).reshape(-1), u)
        assert math.isclose(torch.linalg.slogdet(jac)[1].item(), logdet[b].item(), abs_tol=1e-5)


def test_hutchinson_training_and_exact_evaluation():
    exact = cnf(divergence="exact")
    mixed = cnf(divergence="hutchinson", eval_divergence="exact",
                generator=torch.Generator().manual_seed(0))
    mixed.load_state_dict(exact.state_dict())
    x = centred(randn(4, 3, 2))
    exact.eval(), mixed.eval()
    torch.testing.assert_close(mixed(x)[1], exact(x)[1])  # evaluation: the exact trace
    mixed.train()
    assert (mixed(x)[1] - exact.eval()(x)[1]).abs().max() > 1e-6  # training: a probe


def test_cnf_rejects_an_unknown_eval_divergence():
    with pytest.raises(ValueError, match="eval_divergence"):
        CNF(field(), eval_divergence="trace")
