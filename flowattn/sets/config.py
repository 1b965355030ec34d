"""Settings of a ``flowattn sets fit`` run, and the flow they describe.

:class:`SetsRunConfig` has three sections: ``data`` (:class:`SetsData`), ``flow``
(:class:`SetsFlow`) and ``train`` (the shared :class:`~flowattn.training.config.TrainSettings`
with this command's defaults). Types, ranges and the combinations that do not depend on the
data are checked when the config is built; :func:`build_flow` checks the rest against the data.
The settings classes import no torch (the command line builds its parser from them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import model_validator

from ..errors import ConfigError
from ..training.config import Field, RunConfig, Section, TrainSettings

__all__ = ["SetsData", "SetsFlow", "SetsTrain", "SetsRunConfig", "build_flow", "check_applicable",
           "resolved_interaction", "resolved_field", "legacy_settings", "PRESETS",
           "DATA_DEFAULTS", "MIRROR_DATA", "apply_preset", "apply_symmetry"]

INTERACTIONS = ("attention", "radial", "linear", "none")
# built-in data sets whose set size is a setting (flowattn.data.SIZED_DATASETS; no torch here)
SIZED_DATA = ("surface-clouds",)
# built-in data sets with a known energy (flowattn.data.PARTICLE_SYSTEMS; no torch here)
PARTICLE_DATA = ("dw4", "lj13", "lj55")
# built-in data sets whose density keeps under the mirror images x -> x diag(±1) through the
# coordinate axes (flowattn.data.shapes; checked by the tests to 1e-13): their flows take
# symmetry reflections where none is given (docs/benchmarks.md, "Mirror images")
MIRROR_DATA = ("shape-sets", "shape-sets-varsize")
# Probes per round of an estimated log-det in evaluation (N D > 512; smaller sets are exact).
# Rounds continue until the standard error is <= 2e-3 nats per dimension; Hutchinson's standard
# error per dimension falls as 1 / sqrt(N D), so at N D = 3000 the first round of 4 probes is
# already well below it (about 2e-4 per set, on 100 test sets of N = 1000), and 16 (the
# library's default) would cost 4 times more.
EVAL_PROBES = 4
COUPLING_SETTINGS = ("coupling_layers", "coupling_hidden", "coupling_blocks", "coupling_bins")

# Named settings for data that are not Gaussian: set-coupling flows (exact log-det, so no
# estimator to choose) of growing depth and training length, scored with a moving average of
# their parameters and ending with the average of lowest validation loss. Each was measured on
# shape-sets (docs/benchmarks.md, "Presets and the flattened baseline" and "The presets with a
# moving average of their parameters"); a setting the user gives wins.
_COUPLING = {"flow": "coupling", "coupling_hidden": 64, "coupling_blocks": 2,
             "coupling_bins": 8, "keep_best": True, "ema": 0.999}
PRESETS: dict[str, dict[str, Any]] = {
    "small": {**_COUPLING, "coupling_layers": 8, "steps": 1500},
    "medium": {**_COUPLING, "coupling_layers": 8, "steps": 3000},
    "large": {**_COUPLING, "coupling_layers": 12, "steps": 4500},
}


# Defaults of their own for built-in data sets, used by a residual flow with radial interactions
# where no preset and no value is given. Each is the best setting measured within about an hour
# of one CPU core (docs/benchmarks.md, "Particle systems" and "Sets that need interactions"):
# DW4 reaches a test NLL of 7.47, LJ13 20.37 (the general defaults: 7.98 and 22.75); LJ55's
# keeps a run at 3 s a step to about 20 minutes (test NLL 170.9). repulsive-sets, whose
# elements repel in pairs, gets monotone radial blocks in place of attention (1.496 nats/dim
# against 1.679 with attention; truth 1.476): its defaults apply where the interaction is not
# given or is radial.
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "dw4": {"blocks": 12, "mlp": False, "coeff": 0.97, "radial_max_slope": 4.0,
            "steps": 12000, "batch_size": 128, "warmup": 100, "eval_every": 1000,
            "checkpoint_every": 1000, "val_sets": 1000, "compile": True},
    "lj13": {"blocks": 8, "mlp": False, "radial_max_slope": 4.0, "steps": 5000, "warmup": 100,
             "eval_every": 500, "checkpoint_every": 500, "keep_best": True, "compile": True},
    "lj55": {"blocks": 8, "mlp": False, "radial_basis": 32, "steps": 400, "batch_size": 32,
             "warmup": 50, "eval_every": 100, "checkpoint_every": 100, "val_sets": 200},
    "repulsive-sets": {"interaction": "radial", "radial_max_slope": 4.0},
}


def _describe_presets() -> str:
    return "; ".join(f"{name}: {v['coupling_layers']} coupling layers of width "
                     f"{v['coupling_hidden']}, {v['steps']} steps, parameter average {v['ema']}"
                     for name, v in PRESETS.items())


class SetsData(Section):
    """Which sets the flow is fitted to."""

    data: str = Field("gaussian-sets", description="built-in data set (gaussian-sets, "
                      "cluster-sets, shape-sets, shape-sets-varsize, repulsive-sets, "
                      "surface-clouds, dw4, lj13, lj55) or a .npz file with x (M, N, D) and an "
                      "optional mask (M, N)", json_schema_extra={"metavar": "DATA"})
    num_train: int | None = Field(None, ge=1, description="size of a built-in training split "
                                  "(none: the data set's default)")
    set_size: int | None = Field(None, ge=1, description="elements per set of a data set that "
                                 "takes a size (surface-clouds; none: its default, 1000)")
    val_sets: int = Field(500, ge=1, description="validation sets scored at each evaluation")
    augment: Literal["none", "rotations", "reflections"] = Field(
        "none", description="rotations: each training set rotated and reflected about its "
        "centroid at random (Haar on O(D)) every time it is drawn; only for data whose density "
        "does not change under that, such as particle systems; reflections: each training set "
        "mirrored through the coordinate axes (x -> x diag(±1), about the origin, all 2^D sign "
        "patterns equally likely); only for data whose density does not change under that, "
        "such as shape-sets")

    @model_validator(mode="after")
    def _check_set_size(self) -> SetsData:
        if self.set_size is not None and self.data not in SIZED_DATA:
            raise ValueError(f"set_size={self.set_size} applies to {', '.join(SIZED_DATA)}; "
                             f"the sets of {self.data!r} have a fixed size: drop set_size")
        if self.num_train is not None and self.data.endswith(".npz"):
            raise ValueError(f"num_train={self.num_train} sizes a built-in data set's training "
                             f"split; {self.data!r} is split 90/10 into train and val: drop "
                             "num_train (or pass a file of fewer sets)")
        return self


class SetsFlow(Section):
    """The flow: a residual flow of contractive blocks, a continuous flow or a coupling flow.

    ``interaction`` chooses how elements meet in the residual flow: contractive L2 attention,
    ``radial`` (an E(n)-equivariant pairwise interaction, for particles), or the baselines
    ``linear`` and ``none``; ``auto`` is ``radial`` for particle data (zero centre of mass) and
    ``attention`` otherwise. ``field`` chooses the vector field of a continuous flow:
    ``attention`` or ``egnn`` (:class:`~flowattn.flows.EGNNField`); ``auto`` is the graph
    network for particles. ``coupling`` stacks :class:`~flowattn.flows.coupling.SetCoupling`
    layers (element-wise splines conditioned by unconstrained attention over the set; exact
    log-det and inverse), with ``coupling_*`` settings and ``heads``, ``location``.
    """

    preset: Literal["none", "small", "medium", "large"] = Field(
        "none", description="named settings for non-Gaussian data, overridden by any "
        f"setting given ({_describe_presets()}; exact log-det); none: the defaults below")
    flow: Literal["resflow", "cnf", "coupling"] = Field(
        "resflow", description="resflow: invertible residual blocks; cnf: a continuous flow; "
        "coupling: set-coupling layers with spline transforms")
    interaction: Literal["auto", "attention", "radial", "linear", "none"] = Field(
        "auto", description="how elements interact in a resflow (auto: radial for particles, "
        "else attention)")
    blocks: int = Field(4, ge=1, description="residual blocks")
    heads: int = Field(1, ge=1, description="attention heads (must divide the data's D)")
    hidden: int = Field(64, ge=1, description="hidden width of the residual branches")
    coeff: float = Field(0.9, gt=0, lt=1, description="Lipschitz coefficient of every "
                         "contractive branch")
    mlp: bool = Field(True, description="a pointwise Lipschitz-MLP residual in every block")
    activation: Literal["lipswish", "clipswish"] = Field(
        "lipswish", description="resflow: activation of the Lipschitz MLPs (clipswish: "
        "concatenated LipSwish, twice the width into the next layer)")
    location: bool = Field(True, description="a spline flow of each set's centroid first (not "
                           "for particles, nor interaction none)")
    splines: bool = Field(False, description="resflow: an element-wise spline coupling in "
                          "every block, before the interaction (needs D >= 2; not for "
                          "particles)")
    pair_splines: bool = Field(False, description="resflow: a layer of pair splines in every "
                               "block, before the interaction (each pair of elements moved "
                               "along its axis by a monotone spline of its log-distance, in "
                               "round-robin order: for particles with a hard core; the density "
                               "is then E(n)-invariant but not exactly exchangeable)")
    inducing_points: int | None = Field(
        None, ge=1, description="resflow attention: pool each head through this many learnt "
        "inducing points (induced-point attention, O(N M): for sets of thousands of "
        "elements); none: full attention, O(N^2)")
    attention_width: int | None = Field(
        None, ge=1, description="resflow attention: tied L2 attention among this many learnt "
        "features of each element, read back to D (lifted attention, certified in the mixed "
        "norm; heads must divide it: for narrow elements such as points in 2-D, where "
        "attention on the coordinates has a D x D metric per head); none: attention on the "
        "coordinates")
    train_logdet: Literal["auto", "exact", "series", "roulette"] = Field(
        "auto", description="log-det estimator in training (auto: exact when N D <= 64, radial "
        "<= 512; else Russian roulette)")
    radial_basis: int = Field(64, ge=1, description="radial: Gaussian bumps of psi'")
    radial_range: float = Field(4.0, gt=0, description="radial: the largest bump centre "
                                "(units after ActNorm)")
    manybody: bool | None = Field(None, description="radial: add NeighbourhoodInteraction "
                                  "residuals (none: yes with radial blocks)")
    radial_max_slope: float | None = Field(None, gt=0, description="radial: monotone blocks "
                                           "with psi' <= this (none: contractive blocks)")
    radial_inverse: bool = Field(False, description="radial: every second monotone block "
                                 "inverted (needs radial_max_slope)")
    field: Literal["auto", "attention", "egnn"] = Field(
        "auto", description="cnf: vector field (auto: egnn for particles, else attention)")
    field_layers: int | None = Field(None, ge=1, description="cnf: field layers (none: 2 for "
                                     "attention, 3 for egnn)")
    field_hidden: int | None = Field(None, ge=1, description="cnf: field width (none: 16 for "
                                     "attention, 32 for egnn)")
    t1: float = Field(1.0, gt=0, description="cnf: integration time")
    ode_tol: float = Field(1e-4, gt=0, description="cnf: absolute and relative ODE tolerance")
    objective: Literal["likelihood", "matching"] = Field(
        "likelihood", description="cnf: what training minimises (likelihood: the NLL through "
        "ODE solves; matching: conditional flow matching, one field evaluation per set and no "
        "solve, for a continuous flow alone, location false on non-particle data); the "
        "reported validation and test NLLs are the ODE's either way")
    alignment: Literal["none", "permutation", "euclidean"] = Field(
        "none", description="matching: each base draw moved towards the set it is paired "
        "with before the path is drawn (permutation: its elements reordered; euclidean: "
        "also turned by an orthogonal map, for particle systems; the draws stay standard "
        "normal when the data's law is invariant under these maps)")
    adjoint: bool = Field(False, description="cnf trained by likelihood: backpropagate by "
                          "solving the adjoint ODE backwards (memory independent of the "
                          "solver's steps, a second solve per step; E-NF's practice) instead "
                          "of through the forward solve's steps")
    kinetic_weight: float = Field(0.0, ge=0, description="cnf: weight of RNODE's kinetic "
                                  "energy int ||f||^2 dt in the training loss (per dimension, "
                                  "as the NLL; 0: not integrated)")
    jacobian_weight: float = Field(0.0, ge=0, description="cnf: weight of RNODE's Jacobian "
                                   "Frobenius norm int ||df/dz||_F^2 dt in the training loss "
                                   "(per dimension; 0: not integrated)")
    energy_weight: float = Field(0.0, ge=0, description="built-in particle systems (dw4, "
                                 "lj13, lj55): weight of the reverse KL E_q[E(x) + log q(x)] "
                                 "over configurations drawn from the flow, beside the NLL "
                                 "(training by energy; per dimension, as the NLL; 0: none "
                                 "drawn)")
    energy_samples: int | None = Field(None, ge=1, description="with energy_weight: "
                                       "configurations drawn per step (none: the batch size)")
    energy_max: float = Field(100.0, description="with energy_weight: energies above it count "
                              "as E_max + log(1 + E - E_max) in the reverse KL")
    divergence: Literal["auto", "exact", "hutchinson"] = Field(
        "auto", description="cnf: divergence in training (auto: exact when N D <= 64)")
    eval_divergence: Literal["auto", "exact", "hutchinson"] = Field(
        "auto", description="cnf: divergence of the validation and test NLLs (auto: exact "
        "when N D <= 64, else the training divergence; hutchinson: one probe per set, "
        "unbiased, its noise in the reported sampling error; E-NF's practice for LJ13)")
    coupling_layers: int | None = Field(None, ge=1, description="coupling: coupling layers "
                                        "(none: 8); resflow: set-coupling layers after the "
                                        "residual blocks, on the base side (none: no such "
                                        "layers)")
    coupling_hidden: int | None = Field(None, ge=1, description="coupling, or resflow with "
                                        "coupling_layers: conditioner width (none: 64)")
    coupling_blocks: int | None = Field(None, ge=0, description="coupling, or resflow with "
                                        "coupling_layers: attention blocks of each "
                                        "conditioner, 0: splines from each element's own "
                                        "features (none: 2)")
    coupling_bins: int | None = Field(None, ge=1, description="coupling, or resflow with "
                                      "coupling_layers: spline bins (none: 8)")
    symmetry: Literal["none", "reflections"] = Field(
        "none", description="reflections: the density is the flow's averaged over the 2^D "
        "mirror images through the coordinate axes, p(X) = 2^-D sum_S q(X S), S = diag(±1), "
        "exactly invariant under them (2^D flow passes per evaluation); training maximises "
        "the lower bound E_S log q(X S) on training sets mirrored at random; only for data "
        "whose density does not change under these reflections; not given: reflections for "
        f"the built-in {' and '.join(MIRROR_DATA)} (unless augment is rotations), else none")

    @model_validator(mode="after")
    def _check_combinations(self) -> SetsFlow:
        if self.radial_inverse and self.radial_max_slope is None:
            raise ValueError("radial_inverse needs radial_max_slope (monotone radial blocks)")
        radial_only = {"manybody": self.manybody, "radial_max_slope": self.radial_max_slope,
                       "radial_inverse": self.radial_inverse}
        for name, value in radial_only.items():
            if value not in (False, None) and (self.flow != "resflow" or
                                               self.interaction not in ("auto", "radial")):
                raise ValueError(f"{name} is a setting of radial interactions: use it with "
                                 f"flow=resflow and interaction=radial (here {self.flow}, "
                                 f"{self.interaction})")
        if self.flow != "cnf" and self.eval_divergence != "auto":
            raise ValueError(f"eval_divergence is a setting of continuous flows: use it with "
                             f"flow=cnf (here {self.flow}, whose evaluation log-dets are "
                             "exact or estimated to a stated error on their own)")
        for name in ("kinetic_weight", "jacobian_weight"):
            if self.flow != "cnf" and getattr(self, name) > 0:
                raise ValueError(f"{name} is a setting of continuous flows: use it with "
                                 f"flow=cnf (here {self.flow})")
        if self.adjoint and (self.flow != "cnf" or self.objective == "matching"):
            raise ValueError("adjoint backpropagates through a continuous flow's solves: use "
                             f"it with flow=cnf and objective=likelihood (here {self.flow}, "
                             f"{self.objective})")
        if self.objective == "matching":
            if self.flow != "cnf":
                raise ValueError(f"objective=matching trains continuous flows: use it with "
                                 f"flow=cnf (here {self.flow})")
            if self.kinetic_weight > 0 or self.jacobian_weight > 0:
                raise ValueError("kinetic_weight and jacobian_weight penalise the solves of "
                                 "likelihood training; objective=matching solves nothing")
        elif self.alignment != "none":
            raise ValueError(f"alignment={self.alignment!r} is a setting of flow matching: use "
                             "it with objective=matching")
        if self.flow != "cnf" and self.field != "auto":
            raise ValueError(f"field={self.field!r} is a setting of continuous flows: use it "
                             "with flow=cnf")
        if self.flow == "cnf" and self.interaction not in ("auto", "attention"):
            raise ValueError(f"interaction={self.interaction!r} is a residual-flow setting: "
                             "use flow=resflow")
        if self.flow == "coupling" and self.interaction != "auto":
            raise ValueError(f"interaction={self.interaction!r} is a residual-flow setting: "
                             "use flow=resflow (a coupling flow's interaction is its "
                             "conditioner, coupling_blocks)")
        if self.inducing_points is not None and (
                self.flow != "resflow" or self.interaction not in ("auto", "attention")):
            raise ValueError("inducing_points is a setting of attention in residual flows: use "
                             f"it with flow=resflow and interaction=attention (here {self.flow}, "
                             f"{self.interaction})")
        if self.attention_width is not None and (
                self.flow != "resflow" or self.interaction not in ("auto", "attention")
                or self.inducing_points is not None):
            raise ValueError("attention_width is a setting of full attention in residual flows: "
                             "use it with flow=resflow, interaction=attention and no "
                             f"inducing_points (here {self.flow}, {self.interaction}, "
                             f"inducing_points={self.inducing_points})")
        if self.activation != "lipswish" and self.flow != "resflow":
            raise ValueError("activation is a setting of the Lipschitz MLPs of residual flows: "
                             f"use it with flow=resflow (here {self.flow})")
        for name in ("splines", "pair_splines"):
            if getattr(self, name) and self.flow != "resflow":
                raise ValueError(f"{name} is a setting of residual flows: use it with "
                                 f"flow=resflow (here {self.flow})")
        if self.flow == "cnf" and self.energy_weight > 0:
            raise ValueError("energy_weight is a setting of residual and coupling flows: a "
                             "continuous flow's samples would need the solver's graph (use "
                             "flow=resflow or flow=coupling)")
        if self.symmetry != "none" and self.energy_weight > 0:
            raise ValueError("symmetry averages the density over reflections, which training "
                             "by energy does not: use energy_weight 0 or symmetry none")
        if self.energy_samples is not None and self.energy_weight == 0:
            raise ValueError("energy_samples sets how many configurations training by energy "
                             "draws: give energy_weight > 0 too, or energy_samples none")
        for name in COUPLING_SETTINGS:
            if self.flow == "cnf" and getattr(self, name) is not None:
                raise ValueError(f"{name} is a setting of coupling flows: use it with "
                                 f"flow=coupling, or flow=resflow with coupling_layers "
                                 f"(here {self.flow})")
            if (self.flow == "resflow" and self.coupling_layers is None
                    and getattr(self, name) is not None):
                raise ValueError(f"{name} shapes the coupling layers of a residual flow: give "
                                 "coupling_layers too")
        return self


SetsTrain = TrainSettings.with_defaults(
    "SetsTrain", steps=1500, batch_size=64, lr=3e-3, schedule="cosine", warmup=50,
    min_lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, grad_clip=10.0,
    divergence_factor=None, eval_every=250, checkpoint_every=250, log_every=10, seed=0,
    device="cpu")


class SetsRunConfig(RunConfig):
    """Every setting of a ``flowattn sets fit`` run.

    Examples:
        >>> config = SetsRunConfig.build({"data": "dw4", "blocks": 8, "steps": 100})
        >>> config.data.data, config.flow.blocks, config.train.steps, config.train.lr
        ('dw4', 8, 100, 0.003)
    """

    # training by energy may be switched on, off or reweighted on resume: fine-tuning a
    # maximum-likelihood run by energy (the loss changes, the state and its shapes do not)
    RESUMABLE: ClassVar[frozenset[str]] = frozenset(
        {"steps", "device", "threads", "compile", "eval_every", "checkpoint_every",
         "log_every", "val_sets", "energy_weight", "energy_samples", "energy_max"})
    PATHS: ClassVar[frozenset[str]] = frozenset({"data"})

    data: SetsData = SetsData()
    flow: SetsFlow = SetsFlow()
    train: SetsTrain = SetsTrain()

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, values: Any) -> Any:
        return apply_symmetry(apply_preset(values)) if isinstance(values, Mapping) else values

    @model_validator(mode="after")
    def _check_symmetry(self) -> SetsRunConfig:
        if self.flow.symmetry == "reflections" and self.data.augment == "rotations":
            raise ValueError("symmetry reflections trains on sets mirrored at random; "
                             "augment rotations would turn them too: use augment none or "
                             "reflections")
        return self

    @model_validator(mode="after")
    def _check_energy(self) -> SetsRunConfig:
        if self.flow.energy_weight > 0 and self.data.data not in PARTICLE_DATA:
            raise ValueError(f"energy_weight needs a known energy: the built-in particle "
                             f"systems ({', '.join(PARTICLE_DATA)}), not {self.data.data!r}")
        return self

    @classmethod
    def from_stored(cls, values: Mapping[str, Any], source: str = "") -> SetsRunConfig:
        """The settings an earlier run stored: those it stored without ``keep_best`` (written
        before the setting existed, and before the presets turned it on) ended with their last
        state, and keep doing so; those stored without ``symmetry`` scored the flow's own
        density, and keep doing so on any data.

        Examples:
            >>> stored = {"flow": {"preset": "large"}, "train": {"steps": 4500}}
            >>> SetsRunConfig.from_stored(stored).train.keep_best
            False
        """
        nested = cls.nest(values, source or "stored settings")
        train = nested.setdefault("train", {})
        train.setdefault("keep_best", False)
        nested.setdefault("flow", {}).setdefault("symmetry", "none")  # stored before it existed
        return cls.build(nested, source)


def apply_preset(values: Mapping[str, Any]) -> dict[str, Any]:
    """Nested settings with the values of their ``preset``, or of their data set's own
    defaults (:data:`DATA_DEFAULTS`), filled in where none is given.

    A setting given explicitly (in a file, a flag, or a stored run's config, where every
    setting is explicit) keeps its value; ``preset: none`` or an unknown name (refused by the
    field's check) changes nothing. A data set's own defaults apply only to the flow they were
    measured with: a residual flow (``flow`` not given or ``resflow``) with radial interactions
    (``interaction`` not given, ``auto`` or ``radial``; for a data set whose defaults name the
    interaction, not given or that one) and no preset.

    Raises:
        ValueError: if ``flow`` is given and differs from the preset's flow type (the preset's
            depth and width would not apply).

    Examples:
        >>> apply_preset({"flow": {"preset": "large"}, "train": {"steps": 100}})["train"]
        {'steps': 100, 'keep_best': True, 'ema': 0.999}
        >>> apply_preset({"flow": {"preset": "large"}})["flow"]["coupling_layers"]
        12
        >>> apply_preset({"data": {"data": "dw4"}, "flow": {"blocks": 6}})["flow"]["blocks"]
        6
        >>> apply_preset({"data": {"data": "dw4"}})["train"]["steps"]
        12000
        >>> apply_preset({"data": {"data": "dw4"}, "flow": {"flow": "cnf"}}).get("train")
    """
    out = {key: dict(value) if isinstance(value, Mapping) else value
           for key, value in values.items()}
    flow = out.get("flow")
    flow = flow if isinstance(flow, dict) else {}
    name = flow.get("preset", "none")
    if isinstance(name, str) and name in PRESETS:
        chosen = PRESETS[name]
        if flow.get("flow", chosen["flow"]) != chosen["flow"]:
            raise ValueError(f"preset={name!r} is a {chosen['flow']} flow, but flow="
                             f"{flow['flow']!r} was given: drop one of them")
    else:
        data = out.get("data")
        data = data.get("data") if isinstance(data, dict) else None
        radial_flow = (name == "none" and flow.get("flow", "resflow") == "resflow"
                       and flow.get("interaction", "auto") in ("auto", "radial"))
        if not (radial_flow and isinstance(data, str) and data in DATA_DEFAULTS):
            return out
        chosen = DATA_DEFAULTS[data]
        wanted = chosen.get("interaction")
        if wanted is not None and flow.get("interaction", wanted) != wanted:
            return out  # measured with radial interactions: an explicit auto keeps attention
    from ..training import device  # (imports torch: not before a data set's defaults apply)

    leaves = SetsRunConfig.leaves()
    for key, value in chosen.items():
        if key == "compile" and device.cpp_compiler() is None:
            continue  # compiled where torch.compile can build kernels, else eager
        section = out.setdefault(leaves[key][0], {})
        if isinstance(section, dict):
            section.setdefault(key, value)
    return out


def apply_symmetry(values: Mapping[str, Any]) -> dict[str, Any]:
    """Nested settings with ``symmetry: reflections`` filled in for the built-in data sets whose
    density keeps under the mirror images through the coordinate axes (:data:`MIRROR_DATA`),
    where no symmetry is given and the training sets are not turned at random (``augment:
    rotations``, which the mirror average refuses).

    Examples:
        >>> apply_symmetry({"data": {"data": "shape-sets"}})["flow"]
        {'symmetry': 'reflections'}
        >>> apply_symmetry({"data": {"data": "shape-sets"}, "flow": {"symmetry": "none"}})["flow"]
        {'symmetry': 'none'}
        >>> apply_symmetry({"data": {"data": "cluster-sets"}}).get("flow")
    """
    out = {key: dict(value) if isinstance(value, Mapping) else value
           for key, value in values.items()}
    data = out.get("data")
    data = data if isinstance(data, dict) else {}
    if data.get("data") in MIRROR_DATA and data.get("augment", "none") != "rotations":
        flow = out.setdefault("flow", {})
        if isinstance(flow, dict):
            flow.setdefault("symmetry", "reflections")
    return out


def legacy_settings(settings: dict) -> dict:
    """The settings of a checkpoint of format version 1 (one flat dict), as a nested config.

    Settings that did not exist when it was written take the values its flow was built with.
    """
    settings = dict(settings)
    if "field" not in settings:  # before the field setting: attention, 2 layers of width 16
        settings["field"] = "attention" if settings.get("flow") == "cnf" else "auto"
        for name, old_default in (("field_layers", 2), ("field_hidden", 16)):
            if settings.get(name) == old_default:
                settings[name] = None  # now "the field's default", which is the same
    settings = {"location": False, "radial_basis": 32, "radial_range": 6.0, "manybody": False,
                "symmetry": "none", **settings}
    # a data set's own defaults came later: what such a run did not store, it ran without
    leaves = SetsRunConfig.leaves()
    for key in {key for chosen in DATA_DEFAULTS.values() for key in chosen}:
        settings.setdefault(key, leaves[key][1].get_default(call_default_factory=True))
    if settings.get("grad_clip") == 0:
        settings["grad_clip"] = None
    return SetsRunConfig.nest(settings, "checkpoint settings")


# Settings typed on the command line that a flow of another kind would not read: refused by
# check_applicable (the validator above refuses the non-default values it can tell apart; these
# have defaults a stored or preset configuration holds whatever the flow, so only what the user
# typed is checked).
_RESIDUAL_ONLY = ("blocks", "hidden", "coeff", "mlp", "train_logdet")
_CONTINUOUS_ONLY = ("t1", "ode_tol", "divergence", "field_layers", "field_hidden")
_RADIAL_ONLY = ("radial_basis", "radial_range")
_ENERGY_ONLY = ("energy_samples", "energy_max")


def check_applicable(flags: Mapping[str, Any], config: SetsRunConfig) -> None:
    """Refuse settings given on the command line (``flags``, flat) that the flow ``config``
    builds would not read, so that no typed setting is ignored in silence.

    Raises:
        ConfigError: naming the first such setting and the kind of flow it belongs to.

    Examples:
        >>> config = SetsRunConfig.build({"flow": {"flow": "coupling"}})
        >>> check_applicable({"coupling_layers": 4}, config)  # read: fine
        >>> try:
        ...     check_applicable({"blocks": 7}, config)
        ... except ConfigError as err:
        ...     print(str(err).split(",")[0])
        blocks is a setting of residual flows (flow=resflow)
    """
    flow = config.flow
    kinds = {"coupling": "a coupling flow's depth and width are coupling_layers and "
                         "coupling_hidden",
             "cnf": "a continuous flow's depth and width are field_layers and field_hidden"}
    unread: dict[str, str] = {}
    if flow.flow != "resflow":
        for name in _RESIDUAL_ONLY:
            unread[name] = (f"a setting of residual flows (flow=resflow), which this run does "
                            f"not build (flow={flow.flow}): {kinds[flow.flow]}")
    if flow.flow != "cnf":
        for name in _CONTINUOUS_ONLY:
            unread[name] = (f"a setting of continuous flows (flow=cnf), which this run does not "
                            f"build (flow={flow.flow})")
    # auto is radial for the particle systems (a zero centre of mass), the only data that have
    # one: a built-in name, which wins over a file of that name
    from ..data import PARTICLE_SYSTEMS

    interaction = resolved_interaction(flow, config.data.data in PARTICLE_SYSTEMS)
    if flow.flow != "resflow" or interaction != "radial":
        auto = f" (auto, for data={config.data.data})" if flow.interaction == "auto" else ""
        for name in _RADIAL_ONLY:
            unread[name] = (f"a setting of radial interactions (flow=resflow, "
                            f"interaction=radial; here flow={flow.flow}, "
                            f"interaction={interaction}{auto})")
    if flow.energy_weight == 0:
        for name in _ENERGY_ONLY:
            unread[name] = "a setting of training by energy: it needs energy_weight > 0"
    if flow.interaction == "none" and flags.get("location"):
        unread["location"] = ("not built with interaction=none (each element transformed "
                              "alone: no set-level centroid)")
    for name in flags:
        if name in unread:
            raise ConfigError(f"{name} is {unread[name]}")


def resolved_interaction(flow: SetsFlow, zero_com: bool) -> str:
    """The interaction a residual flow uses: ``auto`` is radial for particles, else attention."""
    if flow.interaction != "auto":
        return flow.interaction
    return "radial" if zero_com else "attention"


def resolved_field(flow: SetsFlow, zero_com: bool) -> str:
    """The vector field a continuous flow uses: ``auto`` is egnn for particles, else attention."""
    if flow.field != "auto":
        return flow.field
    return "egnn" if zero_com else "attention"


def _build_field(flow: SetsFlow, dim: int, zero_com: bool):
    from ..flows.continuous.egnn import EGNNField
    from ..flows.continuous.fields import AttentionField

    if resolved_field(flow, zero_com) == "egnn":
        return EGNNField(dim, hidden=flow.field_hidden or 32, layers=flow.field_layers or 3,
                         zero_com=zero_com)
    return AttentionField(dim, heads=flow.heads, layers=flow.field_layers or 2,
                          hidden=flow.field_hidden or 16, zero_com=zero_com)


def build_flow(flow: SetsFlow, dim: int, set_size: int, zero_com: bool) -> Any:
    """The flow ``flow`` describes, for sets of up to ``set_size`` elements in R^dim.

    Raises:
        ConfigError: for settings that do not fit the data (heads not dividing D, radial
            settings where the interaction resolves to another one, a coupling flow on
            one-dimensional elements).
    """
    built = _build_flow(flow, dim, set_size, zero_com)
    built.symmetry = flow.symmetry
    return built


def _build_flow(flow: SetsFlow, dim: int, set_size: int, zero_com: bool) -> Any:
    from nflows.transforms import CompositeTransform

    from ..flows.builders import set_flow
    from ..flows.layers import SetLocation
    from ..flows.logdet import LogDetOptions
    from ..flows.setflow import SetFlow

    if flow.flow == "coupling":
        return _build_coupling(flow, dim, zero_com)
    if flow.attention_width is not None:
        if flow.attention_width % flow.heads != 0:
            raise ConfigError(f"heads={flow.heads} must divide attention_width="
                              f"{flow.attention_width}")
    elif dim % flow.heads != 0:
        raise ConfigError(f"heads={flow.heads} must divide the data dimension D={dim}")
    small = set_size * dim <= 64
    interaction = resolved_interaction(flow, zero_com)
    location = flow.location and not zero_com and interaction != "none"
    manybody = flow.manybody
    if manybody is None:  # on by default wherever radial residual blocks are built
        manybody = flow.flow == "resflow" and interaction == "radial"
    for name in ("radial_max_slope", "radial_inverse"):
        if getattr(flow, name) not in (False, None) and interaction != "radial":
            raise ConfigError(f"{name} is a setting of radial interactions, but the "
                              f"interaction here is {interaction}")
    if flow.manybody and interaction != "radial":
        raise ConfigError(f"manybody is a setting of radial interactions, but the interaction "
                          f"here is {interaction}")
    if flow.attention_width is not None and (interaction != "attention" or zero_com):
        raise ConfigError("attention_width is a setting of attention on sets without a zero "
                          f"centre of mass, but the interaction here is {interaction}"
                          + (" and the data have a zero centre of mass" if zero_com else ""))
    if flow.inducing_points is not None and interaction != "attention":
        raise ConfigError(f"inducing_points is a setting of attention, but the interaction "
                          f"here is {interaction}")
    if flow.splines and (zero_com or dim < 2):
        raise ConfigError("splines moves some coordinates of each element by splines of the "
                          "others: it needs elements of D >= 2 and no zero centre of mass "
                          f"(the data have D={dim}" + (", zero centre of mass)" if zero_com
                                                      else ")"))
    if flow.flow == "resflow":
        logdet = flow.train_logdet
        if logdet == "auto":  # radial branches decide themselves (closed-form Jacobians)
            logdet = "exact" if small else ("auto" if interaction == "radial" else "roulette")
        residual = set_flow(
            dim,
            flow.blocks,
            flow.heads,
            hidden=flow.hidden,
            coeff=flow.coeff,
            zero_com=zero_com,
            norm="2" if zero_com else "inf",
            interaction=interaction,
            mlp=flow.mlp,
            radial_basis=flow.radial_basis,
            radial_range=flow.radial_range,
            manybody=manybody,
            radial_max_slope=flow.radial_max_slope,
            radial_inverse=flow.radial_inverse,
            splines=flow.splines,
            pair_splines=flow.pair_splines,
            activation=flow.activation,
            location=location,
            logdet=LogDetOptions(logdet, eval_n_samples=EVAL_PROBES),
            attention=_induced_attention(flow.inducing_points),
            attention_width=flow.attention_width,
        )
        if flow.coupling_layers is None:
            return residual
        from ..flows.coupling import coupling_stack

        couplings = coupling_stack(dim, flow.coupling_layers, zero_com=zero_com,
                                   **_coupling_settings(flow, dim))
        steps = list(residual.transform._transforms) + couplings
        return SetFlow(CompositeTransform(steps), dim, zero_com)
    from ..flows.continuous.cnf import CNF

    divergence = flow.divergence
    if divergence == "auto":
        divergence = "exact" if small else "hutchinson"
    field = _build_field(flow, dim, zero_com)
    # likelihoods are reported with the exact trace wherever it is affordable, unless asked
    eval_divergence = flow.eval_divergence
    if eval_divergence == "auto":
        eval_divergence = "exact" if small else divergence
    cnf = CNF(field, t1=flow.t1, atol=flow.ode_tol, rtol=flow.ode_tol, adjoint=flow.adjoint,
              divergence=divergence, eval_divergence=eval_divergence,
              zero_com=zero_com, regularise=flow.kinetic_weight > 0 or flow.jacobian_weight > 0)
    if not location:
        return SetFlow(cnf, dim, zero_com)
    return SetFlow(CompositeTransform([SetLocation(dim), cnf]), dim, zero_com)


def _induced_attention(inducing: int | None) -> Any:
    """The attention factory of :func:`~flowattn.flows.set_flow` for ``inducing_points``: None
    (the default contractive L2 attention) or contractive induced-point attention, which is
    certified in the mixed norm whatever norm the flow asks for (any induced norm makes a
    residual block invertible)."""
    if inducing is None:
        return None
    from ..attention import ContractiveInducedL2MHA

    def build(dim: int, heads: int, coeff: float, norm: str) -> Any:
        return ContractiveInducedL2MHA(dim, heads, coeff, inducing=inducing)

    return build


def _build_coupling(flow: SetsFlow, dim: int, zero_com: bool) -> Any:
    from ..flows.coupling import coupling_flow

    return coupling_flow(dim, layers=flow.coupling_layers or 8,
                         location=flow.location and not zero_com, zero_com=zero_com,
                         **_coupling_settings(flow, dim))


def _coupling_settings(flow: SetsFlow, dim: int) -> dict[str, int]:
    """The shape of set-coupling layers, of a coupling flow or after a residual flow's blocks."""
    if dim < 2:
        raise ConfigError(f"a coupling layer splits the features of each element in two: it "
                          f"needs elements of D >= 2, the data have D={dim}")
    hidden = flow.coupling_hidden or 64
    if hidden % flow.heads != 0:
        raise ConfigError(f"heads={flow.heads} must divide the coupling conditioner's width "
                          f"coupling_hidden={hidden}")
    blocks = 2 if flow.coupling_blocks is None else flow.coupling_blocks
    return {"hidden": hidden, "blocks": blocks, "heads": flow.heads,
            "bins": flow.coupling_bins or 8}
