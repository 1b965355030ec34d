"""The attention kernel every module calls: fused for speed, differentiable any number of times.

:func:`attend` computes softmax(scale Q K^T) V (with a boolean or causal mask) like
:func:`torch.nn.functional.scaled_dot_product_attention`, and takes the same arguments. PyTorch's
fused kernels have no double backward and no forward-mode derivative, so on its own SDPA breaks
Jacobian penalties, ``jacobian(..., create_graph=True)`` followed by a backward,
``torch.func.jacrev`` / ``hessian`` and the log-det and divergence estimators of the flows.
:func:`attend` keeps the fused kernel where it is safe and nothing is lost:

* no gradient is being recorded, or SDPA would run its composite ("math") kernel anyway
  (which is differentiable to any order): SDPA itself, nothing else;
* gradients are recorded: the fused kernel inside a :class:`torch.autograd.Function` whose
  first-order backward is the fused kernel's own backward, and whose backward *with*
  ``create_graph=True`` (a derivative that will be differentiated again) recomputes the
  composite formula and differentiates it with PyTorch's own backward formulas, so it can be
  differentiated again, to any order. That composite backward also serves where the logits
  are so large that
  the fused backward would be inaccurate (see :func:`_fused_backward_is_accurate`): its error
  grows with the rows' log-sum-exp, the composite one's does not;
* under ``torch.compile``: the composite formula, which the compiler fuses, forward and
  backward (the choice of a kernel and the read-back that tests its backward's accuracy would
  each break the graph; the composite backward is accurate at any scale);
* under a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jacfwd``, ``hessian``),
  inside a forward-mode AD level (``torch.autograd.forward_ad``), or with attention dropout
  active: the composite formula itself, built from differentiable, batchable operations (the
  fused CPU kernel does no dropout either).

They give the same function; the tests hold the composite forward and backward to the
fused ones in float64, and the second derivatives to finite differences (``gradgradcheck``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend

__all__ = ["attend", "composite_attention"]


def _keep_graph() -> bool:
    """Whether the backward pass running now was asked to keep its graph (``retain_graph``)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


def _transformed() -> bool:
    """A ``torch.func`` transform or a forward-mode AD level is active."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def _probabilities(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float
) -> Tensor:
    logits = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        length, keys = q.shape[-2], k.shape[-2]
        causal = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
        attn_mask = causal if attn_mask is None else attn_mask & causal
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, -math.inf)
    return torch.softmax(logits, dim=-1)


def composite_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(scale Q K^T) V from differentiable operations: the reference for :func:`attend`.

    ``attn_mask`` is boolean, True where a query may attend to a key; ``dropout_p`` drops
    attention weights (inverted dropout). Arguments as in
    :func:`torch.nn.functional.scaled_dot_product_attention`.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = _probabilities(q, k, attn_mask, is_causal, scale)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    return p @ v


def _attention_vjp(q, k, v, grad, attn_mask, is_causal, scale, needs):
    """(dL/dq, dL/dk, dL/dv) of softmax(scale q k^T) v from dL/d(out): the composite formula
    recomputed and differentiated by autograd, with ``create_graph`` when the backward running
    now is itself being recorded -- PyTorch's own backward formulas, differentiable again."""
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        roles = [t.view_as(t) for t in (q, k, v)]  # one tensor per role, even if q is k
        out = composite_attention(*roles, attn_mask, 0.0, is_causal, scale)
    wanted = [t for t, need in zip(roles, needs, strict=True) if need]
    found = iter(torch.autograd.grad(out, wanted, grad, create_graph=create))
    return tuple(next(found) if need else None for need in needs)


def _fused_backward_is_accurate(lse: Tensor | None) -> bool:
    """Whether the fused backward of a kernel that saved the row log-sum-exps ``lse`` is
    accurate.

    PyTorch's fused backward rebuilds the attention matrix as exp(logit - lse) from the
    log-sum-exp lse of each row that its forward pass saved, and lse is rounded to the
    kernel's precision: the gradient's relative error is about max|lse| times the kernel's
    machine epsilon (float32 for float32, bfloat16 and float16 inputs). Above
    max|lse| = 2^-13 / epsilon (1024 in float32: errors up to about 1e-4) the composite
    vector-Jacobian product, exact to rounding at any scale, is used instead; NaN selects it
    too. A kernel that saves no log-sum-exp (PyTorch's composite one) is accurate already.
    """
    if lse is None:
        return True
    limit = _LSE_LIMIT_FLOAT64 if lse.dtype == torch.float64 else _LSE_LIMIT
    return bool(lse.abs().amax() <= limit)  # one read back (False for NaN)


