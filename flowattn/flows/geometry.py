r"""The space a flow on sets works in: present elements, the admissible subspace, its probes.

A batch of sets or sequences has shape (B, N, D); a padding mask (bool (B, N), True = present)
says which elements exist, and in zero-centre-of-mass mode (particle systems) a set lives on
{sum_i x_i = 0}. P is the orthogonal projection onto the admissible coordinates: padded
elements zeroed and, with ``zero_com``, each set's centre of mass removed. Every flow here
restricts its maps to the range of P, so log-determinants, divergences and inverses are those
of the restricted map. This module holds the pieces they share:

* :func:`mask_from_context` -- the mask, carried by nflows' ``context`` argument, and
  :func:`checked_inputs` -- a transform's inputs checked and its mask;
* :func:`subtract_mean` and :func:`project` -- the centring and the projection P;
  :func:`check_centred` -- the refusal of sets off the subspace;
* :func:`set_times` -- the time of a vector field's call, one for all sets or one per set;
* :func:`sample_probes` -- Hutchinson probes P u with E[u u^T] = I (log-det series, CNF
  divergences);
* :func:`probe_stream` and :func:`evaluation_generator` -- where evaluation-mode probes come
  from: re-seeded at every call, or one stream through a whole evaluation pass;
* :func:`vjp` -- vector-Jacobian products w^T J, one vector or a batch of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import check_precision, check_sets, inputs_trusted, present_weights

__all__ = [
    "mask_from_context",
    "checked_inputs",
    "subtract_mean",
    "check_centred",
    "project",
    "set_times",
    "sample_probes",
    "probe_stream",
    "evaluation_generator",
    "vjp",
    "full_precision",
    "BatchedVJPFallbackWarning",
    "PROBES",
]

PROBES = ("rademacher", "gaussian")  # the laws of Hutchinson probes


def mask_from_context(context, x: Tensor) -> Tensor | None:
    """The padding mask carried by nflows' ``context`` argument.

    ``context`` may be ``None``, a bool tensor (B, N) (True = present) or a dict whose one
    entry is ``"mask"`` (a mask or None). Anything else raises ``ValueError``: in this library
    the context slot of a set / sequence transform is reserved for the mask, and a dict
    without that entry (``{"masks": m}``) would otherwise drop the mask unseen.

    Examples:
        >>> x, m = torch.zeros(1, 3, 2), torch.tensor([[True, True, False]])
        >>> mask_from_context({"mask": m}, x).tolist()
        [[True, True, False]]
        >>> mask_from_context({"masks": m}, x)
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: a dict context of a set transform holds one entry, ...
    """
    if context is None:
        return None
    if isinstance(context, dict):
        if list(context) != ["mask"]:
            raise InputError("a dict context of a set transform holds one entry, 'mask'; got "
                             f"the keys {sorted(map(str, context))}")
        context = context["mask"]
        if context is None:
            return None
    if not isinstance(context, Tensor) or context.dtype != torch.bool:
        raise InputError(
            "the context of a set transform must be None, a bool mask (B, N) or {'mask': mask}; "
            f"got {type(context).__name__}"
            + (f" of dtype {context.dtype}" if isinstance(context, Tensor) else "")
        )
    return context


def checked_inputs(inputs: Tensor, context, module: torch.nn.Module, dim: int | None = None,
                   name: str = "inputs") -> Tensor | None:
    """The mask of a transform's call (:func:`mask_from_context`), once ``inputs`` are checked
    (:func:`~flowattn.validation.check_sets`: shape, width ``dim``, finiteness, the mask) and
    their dtype against ``module``'s parameters (:func:`~flowattn.validation.check_precision`);
    inside :func:`~flowattn.validation.trusted_inputs` nothing is checked.

    Examples:
        >>> from flowattn.flows import ActNorm
        >>> checked_inputs(torch.zeros(2, 3, 4, dtype=torch.float64), None, ActNorm(4))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: inputs has dtype torch.float64, but the ActNorm's weights ...
    """
    mask = check_sets(inputs, mask_from_context(context, inputs), dim, name)
    if not inputs_trusted():
        check_precision(inputs, module, name=name)
    return mask


def subtract_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Remove each set's centre of mass: x_i - mean_j x_j over present elements.

    Padded elements are returned as zeros.

    Examples:
        >>> subtract_mean(torch.tensor([[[1.0], [3.0]]])).flatten().tolist()
        [-1.0, 1.0]
    """
    w = present_weights(x, mask).unsqueeze(-1)
    mean = (x * w).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True)
    return (x - mean) * w


