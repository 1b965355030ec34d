"""Choice of attention kernel: fused for speed, or one that can be differentiated twice."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["twice_differentiable"]


def twice_differentiable() -> AbstractContextManager:
    """Context in which every attention module can be differentiated twice.

    The fused CPU kernels of :func:`torch.nn.functional.scaled_dot_product_attention` have no
    double backward. Anything that differentiates a derivative -- the Jacobian-norm optimisation
    of :func:`flowattn.lipschitz.lipschitz_lower_bound`, training through Hutchinson log-det
    estimators or CNF divergences -- runs the attention under this context, which selects
    PyTorch's composite ("math") backend: the same function, built from differentiable ops.

    Examples:
        >>> from flowattn.attention import L2MHA
        >>> attn = L2MHA(8, 2)
        >>> x = torch.randn(1, 3, 8, requires_grad=True)
        >>> with twice_differentiable():
        ...     (g,) = torch.autograd.grad(attn(x).sum(), x, create_graph=True)
        ...     g.sum().backward()
    """
    return sdpa_kernel([SDPBackend.MATH])
