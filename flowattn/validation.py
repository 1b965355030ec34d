"""Input checks shared by every public entry point (errors are raised where data enters), and
the padding mask read as per-element weights or per-set counts.

Data are checked once, where they enter: the outermost call (``SetFlow.log_prob``, or a
transform or attention module called directly) runs :func:`check_sets`, then runs its layers
inside :func:`trusted_inputs`, where :func:`check_sets` returns at once. The checks cost a host
synchronisation each (the finiteness and empty-set tests read a value back), so a flow of many
layers pays for them once per call instead of once per layer. Overflow checks of layers
(:func:`check_output`) are deferred the same way: inside the context a layer only notes that
its output would have been checked, and the entry point checks its own results once, after its
layers ran (:func:`check_deferred`).
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from .errors import InputError, NonFiniteError

__all__ = [
    "check_sets",
    "check_count",
    "check_heads",
    "check_finite",
    "check_precision",
    "check_output",
    "check_deferred",
    "trusted_inputs",
    "inputs_trusted",
    "values_readable",
    "present_counts",
    "present_weights",
]

class _Trust(threading.local):
    """Per thread: whether the running call is inside :func:`trusted_inputs`. A thread-local
    attribute, not a ContextVar, so that ``torch.compile`` traces it without a graph break."""

    def __init__(self) -> None:  # instance attributes: dynamo guards them without a fault
        self.trusted = False
        # [whether a layer inside the context skipped its overflow check]: a list, because
        # dynamo replays the mutation of a list made in compiled code, not the rebinding of
        # an attribute (which it drops)
        self.deferred = [False]


_TRUST = _Trust()


@contextmanager
def trusted_inputs() -> Iterator[None]:
    """Within this context :func:`check_sets` trusts its arguments and returns the mask as given.

    An entry point checks its inputs, then calls its layers inside this context: the layers'
    own checks (each a host synchronisation) are skipped, since the data were checked where they
    entered. Outside it, every checked call checks, so a transform or attention module called
    directly still refuses bad input with a clear error.

    Examples:
        >>> x = torch.full((1, 2, 3), float("nan"))
        >>> with trusted_inputs():
        ...     check_sets(x) is None  # not checked again
        True
    """
    previous = _TRUST.trusted
    _TRUST.trusted = True
    if not previous:
        _TRUST.deferred[0] = False
    try:
        yield
    finally:
        _TRUST.trusted = previous


def inputs_trusted() -> bool:
    """Whether the caller runs inside :func:`trusted_inputs` (its inputs were checked)."""
    return _TRUST.trusted


def values_readable() -> bool:
    """False under a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...), where a
    check that reads a value back is data-dependent control flow, which ``vmap`` refuses: the
    value checks (finiteness, empty sets, overflow) are then skipped; shapes, widths and dtypes
    are still checked."""
    return not torch._C._are_functorch_transforms_active()


def _all_finite(*tensors: Tensor) -> bool:
    # One reduction answers for the common case: a NaN or Inf makes the sum non-finite. Only
    # then are the values checked one by one, so a sum that overflows on huge finite values
    # (1e38 in float32, 7e4 in float16) is not taken for a NaN or Inf.
    if not values_readable():
        return True
    tensors = tuple(t.detach() for t in tensors)
    total = sum(t.sum() for t in tensors)
    return bool(torch.isfinite(total)) or all(bool(torch.isfinite(t).all()) for t in tensors)


def check_count(value, name: str, low: int = 1) -> int:
    """``value`` as an int, refused unless it is an integer >= ``low`` (not a bool, not 2.5).

    Examples:
        >>> check_count(3, "blocks")
        3
        >>> check_count(0, "heads")
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: heads must be an integer >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_heads(dim, heads, name: str = "dim") -> None:
    """Refuse an attention module's width ``dim`` (called ``name``) and number of ``heads``
    unless both are positive integers and the heads divide the width.

    Examples:
        >>> check_heads(8, 3)
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: heads=3 must divide dim=8
    """
    check_count(dim, name)
    check_count(heads, "heads")
    if dim % heads != 0:
        raise InputError(f"heads={heads} must divide {name}={dim}")


def check_finite(x: Tensor, name: str = "x") -> None:
    """Raise a ``ValueError`` (:class:`~flowattn.errors.NonFiniteError`) if ``x`` holds NaN or
    Inf values. Finite values are accepted however large."""
    if not _all_finite(x):
        bad = (~torch.isfinite(x)).sum().item()
        raise NonFiniteError(f"{name} contains {bad} non-finite value(s) (NaN or Inf)")


