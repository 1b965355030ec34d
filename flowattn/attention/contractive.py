"""What every contractive attention module shares: f = coeff * F / bound(F), row by row.

``ContractiveL2MHA`` and ``ContractiveScaledCosineMHA`` divide an attention module F (held as
``self.attention``) by its certified Lipschitz bound in the norm ``self.norm``, apply classic
output dropout, and hand F's attention matrices and projections through.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..errors import InputError
from ..lipschitz import check_counts
from ..lipschitz.checks import norm_name
from ..validation import assert_finite
from .masking import keys_per_row
from .projections import Projection

__all__ = ["ContractiveAttention", "frozen_certificates", "shared_certificates"]


class _Frozen(threading.local):
    """Per thread: the certificates kept inside :func:`frozen_certificates`, or None outside
    (a thread-local attribute, as ``frozen_power_iteration`` keeps its flag)."""

    def __init__(self) -> None:  # instance attributes: dynamo guards them without a fault
        self.kept: dict | None = None


_FROZEN = _Frozen()


@contextmanager
def frozen_certificates() -> Iterator[None]:
    """Within this context, every contractive attention module evaluates its certificate once
    per set size (and mask kind) and reuses it in the calls that record no gradient.

    An iterative inverse or a sampler calls the same branch tens of times with weights that do
    not change; the certificate depends on the weights and the set size only, so every call
    after the first would recompute the same value (spectral norms: one eigensolver call each).
    The values reused are those a fresh evaluation gives, bit for bit. The weights must not
    change inside the context; calls that record gradients (training, implicit
    differentiation) evaluate the certificate afresh, so that their derivatives flow. The
    flows' inverse (:func:`~flowattn.flows.inverse.residual_inverse`) enters it for its solver,
    and the evaluation functions of the set flows and the language models for their batches.

    Examples:
        >>> from flowattn.attention import ContractiveL2MHA
        >>> f = ContractiveL2MHA(dim=4, heads=2)
        >>> x = torch.randn(2, 3, 4)
        >>> with torch.no_grad(), frozen_certificates():
        ...     same = torch.equal(f(x), f(x))  # the second call reuses the first's bound
        >>> same
        True
    """
    previous = _FROZEN.kept
    if previous is None:
        _FROZEN.kept = {}
    try:
        yield
    finally:
        _FROZEN.kept = previous


class _Shared(threading.local):
    """Per thread: the certificates evaluated together inside :func:`shared_certificates`,
    keyed as :meth:`ContractiveAttention._bound` asks for them, or None outside."""

    def __init__(self) -> None:  # instance attributes: dynamo guards them without a fault
        self.tables: dict | None = None


_SHARED = _Shared()


@contextmanager
def shared_certificates(modules: Iterable[nn.Module], length: int,
                        causal: bool = False) -> Iterator[None]:
    """Within this context, the contractive attention modules among ``modules`` that are built
    alike take their certificate for sequences of ``length`` elements from one evaluation
    batched over all of them (``torch.func.vmap``), instead of one evaluation each.

    A model with L layers of the same contractive attention otherwise runs every operation of
    the certificate L times on small matrices; batched, it runs each once on L of them, and
    the eigensolver once per kind of matrix. Values and derivatives are those of the separate
    evaluations (to rounding). Modules are batched together when they have the same class,
    the same settings (every public attribute of every submodule) and parameters and buffers
    of the same names, shapes, dtypes and devices; parametrised modules, and a module alike
    with no other, evaluate their own certificate as before. Only the mask-free call that the
    module would make for ``length`` and ``causal`` is prepared: any other call evaluates its
    own. Inside :func:`frozen_certificates` and without gradients the batch joins the kept
    certificates (and is not evaluated again while they are kept). The weights must not
    change inside the context (one forward pass). The language models enter it for their
    residual stack.

    Examples:
        >>> from flowattn.attention import ContractiveL2MHA
        >>> layers = [ContractiveL2MHA(dim=4, heads=2) for _ in range(3)]
        >>> x = torch.randn(2, 5, 4)
        >>> with shared_certificates(layers, length=5):
        ...     y = layers[0](x)
        >>> torch.allclose(y, layers[0](x))
        True
    """
    groups: dict[tuple, list[ContractiveAttention]] = {}
    for module in modules:
        if isinstance(module, ContractiveAttention) and module.batchable and not any(
                parametrize.is_parametrized(m) for m in module.modules()):
            groups.setdefault(_signature(module), []).append(module)
    # inside frozen_certificates and without gradients the tables join the kept ones, so that
    # later calls (the next batch of an evaluation) reuse them
    kept = _FROZEN.kept if not torch.is_grad_enabled() else None
    tables = {}
    for group in groups.values():
        every_count = group[0]._every_count(False, causal)  # the mask-free call
        certified = length if every_count else group[0]._certified_length(length, causal)
        keys = [m._key(certified, every_count, causal) for m in group]
        if len(group) > 1 and not (kept is not None and all(k in kept for k in keys)):
            bounds = _check_bound(_batched_bounds(group, certified, every_count, causal),
                                  type(group[0]).__name__)
            tables.update(zip(keys, bounds, strict=True))
    if kept is not None:
        kept.update(tables)
        tables = {}
    previous = _SHARED.tables
    _SHARED.tables = {**(previous or {}), **tables}
    try:
        yield
    finally:
        _SHARED.tables = previous


def _signature(module: nn.Module) -> tuple:
    """What must agree for two modules' certificates to be one function of their weights."""
    settings = tuple(
        (name, type(sub), tuple(sorted((k, repr(v)) for k, v in vars(sub).items()
                                       if not k.startswith("_"))))
        for name, sub in module.named_modules())
    tensors = tuple((name, t.shape, t.dtype, t.device) for name, t in
                    (*module.named_parameters(), *module.named_buffers()))
    return settings, tensors