_LSE_LIMIT = 2.0**-13 / torch.finfo(torch.float32).eps
_LSE_LIMIT_FLOAT64 = 2.0**-13 / torch.finfo(torch.float64).eps


_MATH, _FLASH = int(SDPBackend.MATH), int(SDPBackend.FLASH_ATTENTION)
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _FusedAttention(torch.autograd.Function):
    """Fused SDPA forward; fused first-order backward; differentiable backward when the
    backward itself is recorded (``create_graph=True``) or the fused one would be inaccurate.

    On the CPU the fused kernel's forward and backward operators are called directly, as SDPA
    calls them (the boolean mask made additive as SDPA makes it), so first-order results are
    SDPA's bit for bit. Any other kernel runs inside the forward with its own graph, on
    detached copies of q, k, v, and its backward is that graph's.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, direct):
        # direct: SDPA would pick its fused CPU kernel, whose operators are called here
        ctx.attn_mask, ctx.is_causal, ctx.scale_arg = attn_mask, is_causal, scale
        ctx.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        ctx.fused = None
        if direct:
            additive = None
            if attn_mask is not None:
                additive = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
                additive = additive.masked_fill(~attn_mask, -math.inf)
            out, lse = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=additive, scale=scale)
            ctx.additive = additive
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(
                *leaves, attn_mask=attn_mask, is_causal=is_causal, scale=scale
            )
        ctx.fused = (out, leaves)
        ctx.save_for_backward(q, k, v)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[:3]
        q, k, v, *saved = ctx.saved_tensors  # (raises if a backward already freed them)
        if ctx.fused is None:  # the CPU kernel, called directly
            out, lse = saved
        else:
            out, leaves = ctx.fused
            lse = getattr(out.grad_fn, "_saved_logsumexp", None)
        if (
            torch.is_grad_enabled()  # the backward is being differentiated
            or _transformed()
            or not _fused_backward_is_accurate(lse if isinstance(lse, Tensor) else None)
        ):
            grads = _attention_vjp(q, k, v, grad, ctx.attn_mask, ctx.is_causal, ctx.scale, needs)
        elif ctx.fused is None:
            grads = _FLASH_CPU_BACKWARD(
                grad, q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=ctx.additive,
                scale=ctx.scale_arg,
            )
            if not all(needs):
                grads = tuple(g if need else None for g, need in zip(grads, needs, strict=True))
        else:
            keep = _keep_graph()
            wanted = [t for t, need in zip(leaves, needs, strict=True) if need]
            found = iter(torch.autograd.grad(out, wanted, grad, retain_graph=keep))
            grads = tuple(next(found) if need else None for need in needs)
            if not keep:
                ctx.fused = None  # frees the kernel's saved tensors, as SDPA itself would
        return (*grads, None, None, None, None)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(scale Q K^T) V: the fused kernel, differentiable to any order.

    Arguments and result as in :func:`torch.nn.functional.scaled_dot_product_attention`
    (``attn_mask`` boolean, True where a query may attend to a key; ``scale`` defaults to
    1/sqrt(d)). The first-order forward and backward are those of the fused kernel; see the
    module's description for what runs when a derivative is differentiated.

    Examples:
        >>> q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
        >>> (g,) = torch.autograd.grad(attend(q, q, q).sum(), q, create_graph=True)
        >>> (h,) = torch.autograd.grad(g.pow(2).sum(), q)  # a second derivative
        >>> h.shape
        torch.Size([1, 2, 3, 4])
    """
    if dropout_p > 0.0 or _transformed():
        return composite_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
    if torch.compiler.is_compiling():  # the compiler fuses the composite formula itself
        return composite_attention(q, k, v, attn_mask, 0.0, is_causal, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        kernel = int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale))
        if kernel != _MATH:  # a fused kernel: no double backward of its own
            direct = kernel == _FLASH and q.device.type == "cpu"
            return _FusedAttention.apply(q, k, v, attn_mask, is_causal, scale, direct)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )
