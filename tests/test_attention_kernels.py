"""flowattn.attention.kernels: the fused kernel, differentiable to any order without a setting."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowattn.attention import (
    L2MHA,
    ContractiveL2MHA,
    DotProductMHA,
    ScaledCosineMHA,
    cosine,
    dot_product,
    l2,
)
from flowattn.attention.kernels import _FusedAttention, attend, composite_attention

DIM, HEADS = 4, 2
MODULES = [
    (DotProductMHA, {}),
    (L2MHA, {}),
    (L2MHA, {"tied": False}),
    (ContractiveL2MHA, {}),
    (ScaledCosineMHA, {}),
]
NAMES = ["dp", "l2", "l2-untied", "contractive", "cosine"]
CASES = pytest.mark.parametrize("causal,masked", [(False, False), (True, False), (False, True),
                                                  (True, True)])


def make(cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(DIM, HEADS, **kwargs).double()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def padding(masked):
    return torch.tensor([[True, True, False], [True, True, True]]) if masked else None


@pytest.fixture
def kernel(monkeypatch):
    """Replace the kernel every module calls: ``kernel(fn)`` (the modules look it up by name)."""

    def use(fn):
        for namespace in (dot_product, l2, cosine):
            monkeypatch.setattr(namespace, "attend", fn)

    return use


def penalty_gradients(module, x, mask, causal, how):
    """Gradients, in x and every parameter, of a Jacobian penalty ||J||^2 (or ||J^T w||^2)."""
    xg = x.clone().requires_grad_()
    weights = randn(*x.shape, seed=9)
    if how == "grad":
        (g,) = torch.autograd.grad((module(xg, mask, causal) * weights).sum(), xg,
                                   create_graph=True)
        penalty = g.pow(2).sum()
    else:
        jac = torch.autograd.functional.jacobian(lambda z: module(z, mask, causal), xg,
                                                 create_graph=True)
        penalty = jac.pow(2).sum()
    return torch.autograd.grad(penalty, [xg, *module.parameters()], materialize_grads=True)


# ----------------------------------------------------------------------------- second derivatives


@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
@CASES
def test_every_module_passes_gradcheck_and_gradgradcheck_without_a_context(
    cls, kwargs, causal, masked
):
    module = make(cls, **kwargs)
    x = randn(2, 3, DIM, seed=1).requires_grad_()
    mask = padding(masked)

    def f(z):
        return module(z, mask, causal)

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
@pytest.mark.parametrize("how", ["grad", "jacobian"])
@CASES
def test_second_derivatives_equal_those_of_the_composite_path(
    cls, kwargs, how, causal, masked, kernel
):
    module = make(cls, seed=2, **kwargs)
    x, mask = randn(2, 3, DIM, seed=2) * 2, padding(masked)
    fused = penalty_gradients(module, x, mask, causal, how)
    kernel(composite_attention)  # PyTorch's kernels out of the way: the plain formula
    reference = penalty_gradients(module, x, mask, causal, how)
    for a, b in zip(fused, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    if cls is L2MHA:  # and the literal formulas of the reference path
        module.fused = False
        literal = penalty_gradients(module, x, mask, causal, how)
        for a, b in zip(fused, literal, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # inside torch.func
@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_func_jacrev_and_hessian_agree_with_finite_differences(cls, kwargs, causal):
    module = make(cls, seed=3, **kwargs)
    x = randn(1, 3, DIM, seed=3)
    weights = randn(1, 3, DIM, seed=4)

    def f(z):
        return module(z, None, causal)

    def s(z):
        return (f(z) * weights).sum()

    def gradient(z):  # first order, through the fused kernel
        z = z.clone().requires_grad_()
        return torch.autograd.grad(s(z), z)[0]

    jac = torch.func.jacrev(f)(x).reshape(x.numel(), x.numel())
    hess = torch.func.hessian(s)(x).reshape(x.numel(), x.numel())
    h = 1e-6
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[i] = h
        e = e.reshape(x.shape)
        fd_jac = ((f(x + e) - f(x - e)) / (2 * h)).flatten()
        fd_hess = ((gradient(x + e) - gradient(x - e)) / (2 * h)).flatten()
        torch.testing.assert_close(jac[:, i], fd_jac, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(hess[:, i], fd_hess, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hess, hess.t(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
def test_forward_mode_derivatives_agree_with_finite_differences(cls, kwargs):
    module = make(cls, seed=5, **kwargs)
    x, tangent, mask = randn(2, 3, DIM, seed=5), randn(2, 3, DIM, seed=6), padding(True)
    with forward_ad.dual_level():
        jvp = forward_ad.unpack_dual(module(forward_ad.make_dual(x, tangent), mask)).tangent
    h = 1e-6
    fd = (module(x + h * tangent, mask) - module(x - h * tangent, mask)) / (2 * h)
    torch.testing.assert_close(jvp, fd, rtol=1e-6, atol=1e-8)


def test_attention_dropout_in_training_is_twice_differentiable():
    module = make(L2MHA, seed=7, dropout=0.3).train()
    x = randn(2, 5, DIM, seed=7).requires_grad_()
    (g,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
    assert torch.isfinite(gg).all() and gg.abs().sum() > 0


# ----------------------------------------------------------------------------- first order


@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@CASES
def test_first_order_is_the_fused_kernel_bit_for_bit(cls, kwargs, dtype, causal, masked, kernel):
    module = make(cls, seed=8, **kwargs).to(dtype)
    x, mask = randn(2, 3, DIM, seed=8).to(dtype), padding(masked)
    results = []
    for fn in (attend, F.scaled_dot_product_attention):
        kernel(fn)
        module.zero_grad()
        xg = x.clone().requires_grad_()
        y = module(xg, mask, causal)
        (y * randn(2, 3, DIM, seed=9).to(dtype)).sum().backward()
        results.append([y, xg.grad, *(p.grad for p in module.parameters())])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direct", [True, False])
def test_retain_graph_is_honoured_and_the_kernel_buffers_are_freed(direct):
    # direct: the CPU kernel's operators called by attend; otherwise (other devices' fused
    # kernels, exercised here on the CPU one) SDPA runs with its own graph inside the forward
    q, k, v = (randn(1, 2, 5, 3, seed=s).requires_grad_() for s in range(3))
    y = _FusedAttention.apply(q, k, v, None, False, None, direct)
    assert (y.grad_fn.fused is None) == direct
    first = torch.autograd.grad(y.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(y.sum(), (q, k, v))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    reference = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
    for a, b in zip(first, reference, strict=True):
        assert torch.equal(a, b)
    assert y.grad_fn.fused is None  # the kernel's own graph, released with the backward
    with pytest.raises(RuntimeError, match="freed"):
        torch.autograd.grad(y.sum(), (q, k, v))


@pytest.mark.parametrize("direct", [True, False])
def test_both_ways_of_running_the_fused_kernel_are_twice_differentiable(direct):
    q, k, v = (randn(2, 2, 4, 3, seed=s).requires_grad_() for s in range(3))
    mask = torch.tensor([True, True, True, False]).expand(4, 4) | torch.eye(4, dtype=torch.bool)

    def f(q, k, v):
        return _FusedAttention.apply(q, k, v, mask, False, 0.7, direct)

    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_the_math_kernel_is_left_to_pytorch():
    q = randn(1, 2, 5, 3).requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        y = attend(q, q, q)
    assert not hasattr(y.grad_fn, "fused")  # SDPA's composite kernel, twice differentiable
    (g,) = torch.autograd.grad(y.sum(), q, create_graph=True)
    assert torch.autograd.grad(g.pow(2).sum(), q)[0].shape == q.shape


def test_without_gradients_the_kernel_is_pytorchs_own():
    q = randn(1, 2, 5, 3).requires_grad_()
    with torch.no_grad():
        y = attend(q, q, q)
    assert y.grad_fn is None
    torch.testing.assert_close(attend(q.detach(), q.detach(), q.detach()), y, rtol=0, atol=0)
    torch.testing.assert_close(composite_attention(q, q, q), y, rtol=0, atol=1e-14)


@pytest.mark.parametrize("cls,kwargs", MODULES, ids=NAMES)
@pytest.mark.parametrize("scale", [100.0, 1e4])
def test_gradients_stay_accurate_where_the_logits_are_large(cls, kwargs, scale, kernel):
    # The fused backward's error grows with the logits (direct SDPA, float32 against float64:
    # 2e-3 for dot-product attention at scale 100, 5e2 at 1e4, 6e13 for L2); above its bound
    # attend uses the composite VJP, whose float32 error is that of the float32 forward itself.
    def gradients(fn, dtype=torch.float32):
        kernel(fn)
        module = make(cls, seed=10, **kwargs).float().to(dtype)  # the same weights
        x = (randn(2, 16, DIM, seed=10) * scale).float().to(dtype).requires_grad_()
        (module(x) * randn(2, 16, DIM, seed=11).to(dtype)).sum().backward()
        return [x.grad, *(p.grad for p in module.parameters())]

    exact = gradients(composite_attention, torch.float64)

    def error(fn):
        grads = gradients(fn)
        return max(((a.double() - b).norm() / b.norm()).item()
                   for a, b in zip(grads, exact, strict=True) if b.norm() > 0)

    # as accurate as the composite formula, or within float32's rounding (the fused kernel
    # sums in another order: where it is used, with cosine's bounded logits, its error is
    # 1-3x the composite's, 20-45 eps, depending on the CPU's vector kernels)
    eps = torch.finfo(torch.float32).eps
    assert error(attend) <= max(1.5 * error(composite_attention), 100 * eps)
    if scale == 1e4 and cls is not ScaledCosineMHA:  # (cosine logits are at most tau)
        assert error(F.scaled_dot_product_attention) > 1.0