class _Certificate(nn.Module):
    """``module._certificate`` as a forward pass, for ``torch.func.functional_call``."""

    def __init__(self, module: ContractiveAttention):
        super().__init__()
        self.module = module

    def forward(self, counts: int | range, causal: bool) -> Tensor:
        return self.module._certificate(counts, causal)


@torch.compiler.disable  # host-side counts, as in _bound
def _batched_bounds(group: list[ContractiveAttention], length: int, every_count: bool,
                    causal: bool) -> Tensor:
    """The certificates of ``group`` (modules alike), stacked: one vmapped evaluation of the
    first module's with each module's parameters and buffers."""
    wrapper = _Certificate(group[0])
    names = [name for name, _ in (*group[0].named_parameters(), *group[0].named_buffers())]
    states = [dict((*m.named_parameters(), *m.named_buffers())) for m in group]
    stacked = {f"module.{n}": torch.stack([state[n] for state in states]) for n in names}
    counts = range(1, length + 1) if every_count else length
    with _weights_precision(group[0]):
        return torch.func.vmap(
            lambda state: torch.func.functional_call(wrapper, state, (counts, causal)))(stacked)


def _weights_precision(module: nn.Module) -> torch.autocast:
    """A context with ``torch.autocast`` off on the module's device: a certificate is evaluated
    in its weights' precision also when the attention itself runs in a lower one (products
    rounded to bfloat16 could bring the bound below the Lipschitz constant it certifies)."""
    return torch.autocast(next(module.parameters()).device.type, enabled=False)


def _check_bound(bound: Tensor, name: str) -> Tensor:
    """``bound``, a certificate as evaluated (once, before it is kept or shared), refused by
    name where it is NaN or Inf (:func:`~flowattn.validation.assert_finite`). A NaN bound also
    stays NaN in :func:`_divisor`, so that inside a flow, where the check is deferred, the
    results are NaN and the entry point's check raises."""
    assert_finite(bound, f"the certified Lipschitz bound of {name} is NaN or Inf: its weights "
                  f"are too large for {bound.dtype} (scale them down or use float64)")
    return bound


