"""Tracked spectral norms (power iteration between calls) and the modules that use them."""

import pytest
import torch

from flowattn.attention import ContractiveL2MHA
from flowattn.errors import InputError
from flowattn.lipschitz import (
    TrackedSpectralNorms,
    frozen_power_iteration,
    spectral_norm_exact,
)


def drifting(shape, steps, rate, seed=0):
    """A batch of matrices moving by ``rate`` (relative) per step, as a weight under an
    optimiser, with well separated top singular values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    w = u @ torch.diag_embed(s * torch.linspace(2.0, 1.0, s.shape[-1], dtype=s.dtype)) @ vh
    for _ in range(steps):
        yield w
        w = w + rate * w.norm() / w.numel() ** 0.5 * torch.randn(
            *shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (3, 8, 8), (2, 16, 5)])
def test_tracked_norms_start_exact_follow_a_drifting_matrix_and_never_exceed_it(shape):
    # four steps per call (the default) keep within 1e-6 here; without any update the estimate
    # falls 5e-4 to 2e-3 behind
    norms = TrackedSpectralNorms()
    for t, w in enumerate(drifting(shape, 60, rate=0.01)):
        tracked, exact = norms("w", w), spectral_norm_exact(w)
        if t == 0:
            assert torch.allclose(tracked, exact, rtol=1e-13, atol=0)
        assert (tracked <= exact * (1 + 1e-12)).all()  # a lower estimate
        assert (tracked >= exact * (1 - 1e-5)).all(), t  # close behind the moving target


def test_tracked_norm_gradient_is_that_of_the_largest_singular_value_once_converged():
    w = next(drifting((7, 5), 1, rate=0.0)).requires_grad_()
    norms = TrackedSpectralNorms()
    norms("w", w.detach() + 0.1)  # start elsewhere: the vector has to move to w's
    for _ in range(20):
        value = norms("w", w)
    (grad,) = torch.autograd.grad(value, w)
    u, _, vh = torch.linalg.svd(w.detach())
    assert torch.allclose(grad, u[:, :1] @ vh[:1], atol=1e-10)


def test_frozen_tracked_norms_keep_their_vectors():
    stream = drifting((5, 5), 3, rate=0.2)
    norms = TrackedSpectralNorms()
    norms("w", next(stream))
    before = norms.v_w.clone()
    w = next(stream)
    with frozen_power_iteration():
        value = norms("w", w)
    assert torch.equal(norms.v_w, before)
    assert torch.allclose(value, torch.linalg.vector_norm(w @ before))
    norms("w", w)
    assert not torch.equal(norms.v_w, before)


def test_tracked_norms_resume_from_their_state_dict_and_restart_without_one():
    stream = list(drifting((4, 6, 6), 6, rate=0.05))
    straight, first = TrackedSpectralNorms(), TrackedSpectralNorms()
    for w in stream[:3]:
        straight("a", w)
        first("a", w)
    resumed = TrackedSpectralNorms()
    resumed.load_state_dict(first.state_dict())  # strict: the vectors are created to load
    for w in stream[3:]:
        assert torch.equal(resumed("a", w), straight("a", w))
    # a state dict without vectors (saved before they existed) loads, and each norm restarts
    # from its exact value
    resumed.load_state_dict({})
    assert not resumed.state_dict()
    assert torch.allclose(resumed("a", stream[0]), spectral_norm_exact(stream[0]), rtol=1e-13)
    # a matrix of another shape under the same name restarts too
    other = stream[0][:, :4]
    assert torch.allclose(resumed("a", other), spectral_norm_exact(other), rtol=1e-13)
    with pytest.raises(InputError, match="steps must be >= 1"):
        TrackedSpectralNorms(steps=0)


def contractive_pair(**kw):
    torch.manual_seed(0)
    exact = ContractiveL2MHA(16, 4, norm="2,inf", self_offset=4.0, position_bias=4.0, **kw)
    tracked = ContractiveL2MHA(16, 4, norm="2,inf", self_offset=4.0, position_bias=4.0,
                               spectral_norms="tracked", **kw)
    tracked.load_state_dict(exact.state_dict(), strict=False)
    return exact.double(), tracked.double()


def test_tracked_contractive_attention_trains_like_the_exact_one_and_evaluates_exactly():
    exact, tracked = contractive_pair()
    x = torch.randn(3, 9, 16, dtype=torch.float64)
    assert torch.equal(tracked(x, causal=True), exact(x, causal=True))  # exact start
    optimiser = torch.optim.Adam(exact.parameters(), lr=1e-3)
    for _ in range(30):  # train the exact module; the tracked one follows its weights
        loss = exact(x, causal=True).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            for a, b in zip(exact.parameters(), tracked.parameters(), strict=True):
                b.copy_(a)
        y_exact, y_tracked = exact(x, causal=True), tracked(x, causal=True)
        # the tracked denominators err low: outputs at most a little larger (here by at most
        # 2e-5; 9e-2 if the vectors stayed where they started), never smaller
        ratio = (y_tracked.norm(dim=-1) / y_exact.norm(dim=-1)).flatten()
        assert ratio.min() >= 1 - 1e-12 and ratio.max() <= 1 + 1e-4
    assert sorted(k for k in tracked.state_dict() if k.startswith("norms.")) == [
        "norms.v_g_cat", "norms.v_g_pairs", "norms.v_m_cat", "norms.v_m_pairs", "norms.v_w_q"]
    exact.eval(), tracked.eval()
    assert torch.equal(tracked(x, causal=True), exact(x, causal=True))  # exact in evaluation
    assert torch.equal(tracked.attention.lipschitz_bound(9, "2,inf"),
                       exact.attention.lipschitz_bound(9, "2,inf"))


@pytest.mark.parametrize("norm", ["inf", 2])
def test_tracked_norms_in_every_norm_of_contractive_attention(norm):
    torch.manual_seed(1)
    exact = ContractiveL2MHA(8, 2, norm=norm).double()
    tracked = ContractiveL2MHA(8, 2, norm=norm, spectral_norms="tracked").double()
    tracked.load_state_dict(exact.state_dict(), strict=False)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    assert torch.allclose(tracked(x), exact(x), rtol=1e-12, atol=0)
    assert tracked.spectral_norms == "tracked" and exact.spectral_norms == "exact"


def test_spectral_norms_option_is_checked():
    with pytest.raises(InputError, match="spectral_norms must be one of"):
        ContractiveL2MHA(8, 2, spectral_norms="power")