def assert_finite(x: Tensor, message: str) -> None:
    """Raise :class:`~flowattn.errors.NonFiniteError` with ``message`` if ``x`` holds NaN or
    Inf: read back on the CPU; on another device, and in compiled code, an asynchronous
    assertion (no synchronisation, no graph break). Skipped under ``torch.func`` transforms
    (:func:`values_readable`), and deferred inside :func:`trusted_inputs` as
    :func:`check_output` defers (for a value that makes the results NaN or Inf when it is:
    the entry point's check of its results then raises).

    Examples:
        >>> assert_finite(torch.tensor([1.0, float("nan")]), "the bound is not a number")
        Traceback (most recent call last):
        ...
        flowattn.errors.NonFiniteError: the bound is not a number
    """
    if not values_readable() or _deferred():
        return
    finite = torch.isfinite(x).all()
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(finite, message)
    elif not bool(finite):
        raise NonFiniteError(message)


def _deferred() -> bool:
    """Inside :func:`trusted_inputs`: note that a check was deferred to the entry point (which
    then checks its results, :func:`check_deferred`) and say so; outside: False."""
    if _TRUST.trusted:
        _TRUST.deferred[0] = True
    return _TRUST.trusted


def check_output(
    y: Tensor, x: Tensor, name: str, cause: str = "", intermediate: Tensor | None = None
) -> Tensor:
    """``y``, computed by ``name`` from the finite input ``x``, if it is finite (and so is
    ``intermediate``, a value whose overflow the rest of the computation could hide).

    Otherwise the computation overflowed (the inputs are checked where they enter), and a
    :class:`~flowattn.errors.NonFiniteError` says so, with the input's magnitude, the dtype and
    ``cause``, the likely place, instead of letting NaN or Inf travel on silently.

    Inside :func:`trusted_inputs` (a layer of a flow whose entry point checked the data) the
    check is deferred: nothing is read back here, and the entry point checks its results with
    :func:`check_deferred` once, after all its layers ran (also from compiled code: no
    graph break here).
    """
    if _deferred():
        return y
    if _all_finite(y) if intermediate is None else _all_finite(y, intermediate):
        return y
    raise _overflow_error(name, "output", x, cause)


def check_deferred(x: Tensor, name: str, *results: Tensor) -> None:
    """At an entry point, after its layers ran inside :func:`trusted_inputs`: if one of them
    deferred its overflow check (:func:`check_output`), check the entry's ``results`` computed
    from the finite input ``x`` once, and raise :class:`~flowattn.errors.NonFiniteError` naming
    ``name`` if they hold NaN or Inf. Nested entry points (still inside the context) leave the
    check to the outermost one; without a deferred check nothing is read back.
    """
    if _TRUST.trusted or not _TRUST.deferred[0]:
        return
    _TRUST.deferred[0] = False
    _check_results(x, name, results)


@torch.compiler.disable
def _check_results(x: Tensor, name: str, results: tuple[Tensor, ...]) -> None:
    """:func:`check_deferred`'s read-back, always run eagerly: a compiled model's forward
    leaves its graph here by design, without torch.compile's warning about a graph break."""
    if not _all_finite(*results):
        raise _overflow_error(name, "result", x, "an attention layer's x W is the likely place")


def _overflow_error(name: str, what: str, x: Tensor, cause: str) -> NonFiniteError:
    """The error of a computation ``name`` whose ``what`` holds NaN or Inf although its input
    ``x`` is finite: the input's magnitude, its dtype and ``cause``, the likely place."""
    largest = x.detach().abs().amax().item()
    where = f" ({cause})" if cause else ""
    return NonFiniteError(
        f"{name} overflowed: its {what} holds NaN or Inf although its input is finite, with "
        f"values up to {largest:.3g} in {str(x.dtype).removeprefix('torch.')}{where}; scale "
        "the input down or compute in float64"
    )


