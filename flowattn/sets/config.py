"""Settings of a set-density run, and the flow they describe."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from nflows.transforms import CompositeTransform

from ..errors import RunError
from ..flows.builders import INTERACTIONS, SetFlow, set_flow
from ..flows.layers import SetLocation
from ..flows.logdet import LogDetOptions

__all__ = ["SetsConfig", "build_flow"]

FIELDS = ("auto", "attention", "egnn")


@dataclass
class SetsConfig:
    """Everything that defines a ``flowattn sets fit`` run (JSON-serialisable).

    Data: ``data`` is a built-in name or an ``.npz`` path; ``num_train`` overrides the size of a
    built-in training split. Flow: ``flow`` is ``resflow`` (invertible residual blocks of
    contractive L2 attention and Lipschitz MLPs) or ``cnf`` (a continuous flow whose ``field``
    is L2 attention or an E(n)-equivariant graph network, :class:`~flowattn.flows.EGNNField`;
    ``auto``, the default: the graph network for particles). ``interaction`` chooses how
    elements meet in the residual flow: contractive attention, ``radial`` (an E(n)-equivariant
    pairwise interaction, for particles), or the baselines ``linear`` and ``none``; ``auto``
    (the default) is ``radial`` for particle data (zero centre of mass) and ``attention``
    otherwise. With ``location`` (the default) the flow starts with a
    :class:`~flowattn.flows.SetLocation`, a spline flow of each set's centroid given its size;
    it is left out for particle data (centroid fixed at 0) and for ``interaction="none"``.
    ``manybody`` adds a :class:`~flowattn.flows.NeighbourhoodInteraction` residual after each
    radial one (``None``, the default: with radial interactions, not otherwise);
    ``radial_max_slope`` makes the radial residuals monotone
    (:class:`~flowattn.flows.MonotoneResidual`).
    Training: Adam with linear warm-up and cosine decay, gradient clipping.
    """

    data: str = "gaussian-sets"
    num_train: int | None = None
    flow: str = "resflow"
    interaction: str = "auto"  # radial for particles, else attention; or "linear" / "none"
    mlp: bool = True  # pointwise Lipschitz-MLP residual in every block
    radial_basis: int = 64  # interaction="radial": Gaussian bumps of psi'
    radial_range: float = 4.0  # ... and the largest bump centre (units after ActNorm)
    manybody: bool | None = None  # radial: add NeighbourhoodInteraction residuals (None: yes)
    radial_max_slope: float | None = None  # a number: monotone radial blocks, psi' <= it
    radial_inverse: bool = False  # ... and every second one inverted (steep contraction)
    location: bool = True  # spline flow of each set's centroid (not for particles, nor "none")
    # residual flow
    blocks: int = 4
    heads: int = 1
    hidden: int = 64
    coeff: float = 0.9
    train_logdet: str = "auto"  # exact when N D <= 64 (radial: <= 512), else Russian roulette
    # continuous flow
    field: str = "auto"  # "attention", "egnn" (E(n)-equivariant); "auto": egnn for particles
    field_layers: int | None = None  # None: 2 for attention, 3 for egnn
    field_hidden: int | None = None  # None: 16 for attention, 32 for egnn
    t1: float = 1.0
    ode_tol: float = 1e-4
    divergence: str = "auto"  # training: "auto" is exact when N D <= 64, else Hutchinson;
    # evaluation is exact when N D <= 64 whatever this says
    # optimisation
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    min_lr: float = 1e-4
    grad_clip: float = 10.0
    # bookkeeping
    eval_every: int = 250
    checkpoint_every: int = 250
    val_sets: int = 500
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.flow not in ("resflow", "cnf"):
            raise RunError(f"unknown flow {self.flow!r}: use 'resflow' or 'cnf'")
        positive = ["blocks", "heads", "hidden", "field_layers", "field_hidden", "steps",
                    "batch_size", "eval_every", "checkpoint_every", "val_sets", "radial_basis"]
        optional = ("field_layers", "field_hidden")  # None: the field's own default
        for name in positive:
            value = getattr(self, name)
            if (value is None and name not in optional) or (value is not None and value < 1):
                raise RunError(f"{name} must be a positive integer, got {value}")
        if self.field not in FIELDS:
            raise RunError(f"field must be one of {', '.join(FIELDS)}, got {self.field!r}")
        if self.interaction not in ("auto", *INTERACTIONS):
            raise RunError(f"interaction must be auto or one of {', '.join(INTERACTIONS)}, "
                           f"got {self.interaction!r}")
        if not 0 < self.coeff < 1:
            raise RunError(f"coeff must lie in (0, 1) for invertible blocks, got {self.coeff}")
        if self.radial_inverse and self.radial_max_slope is None:
            raise RunError("radial_inverse needs radial_max_slope (monotone radial blocks)")
        if self.radial_max_slope is not None and not self.radial_max_slope > 0:
            raise RunError(f"radial_max_slope must be positive (or null), got "
                           f"{self.radial_max_slope}")
        if not self.radial_range > 0:
            raise RunError(f"radial_range must be positive, got {self.radial_range}")
        if self.lr <= 0 or self.min_lr < 0 or self.t1 <= 0 or self.ode_tol <= 0:
            raise RunError("lr, t1 and ode_tol must be positive and min_lr non-negative")

    @classmethod
    def from_file(cls, path: str | Path) -> SetsConfig:
        """Read a JSON object of settings; unknown keys are an error."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise RunError(f"cannot read config {path}: {err}") from None
        if not isinstance(raw, dict):
            raise RunError(f"config {path} must hold a JSON object")
        return cls().updated(**raw)

    def updated(self, **changes) -> SetsConfig:
        """A copy with ``changes`` applied (``None`` values are ignored)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise RunError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
        values = asdict(self)
        values.update({k: v for k, v in changes.items() if v is not None})
        return SetsConfig(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def _heads_for(dim: int, heads: int) -> int:
    if dim % heads != 0:
        raise RunError(f"heads={heads} must divide the data dimension D={dim}")
    return heads


def resolved_interaction(config: SetsConfig, zero_com: bool) -> str:
    """The interaction a residual flow uses: ``auto`` is radial for particles, else attention."""
    if config.interaction != "auto":
        return config.interaction
    return "radial" if zero_com else "attention"


def resolved_field(config: SetsConfig, zero_com: bool) -> str:
    """The vector field a continuous flow uses: ``auto`` is egnn for particles, else attention."""
    if config.field != "auto":
        return config.field
    return "egnn" if zero_com else "attention"


def _build_field(config: SetsConfig, dim: int, zero_com: bool):
    from ..flows.continuous.egnn import EGNNField
    from ..flows.continuous.fields import AttentionField

    if resolved_field(config, zero_com) == "egnn":
        return EGNNField(dim, hidden=config.field_hidden or 32, layers=config.field_layers or 3,
                         zero_com=zero_com)
    return AttentionField(dim, heads=config.heads, layers=config.field_layers or 2,
                          hidden=config.field_hidden or 16, zero_com=zero_com)


def build_flow(config: SetsConfig, dim: int, set_size: int, zero_com: bool) -> SetFlow:
    """The flow ``config`` describes, for sets of up to ``set_size`` elements in R^dim."""
    small = set_size * dim <= 64
    interaction = resolved_interaction(config, zero_com)
    location = config.location and not zero_com and interaction != "none"
    manybody = config.manybody
    if manybody is None:  # on by default wherever radial residual blocks are built
        manybody = config.flow == "resflow" and interaction == "radial"
    radial_only = {"manybody": manybody, "radial_max_slope": config.radial_max_slope,
                   "radial_inverse": config.radial_inverse}
    for name, value in radial_only.items():
        if value not in (False, None) and (config.flow != "resflow" or interaction != "radial"):
            raise RunError(f"{name} is a setting of radial interactions: use it with "
                           f"flow=resflow and interaction=radial (here {config.flow}, "
                           f"{interaction})")
    if config.flow == "resflow":
        if config.field != "auto":
            raise RunError(f"field={config.field!r} is a setting of continuous flows: use it "
                           "with flow=cnf")
        logdet = config.train_logdet
        if logdet == "auto":  # radial branches decide themselves (closed-form Jacobians)
            logdet = "exact" if small else ("auto" if interaction == "radial" else "roulette")
        return set_flow(
            dim,
            config.blocks,
            _heads_for(dim, config.heads),
            hidden=config.hidden,
            coeff=config.coeff,
            zero_com=zero_com,
            norm="2" if zero_com else "inf",
            interaction=interaction,
            mlp=config.mlp,
            radial_basis=config.radial_basis,
            radial_range=config.radial_range,
            manybody=manybody,
            radial_max_slope=config.radial_max_slope,
            radial_inverse=config.radial_inverse,
            location=location,
            logdet=LogDetOptions(logdet),
        )
    if config.interaction not in ("auto", "attention"):
        raise RunError(f"interaction={config.interaction!r} is a residual-flow setting: "
                       "use flow=resflow")
    from ..flows.continuous.cnf import CNF

    divergence = config.divergence
    if divergence == "auto":
        divergence = "exact" if small else "hutchinson"
    field = _build_field(config, dim, zero_com)
    # likelihoods are reported with the exact trace wherever it is affordable
    cnf = CNF(field, t1=config.t1, atol=config.ode_tol, rtol=config.ode_tol,
              divergence=divergence, eval_divergence="exact" if small else divergence,
              zero_com=zero_com)
    if not location:
        return SetFlow(cnf, dim, zero_com)
    return SetFlow(CompositeTransform([SetLocation(dim), cnf]), dim, zero_com)