def project(v: Tensor, mask: Tensor | None = None, zero_com: bool = False) -> Tensor:
    """Apply P: zero padded elements, and remove each set's centre of mass if ``zero_com``.

    ``v`` may carry extra leading dimensions (probe samples): its last three are (B, N, D).
    Without a mask and without ``zero_com`` P is the identity, for any shape of ``v``.
    """
    if zero_com:
        lead = v.shape[:-3]
        flat = v.reshape(-1, *v.shape[-2:])
        m = None if mask is None else mask.expand(*lead, *mask.shape).reshape(-1, mask.shape[-1])
        return subtract_mean(flat, m).reshape(v.shape)
    if mask is None:
        return v
    return v * mask.unsqueeze(-1).to(v.dtype)


def check_centred(x: Tensor, mask: Tensor | None = None, name: str = "inputs") -> None:
    """Refuse sets off the zero-centre-of-mass subspace: a present element's centre-of-mass
    coordinate above sqrt(eps) (1 + max |x|) in ``x``'s precision (rounding passes).

    Examples:
        >>> check_centred(subtract_mean(torch.randn(2, 3, 2)))
        >>> check_centred(torch.ones(1, 2, 2))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: inputs must be centred (sum of present elements = 0 per ...
    """
    x = x.detach()  # a check, not part of the graph
    offset = x - subtract_mean(x, mask)
    if mask is not None:
        offset = offset * mask.unsqueeze(-1).to(x.dtype)
    scale = 1.0 + float(x.abs().max())
    tol = torch.finfo(x.dtype).eps ** 0.5 * scale
    worst = float(offset.abs().max())
    if worst > tol:
        raise InputError(
            f"{name} must be centred (sum of present elements = 0 per set) in zero-centre-of-"
            f"mass mode; its largest centre-of-mass coordinate is {worst:.3g} > {tol:.3g}"
        )


def set_times(t: Tensor | float, z: Tensor) -> Tensor:
    """The time of a vector field's call on sets ``z`` (B, N, D), as a (1, 1) or (B, 1) tensor.

    ``t`` is a number or a one-element tensor (one time for every set, as an ODE solver calls)
    or a (B,) tensor of one time per set (as flow matching trains); the result has ``z``'s
    dtype and device and broadcasts against per-set features.

    Examples:
        >>> z = torch.zeros(3, 4, 2)
        >>> set_times(0.5, z).shape, set_times(torch.rand(3), z).shape
        (torch.Size([1, 1]), torch.Size([3, 1]))
    """
    t = torch.as_tensor(t, dtype=z.dtype, device=z.device)
    if t.numel() == 1:
        return t.reshape(1, 1)
    if t.shape != z.shape[:1]:
        raise InputError(f"t must be one time or one per set, shape ({z.shape[0]},); got shape "
                         f"{tuple(t.shape)}")
    return t.reshape(-1, 1)


def full_precision(x: Tensor) -> torch.autocast:
    """A context in which ``torch.autocast`` is off on ``x``'s device: the exact layers, the
    inverses and the determinants of a flow run in the working precision of their data.

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     with full_precision(torch.zeros(1)):
        ...         (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    return torch.autocast(x.device.type, enabled=False)


@torch.compiler.disable  # drawn eagerly: compiled and eager code see the same random stream
def sample_probes(
    shape: Sequence[int],
    probe: str = "rademacher",
    mask: Tensor | None = None,
    zero_com: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Hutchinson probes P u with E[u u^T] = I: u Rademacher (+-1) or standard Gaussian.

    Drawn from ``generator`` (on its own device, then moved to ``device``), so results are
    reproducible; then projected by P (``mask``, ``zero_com``, see :func:`project`), so that
    E[(P u)^T J (P u)] = tr(P J P).

    Arguments:
        shape: the probes' shape, (..., B, N, D) (any shape without mask and ``zero_com``).
        probe: ``"rademacher"`` or ``"gaussian"``.
        mask: bool (B, N), True = present; padded elements get zero probes.
        zero_com: project onto the zero-centre-of-mass subspace.
        generator: optional seeded torch.Generator.
        device: where the probes go.
        dtype: their dtype (default: torch's default dtype).

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> sample_probes((1, 4), generator=g).abs().tolist()
        [[1.0, 1.0, 1.0, 1.0]]
    """
    gen_device = generator.device if generator is not None else device
    if probe == "gaussian":
        v = torch.randn(*shape, generator=generator, device=gen_device, dtype=dtype)
    elif probe == "rademacher":  # 2 b - 1 for fair bits b, drawn in the probes' dtype
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        v = torch.randint(0, 2, tuple(shape), generator=generator, device=gen_device,
                          dtype=dtype).mul_(2).sub_(1)
    else:
        raise InputError(f"probe must be 'rademacher' or 'gaussian', got {probe!r}")
    return project(v.to(device), mask, zero_com)