def _divisor(bound: Tensor) -> Tensor:
    """A certified bound to divide F by: a bound of 0 certifies that F is constant (a zeroed
    W^O or W^V, say), so c F itself is a contraction and the bound is taken as 1 instead of
    dividing 0 by 0. Any other value is kept: a NaN bound (weights too large for their dtype)
    makes the output NaN rather than leaving F undivided.

    Examples:
        >>> _divisor(torch.tensor([0.0, 2.5, float("nan")]))
        tensor([1.0000, 2.5000,    nan])
    """
    return torch.where(bound == 0, torch.ones_like(bound), bound)


class ContractiveAttention(nn.Module):
    """Base of the contractive attention modules; a subclass sets ``attention`` (F), ``coeff``,
    ``norm`` (normalised by ``norm_name(..., mixed=True)``) and ``output_dropout``."""

    attention: nn.Module
    coeff: float
    norm: str
    output_dropout: float
    # set by a module whose F is certified in its own norm alone (e.g. "2,inf"): a bound in any
    # other norm is refused
    only_norm: str | None = None
    # in the 2-norm, the length whose bound every causal call takes (None: the call's own)
    causal_length: int | None = None
    # whether the certificate may be evaluated batched over modules alike (torch.func.vmap):
    # not where it reads a value back to the host
    batchable: bool = True

    def _contraction(self, coeff: float, norm: str | int, output_dropout: float) -> None:
        """Check and set ``coeff`` in (0, 1), ``norm`` and ``output_dropout`` in [0, 1)."""
        if not 0.0 < coeff < 1.0:
            raise InputError(f"coeff must lie in (0, 1) for a contraction, got {coeff}")
        if not 0.0 <= output_dropout < 1.0:
            raise InputError(f"output_dropout must lie in [0, 1), got {output_dropout}")
        self.coeff, self.norm = coeff, norm_name(norm, mixed=True)
        self.output_dropout = output_dropout

    def _divided(self, x: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """coeff * F(x) / bound: in the 2-norm the bound of each set; in the inf- and mixed
        norms that of each block row i for its own number of keys n_i (Kim et al., App. G)."""
        y = self.attention(x, mask, causal)  # validates the input
        return self.coeff * y / self._denominator(x, mask, causal)

    def _denominator(self, x: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """F's certified bound, (B, 1, 1) in the 2-norm or per block row (B, N, 1) otherwise
        ((1, 1, 1) where every row sees all N elements).

        The bound depends on the weights and on a row's number of keys n in {1, ..., N} only:
        it is evaluated once per possible count (or once for N) and looked up, not once per row,
        and the counts never leave the device."""
        batch, length = x.shape[:2]
        if not self._every_count(mask is not None, causal):
            length = self._certified_length(length, causal)
            return self._bound(length, every_count=False, causal=causal).reshape(1, 1, 1)
        table = self._bound(length, every_count=True, causal=causal)  # (N,)
        if self.norm == "2":
            return table[mask.sum(1) - 1][:, None, None]
        n = keys_per_row(mask, causal, batch, length, x.device)  # (B, N)
        return table[n - 1].unsqueeze(-1)

    def _every_count(self, masked: bool, causal: bool) -> bool:
        """Whether a call needs the table of bounds for every count of keys 1..N (masks, and
        causal rows outside the 2-norm, whose bound is one per set) or the bound for N (a
        causal call in the 2-norm with a ``causal_length``: the bound for that length)."""
        if self._fixed_length(causal):
            return False
        return masked or (causal and self.norm != "2")

    def _fixed_length(self, causal: bool) -> bool:
        """Whether a call takes the bound of ``causal_length`` elements whatever its length."""
        return causal and self.norm == "2" and self.causal_length is not None

    def _certified_length(self, length: int, causal: bool) -> int:
        """The number of elements whose bound a call of ``length`` elements takes: its own, or
        for a causal call in the 2-norm the module's ``causal_length``. A causal map on N
        elements is the leading block of the map on more (the later elements do not reach
        the earlier outputs), so its Jacobian's 2-norm is at most theirs, and earlier outputs
        then do not depend on how many elements follow."""
        if not self._fixed_length(causal):
            return length
        if length > self.causal_length:
            raise InputError(f"a causal call of {length} elements exceeds causal_length="
                             f"{self.causal_length}, the length the module is certified for")
        return self.causal_length

    def _key(self, length: int, every_count: bool, causal: bool) -> tuple:
        """Where the certificates kept or shared over a context file this call's bound: the
        module itself (held, not reused), its norm and the call's kind."""
        return self, self.norm, length, every_count, causal

    @torch.compiler.disable
    def _bound(self, length: int, every_count: bool, causal: bool = False) -> Tensor:
        """F's bound for N = ``length`` keys, or the table (N,) for 1..N keys (rows of causal
        attention if ``causal``). Evaluated eagerly under ``torch.compile`` as well: the key
        counts and the cached Lambert W constants are host values, which a graph with a dynamic
        N cannot enumerate (the weights' part is still differentiated)."""
        counts = range(1, length + 1) if every_count else length
        key = self._key(length, every_count, causal)
        shared, kept = _SHARED.tables, _FROZEN.kept
        if shared is not None and key in shared:
            bound = shared[key]
        elif kept is None or torch.is_grad_enabled():
            bound = self._checked_certificate(counts, causal)
        else:
            if key not in kept:
                kept[key] = self._checked_certificate(counts, causal)
            bound = kept[key]
        return _divisor(bound)

    def _checked_certificate(self, counts: int | range, causal: bool) -> Tensor:
        """:meth:`_certificate` in the weights' precision, refused where it is NaN or Inf
        (:func:`_check_bound`)."""
        with _weights_precision(self):
            return _check_bound(self._certificate(counts, causal), type(self).__name__)

    def _certificate(self, counts: int | range, causal: bool) -> Tensor:
        """F's bound for ``counts`` keys in the module's norm (a subclass whose bound can use
        the causal structure overrides this)."""
        return self.attention.lipschitz_bound(counts, self.norm)

    def _dropout_mask(self, y: Tensor) -> Tensor | None:
        """The factor of :meth:`_classic_dropout` (a 0/1 mask, or 1 - p), None without dropout."""
        p = self.output_dropout
        if p == 0.0:
            return None
        if self.training:
            return (torch.rand_like(y) >= p).to(y.dtype)
        return torch.full_like(y, 1.0 - p)

    def _classic_dropout(self, y: Tensor) -> Tensor:
        keep = self._dropout_mask(y)
        return y if keep is None else y * keep

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """Apply f to ``x`` (B, N, D); ``mask`` (B, N) marks present elements."""
        return self._classic_dropout(self._divided(x, mask, causal))

    def attention_probabilities(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False
    ) -> Tensor:
        """The attention matrices P (B, H, N, N) of f on ``x`` (B, N, D): those of F (f scales
        F's output rows, not its attention weights)."""
        return self.attention.attention_probabilities(x, mask, causal)

    def projections(self) -> list[Projection]:
        """The projections of F, named from f (``"attention.w_q"``, ...)."""
        return [replace(p, name=f"attention.{p.name}") for p in self.attention.projections()]

    def lipschitz_bound(self, n: int | Tensor, norm: str | int | None = None) -> Tensor:
        """Certified Lipschitz constant of f for sets of ``n`` elements.

        In the module's own norm this is ``coeff``. In another norm, f = S F with S diagonal,
        ||S||_p <= coeff / bound_own(1) (the bound grows with N), so
        Lip_other(f) <= coeff * bound_other(n) / bound_own(1): valid, though loose.
        """
        n = check_counts(n)
        norm = self.norm if norm is None else norm_name(norm, mixed=True)
        if self.only_norm is not None and norm != self.only_norm:
            raise InputError(f"{type(self).__name__} is certified in the norm "
                             f"'{self.only_norm}' only, got norm={norm!r}")
        w = self.attention.w_q
        coeff = torch.as_tensor(self.coeff, dtype=w.dtype, device=w.device)
        if norm == self.norm:
            return coeff.expand(() if isinstance(n, int) else (len(n),) if isinstance(n, range)
                                else torch.as_tensor(n).shape)
        own = self.attention.lipschitz_bound(1, self.norm)
        return coeff * self.attention.lipschitz_bound(n, norm) / own