def check_sets(
    x: Tensor,
    mask: Tensor | None = None,
    dim: int | None = None,
    name: str = "x",
    module: torch.nn.Module | None = None,
) -> Tensor | None:
    """Validate a batch of sets or sequences ``x`` of shape (B, N, D) and its padding mask.

    Arguments:
        x: the batch, shape (B, N, D), floating point, finite.
        mask: optional bool tensor (B, N), True where an element is present. Every set must
            contain at least one present element.
        dim: the expected feature width D, if the caller has one.
        name: the argument's name, used in error messages.
        module: the module ``x`` is for: ``x`` must have the dtype of its (first floating)
            parameters, unless ``torch.autocast`` is on for ``x``'s device (mixed precision
            hands lower-precision activations to full-precision weights on purpose).

    Inside :func:`trusted_inputs` nothing is checked and ``mask`` is returned as given.

    Returns:
        The mask (``None`` stays ``None``), moved to ``x``'s device.

    Raises:
        ValueError: naming the wrong rank, width, dtype, non-finite values, mask shape or
            dtype, an empty set or an empty batch.
    """
    if _TRUST.trusted:
        return mask
    if not isinstance(x, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise InputError(f"{name} must have shape (B, N, D), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise InputError(f"{name} must be floating point, got dtype {x.dtype}")
    if dim is not None and x.shape[-1] != dim:
        raise InputError(f"{name} has width D={x.shape[-1]}, but the module expects D={dim}")
    if x.shape[0] == 0:
        raise InputError(f"{name} holds no sets (B=0): shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise InputError(f"{name} holds empty sets (N=0): shape {tuple(x.shape)}")
    check_finite(x, name)
    mask = _checked_mask(x, mask)
    if module is not None:  # after the values and the mask: those errors come first
        _check_module_dtype(x, module, name)
    return mask


def _checked_mask(x: Tensor, mask: Tensor | None) -> Tensor | None:
    """The mask of :func:`check_sets`, checked and moved to ``x``'s device."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise InputError(f"mask must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise InputError(f"mask must have dtype torch.bool (True = present), got {mask.dtype}")
    if mask.shape != x.shape[:2]:
        raise InputError(
            f"mask must have shape (B, N) = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
        )
    mask = mask.to(x.device)
    if not values_readable():
        return mask
    empty = ~mask.any(dim=1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()[:8]
        raise InputError(f"mask leaves set(s) {rows} empty: every set needs a present element")
    return mask


LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_precision(x: Tensor, *modules: torch.nn.Module, name: str = "x") -> None:
    """Refuse half-precision data or parameters of a flow, naming the supported way, and data
    whose dtype is not that of the flow's parameters.

    Flows keep their parameters and data in float32 or float64: log-determinants (slogdet,
    power series) and iterative inverses need at least float32, and CPU kernels of ``slogdet``
    and ``solve`` have no float16 or bfloat16 versions. Mixed precision is supported through
    ``torch.autocast``: the branches then compute in the low precision while log-dets and
    inverses stay in float32 (the flow's inputs stay in its own precision).

    Examples:
        >>> check_precision(torch.zeros(2, 3, 2, dtype=torch.float16))
        Traceback (most recent call last):
        ...
        flowattn.errors.InputError: x has dtype torch.float16: ...
    """
    dtypes = [x.dtype] + [
        p.dtype for m in modules for p in (_first_floating(m),) if p is not None
    ]
    low = next((d for d in dtypes if d in LOW_PRECISION), None)
    if low is None:
        for module in modules:
            _check_module_dtype(x, module, name)
        return
    what = f"{name} has dtype {low}" if x.dtype == low else f"the flow's parameters are {low}"
    raise InputError(
        f"{what}: flows keep parameters and data in float32 or float64 (log-determinants and "
        "inverses need it). For mixed precision keep them in float32 and run the flow under "
        "torch.autocast, e.g. `with torch.autocast('cpu', dtype=torch.bfloat16):` (CUDA: "
        "float16 or bfloat16); the branches then compute in the low precision and the "
        "log-determinants in float32 (docs/flows.md, 'Mixed precision')"
    )


def _check_module_dtype(x: Tensor, module: torch.nn.Module, name: str) -> None:
    weight = _first_floating(module)
    if weight is None or weight.dtype == x.dtype or _autocast_on(x.device.type):
        return
    raise InputError(
        f"{name} has dtype {x.dtype}, but the {type(module).__name__}'s weights are "
        f"{weight.dtype}: give {name} in {weight.dtype} ({name}.to({weight.dtype})) or convert "
        f"the module (module.to({x.dtype})); mixed precision goes through torch.autocast")


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (torch < 2.4 asks per device)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # pragma: no cover - torch < 2.4
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()


def _first_floating(module: torch.nn.Module) -> Tensor | None:
    """The first floating-point parameter of ``module``, else its first floating-point buffer
    (a layer fixed at construction), else None."""
    for tensors in (module.parameters(), module.buffers()):
        for t in tensors:
            if t.is_floating_point():
                return t
    return None


def present_counts(mask: Tensor | None, batch: int, length: int, device=None) -> Tensor:
    """Number of present elements per set, shape (B,), as a long tensor."""
    if mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    return mask.sum(dim=1)


def present_weights(x: Tensor, mask: Tensor | None) -> Tensor:
    """1 for each present element of ``x`` (B, N, ...) and 0 for a padded one, shape (B, N)."""
    if mask is None:
        return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
    return mask.to(x.dtype)
