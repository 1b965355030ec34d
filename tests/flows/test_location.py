"""SetLocation: exact log-det (determinant lemma), exact inverse, equivariance, masks, errors."""

import pytest
import torch

from flowattn.data import load_dataset
from flowattn.flows import SetLocation, set_flow
from flowattn.flows.layers import size_features
from flowattn.lipschitz import jacobian


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def make(dim=2, seed=0):
    """A SetLocation whose centroid map is far from the identity (random spline parameters)."""
    torch.manual_seed(seed)
    layer = SetLocation(dim, layers=2, hidden=8, bins=4).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer.eval()


def masked(x, sizes):
    mask = torch.arange(x.shape[1])[None] < torch.tensor(sizes)[:, None]
    return x * mask[..., None], mask


def test_logdet_equals_brute_force_jacobian_with_padding():
    layer = make()
    x, mask = masked(randn(3, 5, 2) + 1.0, [5, 3, 2])
    y, logdet = layer(x, context=mask)
    for b in range(3):
        n = int(mask[b].sum())

        def f(z, b=b, n=n):
            full = x[b : b + 1].clone()
            full[0, :n] = z
            return layer(full, context=mask[b : b + 1])[0][0, :n]

        jac = jacobian(f, x[b, :n])
        exact = torch.linalg.slogdet(jac.reshape(n * 2, n * 2))[1]
        assert abs(exact - logdet[b]) < 1e-10
    # the map changes where the centroid is, not how the elements spread around it
    def centred(z):
        return z - (z * mask[..., None]).sum(1, keepdim=True) / mask.sum(1)[:, None, None]

    torch.testing.assert_close(centred(y) * mask[..., None], centred(x) * mask[..., None])
    torch.testing.assert_close(y[~mask], x[~mask])


def test_map_is_not_a_translation():
    layer = make()
    x = randn(1, 4, 2)
    shifts = [layer(x + t)[0] - (x + t) for t in (0.0, 2.0)]
    assert (shifts[0] - shifts[1]).abs().max() > 1e-2


def test_inverse_round_trips_and_negates_logdet():
    layer = make(dim=3)
    x, mask = masked(randn(6, 7, 3), [7, 1, 4, 2, 7, 5])
    y, logdet = layer(x, context=mask)
    x_back, inv_logdet = layer.inverse(y, context=mask)
    torch.testing.assert_close(x_back, x, rtol=0, atol=1e-10)
    torch.testing.assert_close(inv_logdet, -logdet)


def test_permutation_equivariant():
    layer = make()
    x = randn(4, 6, 2)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    y, logdet = layer(x)
    y_perm, logdet_perm = layer(x[:, perm])
    torch.testing.assert_close(y_perm, y[:, perm])
    torch.testing.assert_close(logdet_perm, logdet)


def test_size_features_and_errors():
    torch.testing.assert_close(size_features(torch.tensor([4.0])), torch.tensor([[0.5, 1.3863]]),
                               atol=1e-4, rtol=0)
    layer = make()
    x, mask = masked(randn(2, 3, 2), [3, 0])
    with pytest.raises(ValueError, match="empty"):
        layer(x, context=mask)
    with pytest.raises(ValueError, match="positive"):
        SetLocation(2, layers=0)
    with pytest.raises(ValueError, match="zero_com"):
        set_flow(2, blocks=1, heads=1, zero_com=True, location=True)


def test_learns_a_multimodal_location_that_attention_cannot():
    """Sets around one of four centres: a location flow fitted alone beats the best any
    translation-affine map can do (a single Gaussian for the centroid) by a wide margin."""
    torch.manual_seed(0)
    data = load_dataset("cluster-sets", {"train": 2000, "val": 200, "test": 200}, seed=0)
    train = data["train"]
    x, mask = train.x.double(), train.mask
    n = mask.sum(1).double()
    centre = (x * mask[..., None]).sum(1) / n[:, None]
    layer = SetLocation(2, layers=2, hidden=32).double()
    layer(x[:256], context=mask[:256])  # data-dependent ActNorm initialisation
    opt = torch.optim.Adam(layer.parameters(), lr=5e-3)

    def centroid_nll(z_centre, logdet, n):
        # the centroid of n standard normal elements is N(0, I / n)
        return (0.5 * n[:, None] * z_centre**2).sum(1) - torch.log(n) + 1.8379 - logdet

    for _ in range(300):
        idx = torch.randint(len(x), (256,))
        y, logdet = layer(x[idx], context=mask[idx])
        z_centre = (y * mask[idx][..., None]).sum(1) / n[idx][:, None]
        loss = centroid_nll(z_centre, logdet, n[idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        y, logdet = layer(x, context=mask)
        z_centre = (y * mask[..., None]).sum(1) / n[:, None]
        fitted = centroid_nll(z_centre, logdet, n).mean()
        # best Gaussian for the centroid, with the exact 1/n scaling of its covariance
        scaled = centre * n.sqrt()[:, None]
        cov = torch.cov(scaled.T)
        gaussian = (0.5 * torch.logdet(2 * torch.pi * torch.e * cov) - torch.log(n).mean()).item()
    assert fitted < gaussian - 2.0  # the four modes are worth about 3 nats per set


def test_initialisation_keeps_the_flag_buffer_in_place():
    """The initialised flag is written in place, so it stays on the module's device (a new
    tensor would land on the CPU under a module moved to a GPU)."""
    loc = SetLocation(2)
    first = loc.centroid_flow._transforms[0]
    storage = first.initialized.data_ptr()
    loc.initialise(3 + torch.randn(16, 5, 2))
    assert first.initialized.data_ptr() == storage and bool(first.initialized)