# the generators of the innermost probe_stream, by (device, seed); None outside any
_STREAM: ContextVar[dict | None] = ContextVar("flowattn_probe_stream", default=None)


@contextmanager
def probe_stream() -> Iterator[None]:
    """Draw evaluation-mode probes from one advancing stream per seed while the block runs.

    Outside it, a module in evaluation mode re-seeds its probes at every call (its
    ``eval_seed``), so the same inputs always get the same score. Over a pass through many
    batches that repeats one probe pattern batch after batch, and every module with the same
    seed draws the same probes: their estimates' errors are then correlated, and a standard
    error that treats them as independent is too small. Inside the block, each (device,
    seed) gets one generator, seeded once, from which every call draws on: the pass as a whole
    is still repeatable, and its calls' probes are independent.

    Examples:
        >>> with probe_stream():
        ...     first = evaluation_generator("cpu", 0).initial_seed()
        ...     same = evaluation_generator("cpu", 0) is evaluation_generator("cpu", 0)
        >>> first, same, evaluation_generator("cpu", 0) is evaluation_generator("cpu", 0)
        (0, True, False)
    """
    token = _STREAM.set({})
    try:
        yield
    finally:
        _STREAM.reset(token)


def evaluation_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """The generator of an evaluation-mode call's probes: a fresh one seeded with ``seed``, or
    inside :func:`probe_stream` the stream's generator for (``device``, ``seed``)."""
    stream = _STREAM.get()
    if stream is None:
        return torch.Generator(device=device).manual_seed(seed)
    key = (str(torch.device(device)), seed)
    if key not in stream:
        stream[key] = torch.Generator(device=device).manual_seed(seed)
    return stream[key]


class BatchedVJPFallbackWarning(UserWarning):
    """A batch of VJPs ran as a loop of single VJPs: an operator's backward has no batching rule.

    The results are the same; only the speed differs (one backward pass per vector instead of
    one for the batch). Issued once per process.
    """


# Messages of the errors torch raises when the backward of an operator cannot run batched
# (``is_grads_batched=True`` runs the backward under vmap): a RuntimeError from the batching
# fallback ("Batching rule not implemented for aten::item. We could not generate a fallback.",
# "... the fallback path doesn't work on out= or view ops.") or a vmap restriction ("vmap: ...").
_UNBATCHABLE = ("Batching rule not implemented", "vmap:")
_warned_fallback = False


def _is_unbatchable(error: RuntimeError) -> bool:
    if isinstance(error, torch.OutOfMemoryError):  # a RuntimeError too: never hidden
        return False
    text = str(error)
    return any(marker in text for marker in _UNBATCHABLE)


def _warn_fallback(error: RuntimeError) -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"batched VJPs fell back to a loop of single VJPs ({first_line}); results are "
        "unchanged, only slower. This warning is shown once per process.",
        BatchedVJPFallbackWarning,
        stacklevel=3,
    )


def vjp(
    output: Tensor, x: Tensor, w: Tensor, create_graph: bool = False, batched: bool = False
) -> Tensor:
    """w^T d output / dx for one vector ``w``, or for a leading batch of them (``batched``).

    The graph of ``output`` is kept for further products; where ``output`` does not depend on
    ``x`` the result is zero. A batch whose backward has an operator without a batching rule
    runs as a loop of single VJPs, with a :class:`BatchedVJPFallbackWarning` (once per
    process); every other error, out-of-memory included, propagates.
    """
    if not output.requires_grad:
        return x.new_zeros(w.shape[:1] + x.shape if batched else x.shape)
    if batched:
        try:
            grads = torch.autograd.grad(output, x, w, retain_graph=True,
                                        create_graph=create_graph, allow_unused=True,
                                        is_grads_batched=True)
        except RuntimeError as error:
            if not _is_unbatchable(error):
                raise
            _warn_fallback(error)
            return torch.stack([vjp(output, x, wi, create_graph) for wi in w])
        return x.new_zeros(w.shape[:1] + x.shape) if grads[0] is None else grads[0]
    (grad,) = torch.autograd.grad(output, x, w, retain_graph=True, create_graph=create_graph,
                                  allow_unused=True)
    return torch.zeros_like(x) if grad is None else grad
