"""Settings of a character language model and of ``flowattn lm train`` runs (no torch here).

:class:`LMSettings` describes the network, :class:`LMConfig` adds the vocabulary size it is
built for, and :class:`LMRunConfig` nests the network settings beside the data and the shared
training settings (:class:`~flowattn.training.config.TrainSettings`). Every value is checked
when the object is built; errors name the key and the value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import model_validator

from ..errors import ConfigError
from ..training.config import Field, RunConfig, Section, TrainSettings

__all__ = ["LMSettings", "LMConfig", "LMData", "LMTrain", "LMRunConfig", "ATTENTIONS", "NORMS",
           "NORM_POSITIONS", "INITS", "MODELS", "FORMATS", "DEFAULT_CORPUS", "AUTO",
           "DEFAULTS_VERSION", "PLAIN_DEFAULTS", "TIED_L2_DEFAULTS", "VERSION_3_CHANGES",
           "VERSION_5_CHANGES", "SHAPE_DEFAULTS", "AUTO_TRAINING", "READOUTS", "auto_settings",
           "auto_training", "check_applicable"]

ATTENTIONS = ("dp", "l2", "l2-tied", "contractive-l2", "scaled-cosine", "none")
NORMS = ("layernorm", "centernorm", "actnorm", "none")
NORM_POSITIONS = ("pre", "post")
INITS = ("default", "glorot-l2", "lipschitz", "spectral")
MODELS = ("transformer", "lstm")
FORMATS = ("auto", "text", "ptb-char")
READOUTS = ("linear", "feed-forward")
DEFAULT_CORPUS = "builtin:pydoc-topics"

AUTO = "auto"
# 2: tied L2 attention has defaults of its own; 3: logit offsets certified by their weighted
# count of keys, and contractive attention reads a LayerNorm of gain 4; 4: the learning rate's
# "auto" depends on the model; 5: the invertible model reads its hidden states through a
# feed-forward readout (stored configs carry the version)
DEFAULTS_VERSION = 5
# What "auto" means for every model but tied L2 attention, and for every model under
# defaults_version 1 (the settings written before version 2 existed).
PLAIN_DEFAULTS: dict[str, Any] = {"self_offset": 0.0, "position_bias": 0.0, "init": "default",
                                  "init_scale": 1.0 / 16, "contractive_norm": "inf",
                                  "norm_gain": 1.0}
# What "auto" means for tied L2 attention under defaults_version 2, by (attention, invertible):
# the best measured row of each (benchmarks/lm.py variants; docs/benchmarks.md, "Letting tied
# attention read other tokens"), validation nats/char at nanoGPT's CPU budget against the
# plain defaults:
TIED_L2_DEFAULTS: dict[tuple[str, bool], dict[str, Any]] = {
    # l2-tied-offsets-glorot-s2: 1.9403 (plain: 2.4116)
    ("l2-tied", False): {"self_offset": 4.0, "position_bias": 4.0, "init": "glorot-l2",
                         "init_scale": 1.0 / 2, "contractive_norm": "inf", "norm_gain": 1.0},
    # contractive-l2-mixed-s4: 2.2052 (plain: 2.4823)
    ("contractive-l2", False): {"self_offset": 4.0, "position_bias": 4.0, "init": "glorot-l2",
                                "init_scale": 1.0 / 4, "contractive_norm": "2,inf",
                                "norm_gain": 1.0},
    # invertible-mixed: 2.4512 (plain: 2.4824)
    ("contractive-l2", True): {"self_offset": 4.0, "position_bias": 4.0, "init": "glorot-l2",
                               "init_scale": 1.0 / 16, "contractive_norm": "2,inf",
                               "norm_gain": 1.0},
}
# Version 3 changes contractive attention alone. Outside the invertible stack (benchmarks/lm.py
# variant contractive-l2-caps8, 2.0246 against 2.2050; 2.0432 with seed 1338): the
# pre-attention LayerNorm starts at gain 4, four times the branch's output, the L2 weights at
# s = 1/8 (logits as s = 1/2 at gain 1), and the offsets' caps are 8. Inside it (no LayerNorm
# to scale; variant invertible-s2, 2.4076 against 2.4512): the L2 weights at s = 1/2.
VERSION_3_CHANGES: dict[tuple[str, bool], dict[str, Any]] = {
    ("contractive-l2", False): {"init_scale": 1.0 / 8, "norm_gain": 4.0, "self_offset": 8.0,
                                "position_bias": 8.0},
    ("contractive-l2", True): {"init_scale": 1.0 / 2},
}
# What "auto" means for the shape of every network under every version but version 5's
# invertible model: nanoGPT's 4 heads and a linear readout (the final norm, then the output layer).
SHAPE_DEFAULTS: dict[str, Any] = {"heads": 4, "readout": "linear"}
# Version 5 changes the invertible model alone (benchmarks/lm.py variant
# invertible-readout-h8-s1-lr6-warmup400: 2.0292 / 2.0487 / 2.0704 / 2.0636, seeds
# 1337-1340, and 2.0280 / 2.0343 / 2.0669 / 2.0529 with the spectral norms from an
# eigensolver; 2.1177 / 2.1248 before; docs/benchmarks.md, "A readout for the invertible
# model"): a feed-forward readout between the invertible stack and the output layer (alone
# 2.0633 / 2.0765), 8 heads of 16 and the L2 weights at s = 1.
VERSION_5_CHANGES: dict[tuple[str, bool], dict[str, Any]] = {
    ("contractive-l2", True): {"readout": "feed-forward", "heads": 8, "init_scale": 1.0},
}

# What ``lr`` and ``warmup`` left as "auto" mean under defaults_version 4, by (attention,
# invertible): the peak learning rate and warm-up measured best at nanoGPT's CPU budget with
# version 3's network defaults (benchmarks/lm.py variants; docs/benchmarks.md); nanoGPT's 1e-3
# and 100 steps for every other model, and for every model under earlier versions (what every
# model trained with before version 4).
AUTO_TRAINING: dict[tuple[str, bool], dict[str, Any]] = {
    # l2-tied-lr2-warmup400: 1.8189 / 1.8261 (seeds 1337 / 1338), 1.9403 at 1e-3 after 100 steps
    # (1.9396 after 400: the rate, not the warm-up)
    ("l2-tied", False): {"lr": 2e-3, "warmup": 400},
    # contractive-l2-caps8-lr2-warmup400: 1.9813 / 1.9898 (seeds 1337 / 1338); 2.0197 / 2.0333
    # with 100 warm-up steps, 2.0246 / 2.0432 at 1e-3; 3e-3 with 400 warm-up steps 1.9882
    ("contractive-l2", False): {"lr": 2e-3, "warmup": 400},
    # invertible-lr6-warmup400: 2.1177 / 2.1248; 2.1376 / 2.1519 with 100 warm-up steps, 2.4076
    # at 1e-3; float32 invert-check 3.8e-5. Larger rates score better (1.2e-2: 2.0702) but
    # their float32 inverse misses invert-check's 1e-4 (8e-3: 1.2e-4; 1.2e-2: 1.3e-3)
    ("contractive-l2", True): {"lr": 6e-3, "warmup": 400},
}
NANOGPT_TRAINING: dict[str, Any] = {"lr": 1e-3, "warmup": 100}

# a logit offset's cap: flowattn.attention.offsets.MAX_OFFSET (not imported: no torch here;
# a test keeps the two equal)
_Cap = Annotated[float, Field(ge=0, le=80.0, allow_inf_nan=False)]
_Scale = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class LMSettings(Section):
    """Hyper-parameters of a character language model.

    ``attention``, ``norm`` and ``final_norm`` left as ``None`` resolve (in :class:`LMConfig`,
    the settings a model is built from) to defaults that depend on ``invertible``:
    contractive-l2 attention and a channel affine map (``actnorm``) inside the invertible
    stack, dot-product attention and LayerNorm otherwise; ``residual_alpha`` to 1 / layers.
    ``self_offset``, ``position_bias``, ``init``, ``init_scale``, ``contractive_norm``,
    ``norm_gain``, ``readout`` and ``heads`` left as ``"auto"`` resolve to what
    :func:`auto_settings` gives for the attention: measured defaults for tied L2 attention (and
    for the invertible model a feed-forward readout and 8 heads), the plain ones (no offsets,
    GPT-2 initialisation, a linear readout, 4 heads) for every other model.
    ``defaults_version`` fixes which table ``"auto"`` means, so that a stored config always
    rebuilds the model it trained.
    """

    block_size: int = Field(64, ge=1, description="context length T")
    model: Literal["transformer", "lstm"] = Field("transformer", description="network family")
    layers: int = Field(4, ge=1, description="Transformer blocks (or LSTM layers)")
    dim: int = Field(128, ge=1, description="model width D")
    heads: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        AUTO, description="attention heads H (auto: 8 with --invertible, 4 otherwise)")
    attention: Literal["dp", "l2", "l2-tied", "contractive-l2", "scaled-cosine",
                       "none"] | None = Field(
        None, description="attention type; none is the attention-free baseline (unset: dp, "
        "contractive-l2 with --invertible)")
    self_offset: _Cap | Literal["auto"] = Field(
        AUTO, description="cap of the learnt self-offsets of L2 attention (0: none; lets a "
        "token weight another above itself; auto: 8 for contractive-l2, 4 for l2-tied and "
        "with --invertible, else 0)")
    position_bias: _Cap | Literal["auto"] = Field(
        AUTO, description="cap of the learnt relative-position bias of L2 attention (0: none; "
        "auto: 8 for contractive-l2, 4 for l2-tied and with --invertible, else 0)")
    max_distance: int = Field(64, ge=1, description="relative positions beyond this share one "
                              "position bias")
    norm: Literal["layernorm", "centernorm", "actnorm", "none"] | None = Field(
        None, description="block normalisation; none: no normalisation (unset: layernorm; "
        "actnorm with --invertible)")
    norm_position: Literal["pre", "post"] = Field(
        "pre", description="pre: x + f(N(x)); post: N(x + f(x))")
    final_norm: Literal["layernorm", "centernorm", "actnorm", "none"] | None = Field(
        None, description="normalisation before the output layer; none: no normalisation "
        "(unset: the block norm for pre-norm models, none for post-norm ones, layernorm for "
        "invertible ones)")
    weighted_residual: bool = Field(False, description="LipsFormer residual x + alpha f(x), "
                                    "alpha learnable per channel")
    residual_alpha: float | None = Field(None, description="initial alpha (none: 1 / layers, "
                                         "Qi et al. 2023, Thm 2)")
    init: Literal["default", "glorot-l2", "lipschitz", "spectral", "auto"] = Field(
        AUTO, description="weight initialisation (default is GPT-2's; auto: glorot-l2 for "
        "l2-tied and contractive-l2, default otherwise)")
    init_scale: _Scale | Literal["auto"] = Field(
        AUTO, description="scale s of L2 attention weights under --init glorot-l2 (auto: 1/2 "
        "for l2-tied and with --invertible, 1/8 for contractive-l2 (1/4 post-norm), 1/16 "
        "otherwise)")
    norm_gain: _Scale | Literal["auto"] = Field(
        AUTO, description="initial gain of the normalisation before each attention branch "
        "(pre-norm LayerNorm or CenterNorm; auto: 4 for contractive-l2 in that position, else 1)")
    ff_mult: int = Field(4, ge=1, description="feed-forward hidden width as a multiple of D")
    readout: Literal["linear", "feed-forward", "auto"] = Field(
        AUTO, description="what reads the final hidden states: linear, the final norm and the "
        "output layer; feed-forward, a GELU feed-forward residual between the two, outside the "
        "residual stack (auto: feed-forward with --invertible, linear otherwise)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability")
    bias: bool = Field(False, description="biases in linear layers and norms")
    tie_embeddings: bool = Field(False, description="share the token embedding with the output "
                                 "layer")
    invertible: bool = Field(False, description="contractive blocks: embeddings -> hidden "
                             "states is invertible")
    contractive_coeff: float = Field(0.9, gt=0, lt=1, description="Lipschitz coefficient of "
                                     "contractive branches")
    contractive_norm: Literal["inf", "2,inf", "2", "auto"] = Field(
        AUTO, description="norm in which contractive attention is certified (2,inf: the "
        "largest token's 2-norm, no sqrt(D) of the inf-norm; auto: 2,inf for contractive-l2, "
        "inf otherwise)")
    spectral_norms: Literal["eigh", "squarings"] = Field(
        "eigh", description="how contractive attention's certificate takes its spectral norms: "
        "eigh, exact from an eigensolver; squarings, a certified upper bound from matrix "
        "products (about 1e-6 above, no host synchronisation: much faster on a GPU)")
    ortho_attention: float = Field(0.0, ge=0, description="orthogonality loss on attention "
                                   "weights (lambda)")
    ortho_ff: float = Field(0.0, ge=0, description="orthogonality loss on feed-forward weights "
                            "(lambda)")
    ortho_affinity: float = Field(0.0, ge=0, description="orthogonality loss on attention "
                                  "matrices (lambda)")
    defaults_version: int = Field(
        DEFAULTS_VERSION, ge=1, le=DEFAULTS_VERSION, description="what auto means: 5, version 4 "
        "with a feed-forward readout, 8 heads and s = 1 for the invertible model; 4, version 3 "
        "with the learning rate and warm-up measured for the model (lr, warmup: auto); 3, tied "
        "L2 attention's measured defaults with offsets certified by their weighted count of "
        "keys and norm gain 4 for contractive-l2, learning rate 1e-3 after 100 steps; 2, the "
        "same without those two; 1, the plain ones for every model, as before version 2 (a "
        "stored config without this key is version 1)")

    @model_validator(mode="after")
    def _check_combinations(self) -> LMSettings:
        _check(_Resolved(_resolve(self.model_dump())))
        return self


class _Resolved:
    """Attribute access to a dict of settings (for checks on the resolved values)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def auto_settings(attention: str, invertible: bool = False, model: str = "transformer",
                  version: int = DEFAULTS_VERSION) -> dict[str, Any]:
    """What the ``"auto"`` settings of a model resolve to.

    Every version starts from :data:`SHAPE_DEFAULTS` (4 heads, a linear readout).
    Version 5 (:data:`DEFAULTS_VERSION`) is version 3 with :data:`VERSION_5_CHANGES`: the
    invertible model reads its final hidden states through a feed-forward readout, with 8
    heads and its L2 weights at s = 1 (version 4 changed only the training settings,
    :func:`auto_training`).
    Version 3 is version 2 with :data:`VERSION_3_CHANGES`:
    contractive attention reads a LayerNorm whose gain starts at 4 (``norm_gain``), with its
    L2 weights at s = 1/8 and logit offsets capped at 8; inside the invertible stack its L2
    weights start at s = 1/2. Both certify logit offsets by their weighted count of keys.
    Version 2: for tied L2 attention (``l2-tied``, and ``contractive-l2`` alone or inside the
    invertible stack) the best measured row of :data:`TIED_L2_DEFAULTS`: logit offsets with
    caps 4 (a token can weight another above itself), Kim et al. (2021, App. H)'s ``glorot-l2``
    initialisation with the scale s measured best at width 128, and for contractive attention
    the ``2,inf`` certificate. Every other
    model, and every model under version 1 (configs stored before version 2), gets
    :data:`PLAIN_DEFAULTS`: no offsets, GPT-2 initialisation, the inf-norm certificate.

    Examples:
        >>> auto_settings("l2-tied")["init_scale"], auto_settings("dp")["init"]
        (0.5, 'default')
        >>> auto_settings("l2-tied", version=1) == {**SHAPE_DEFAULTS, **PLAIN_DEFAULTS}
        True
        >>> auto_settings("contractive-l2", invertible=True)["readout"]
        'feed-forward'
        >>> auto_settings("contractive-l2", invertible=True, version=4)["readout"]
        'linear'
    """
    if version >= 2 and model == "transformer":
        key = (attention, bool(invertible))
        settings = {**SHAPE_DEFAULTS, **TIED_L2_DEFAULTS.get(key, PLAIN_DEFAULTS)}
        if version >= 3:
            settings.update(VERSION_3_CHANGES.get(key, {}))
        if version >= 5:
            settings.update(VERSION_5_CHANGES.get(key, {}))
        return settings
    return {**SHAPE_DEFAULTS, **PLAIN_DEFAULTS}


def auto_training(attention: str | None = None, invertible: bool = False,
                  model: str = "transformer", version: int = DEFAULTS_VERSION) -> dict[str, Any]:
    """What ``lr`` and ``warmup`` left as ``"auto"`` resolve to: from version 4 on
    (:data:`AUTO_TRAINING`) a peak rate of 2e-3 for tied and contractive L2 attention and 6e-3
    for the invertible model, each after 400 warm-up steps; nanoGPT's 1e-3 after 100 steps for
    every other model and under earlier versions.

    Examples:
        >>> auto_training("dp"), auto_training("contractive-l2")
        ({'lr': 0.001, 'warmup': 100}, {'lr': 0.002, 'warmup': 400})
        >>> auto_training(invertible=True)["lr"], auto_training(invertible=True, version=3)["lr"]
        (0.006, 0.001)
    """
    if attention is None:
        attention = _default_attention(invertible)
    if model != "transformer" or version < 4:
        return dict(NANOGPT_TRAINING)
    return dict(AUTO_TRAINING.get((attention, bool(invertible)), NANOGPT_TRAINING))


def _default_attention(invertible: bool) -> str:
    """The attention an unset ``attention`` means: contractive inside the invertible stack."""
    return "contractive-l2" if invertible else "dp"


def _resolve(values: dict) -> dict:
    """Settings with the ``None`` and ``"auto"`` defaults that depend on others filled in."""
    values = dict(values)
    invertible = values.get("invertible", False) is True
    if values.get("attention") is None:
        values["attention"] = _default_attention(invertible)
    version = values.get("defaults_version", DEFAULTS_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        version = DEFAULTS_VERSION  # refused by the field's own check
    attention, model = values["attention"], values.get("model", "transformer")
    if not (isinstance(attention, str) and isinstance(model, str)):
        attention, model = "", ""  # refused by the fields' own checks
    auto = auto_settings(attention, invertible, model, version)
    automatic = {key for key in auto if values.get(key, AUTO) == AUTO}
    for key in automatic:
        values[key] = auto[key]
    if values.get("norm") is None:
        values["norm"] = "actnorm" if invertible else "layernorm"
    pre_norm = (values.get("norm_position", "pre") == "pre"
                and values["norm"] in ("layernorm", "centernorm"))
    if "norm_gain" in automatic and not pre_norm and values["norm_gain"] != 1.0:
        # the gain is that of a pre-norm LayerNorm or CenterNorm; without one the scale of the
        # L2 weights is the one measured at gain 1 (version 3 lowered it with the gain)
        values["norm_gain"] = 1.0
        if "init_scale" in automatic:
            values["init_scale"] = auto_settings(attention, invertible, model, 2)["init_scale"]
    if values.get("final_norm") is None:
        if invertible:
            values["final_norm"] = "layernorm"
        else:
            pre = values.get("norm_position", "pre") == "pre"
            values["final_norm"] = values["norm"] if pre else "none"
    if values.get("residual_alpha") is None:
        layers = values.get("layers", 4)
        if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1:
            values["residual_alpha"] = 1.0 / layers
    return values


def _check(config: _Resolved) -> None:
    """Refuse combinations of (resolved) settings that cannot be built."""
    if config.model == "transformer" and config.dim % config.heads:
        raise ValueError(f"heads={config.heads} must divide dim={config.dim}")
    l2 = ("l2", "l2-tied", "contractive-l2")
    if (config.self_offset or config.position_bias) and config.attention not in l2:
        raise ValueError(f"self_offset and position_bias are options of L2 attention (l2, "
                         f"l2-tied, contractive-l2), not of {config.attention!r} attention")
    if config.norm_gain != 1.0 and (config.norm not in ("layernorm", "centernorm")
                                    or config.norm_position != "pre" or config.invertible):
        raise ValueError(f"norm_gain={config.norm_gain} needs a pre-norm LayerNorm or CenterNorm "
                         "outside an invertible stack (it is the gain of the normalisation "
                         "before the attention branch)")
    if config.norm == "centernorm" and config.dim < 2:
        raise ValueError("centernorm needs dim >= 2")
    if config.model == "lstm":
        if config.readout != "linear":
            raise ValueError(f"the LSTM baseline takes readout 'linear' only, not "
                             f"{config.readout!r}")
        if config.invertible:
            raise ValueError("invalid combination: the LSTM baseline cannot be invertible")
        if config.init != "default":
            raise ValueError(f"the LSTM baseline takes init 'default' only, not "
                             f"{config.init!r}")
    if config.invertible:
        if config.norm_position != "pre":
            raise ValueError("invalid combination: --invertible with post-norm; N(x + f(x)) "
                             "puts the normalisation inside the invertible map, use norm "
                             "position 'pre'")
        if config.attention != "contractive-l2":
            raise ValueError(f"invalid combination: --invertible needs contractive-l2 "
                             f"attention; {config.attention!r} attention is not a contraction")
        if config.norm not in ("actnorm", "none"):
            raise ValueError(f"invalid combination: --invertible with {config.norm}, which "
                             "discards the mean of each token and cannot be inverted; use "
                             "norm 'actnorm' or 'none'")


# settings the LSTM baseline does not read (those it refuses outright are checked in _check)
_TRANSFORMER_ONLY = ("heads", "attention", "self_offset", "position_bias", "max_distance",
                     "norm", "norm_position", "final_norm", "weighted_residual",
                     "residual_alpha", "init_scale", "norm_gain", "ff_mult", "bias",
                     "contractive_coeff", "contractive_norm", "spectral_norms",
                     "ortho_attention", "ortho_ff", "ortho_affinity")


def check_applicable(settings: LMSettings, given: Iterable[str]) -> None:
    """Refuse settings a user gave (``given``: the command line's flags and the config file's
    keys) away from their defaults that the model would not read, naming them.

    Only what a user typed is checked: a complete set of settings, such as
    :data:`PLAIN_DEFAULTS` for every attention or a config stored by an earlier version, may
    hold values a model does not read.

    Raises:
        ConfigError: naming the setting and what it needs.

    Examples:
        >>> check_applicable(LMSettings(attention="l2-tied", init_scale=0.5), ["init_scale"])
        >>> try:
        ...     check_applicable(LMSettings(residual_alpha=0.5), ["residual_alpha"])
        ... except ConfigError as error:
        ...     print(str(error).split(";")[0])
        residual_alpha=0.5 is not read by this model: it needs weighted_residual true
    """
    given = {name for name in given if name in LMSettings.model_fields
             and getattr(settings, name) != LMSettings.model_fields[name].default}
    model = _Resolved(_resolve(settings.model_dump()))
    if model.model == "lstm":
        unused = [name for name in _TRANSFORMER_ONLY if name in given]
        if unused:
            raise ConfigError(f"{', '.join(unused)}: setting(s) of the Transformer that the "
                              "LSTM baseline does not read (model lstm): drop them")
        return
    contractive = model.attention == "contractive-l2"
    unread = {
        "residual_alpha": (not model.weighted_residual, "weighted_residual true"),
        "contractive_norm": (not contractive, "attention contractive-l2"),
        "spectral_norms": (not contractive, "attention contractive-l2"),
        "contractive_coeff": (not (contractive or model.invertible),
                              "attention contractive-l2 or invertible true"),
        "ortho_attention": (model.attention == "none", "attention weights (not attention none)"),
        "ortho_affinity": (model.attention == "none", "attention weights (not attention none)"),
        "max_distance": (not model.position_bias, "a position bias (position_bias > 0)"),
        "init_scale": (model.init != "glorot-l2", "init glorot-l2"),
    }
    for name, (ignored, needs) in unread.items():
        if name in given and ignored:
            raise ConfigError(f"{name}={getattr(settings, name)!r} is not read by this model: "
                              f"it needs {needs}; drop it or give that too")


class LMConfig(LMSettings):
    """:class:`LMSettings` for a vocabulary of ``vocab_size`` token ids: what a model is built
    from.

    Every ``None`` and ``"auto"`` setting is resolved here, so :meth:`to_dict` holds the
    values the model was built with.

    Examples:
        >>> config = LMConfig(vocab_size=65, invertible=True)
        >>> config.attention, config.norm, config.final_norm, config.contractive_norm
        ('contractive-l2', 'actnorm', 'layernorm', '2,inf')
        >>> tied = LMConfig(vocab_size=65, attention="l2-tied")
        >>> tied.self_offset, tied.position_bias, tied.init, tied.init_scale
        (4.0, 4.0, 'glorot-l2', 0.5)
    """

    vocab_size: int = Field(ge=1, description="number of token ids")

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, values: Any) -> Any:
        return _resolve(values) if isinstance(values, dict) else values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LMConfig:
        """Inverse of :meth:`to_dict`, with errors naming the key and the value.

        A dict without ``defaults_version`` was stored before version 2: its missing settings
        take the plain defaults it was trained with (:data:`PLAIN_DEFAULTS`), not today's.
        """
        return cls.parse(_stored(values), "model configuration")


def _stored(values: Mapping[str, Any]) -> dict:
    """Network settings as an earlier flowattn stored them: no ``defaults_version`` means 1."""
    return {"defaults_version": 1, **values}


class LMData(Section):
    """Where the text comes from and how it is scored."""

    data: str | None = Field(None, description="UTF-8 text or PTB-char file (none: the embedded "
                             "corpus)", json_schema_extra={"metavar": "FILE"})
    data_format: Literal["auto", "text", "ptb-char"] = Field(
        "auto", description="file format; auto detects PTB-char",
        json_schema_extra={"aliases": ["--format"]})
    val_data: str | None = Field(None, description="separate validation file (none: the last "
                                 "10% of --data)", json_schema_extra={"metavar": "FILE"})
    eval_iters: int = Field(0, ge=0, description="random validation batches per evaluation; 0 "
                            "scores the whole split")


class LMTrain(TrainSettings.with_defaults(
        "LMTrainDefaults", steps=2000, batch_size=12, schedule="cosine", min_lr=1e-4,
        beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
        divergence_factor=2.0, eval_every=250, checkpoint_every=250, log_every=10, seed=1337,
        device="auto")):
    """The shared training settings with the language model's defaults; ``lr`` and ``warmup``
    may be ``"auto"`` (the model's own).

    ``compile`` trains through ``torch.compile(model)``, a wrapper that shares the model's
    parameters: the checkpoint holds the model's own state dict, the same with and without it.

    Examples:
        >>> LMTrain().compile, LMTrain(compile=True).compile
        (False, True)
    """

    lr: _Scale | Literal["auto"] = Field(
        AUTO, description="peak learning rate (auto: 2e-3 for l2-tied and contractive-l2, 6e-3 "
        "with --invertible, else 1e-3)")
    warmup: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        AUTO, description="linear warm-up steps (auto: 400 for l2-tied, contractive-l2 and "
        "with --invertible, else 100)")

    def model_post_init(self, __context) -> None:
        if AUTO not in (self.lr, self.warmup):  # (automatic ones are checked once resolved)
            super().model_post_init(__context)


class LMRunConfig(RunConfig):
    """Every setting of a ``flowattn lm train`` run. The defaults are nanoGPT's CPU
    configuration for Tiny Shakespeare (4 layers, 4 heads, width 128, block 64, batch 12, 2000
    steps, AdamW with learning rate 1e-3, 100 warm-up steps and cosine decay to 1e-4, beta2
    0.99, weight decay 0.1, gradient clipping at 1.0, no dropout), except that the learning
    rate and warm-up are the model's own (``lr`` and ``warmup`` left as ``"auto"``,
    :func:`auto_training`): nanoGPT's for nanoGPT's model, a larger rate after a longer warm-up
    for contractive attention and the invertible model.

    Examples:
        >>> config = LMRunConfig.build({"layers": 2, "steps": 100})
        >>> config.network.layers, config.train.steps, config.train.lr, config.training().lr
        (2, 100, 'auto', 0.001)
    """

    RESUMABLE: ClassVar[frozenset[str]] = frozenset(
        {"steps", "device", "threads", "compile", "eval_every", "checkpoint_every", "log_every",
         "eval_iters", "spectral_norms"})
    PATHS: ClassVar[frozenset[str]] = frozenset({"data", "val_data"})

    data: LMData = LMData()
    network: LMSettings = LMSettings()
    train: LMTrain = LMTrain()

    @model_validator(mode="after")
    def _check_training(self) -> LMRunConfig:
        self.training().model_post_init(None)  # the shared checks, on the resolved values
        return self

    def training(self) -> LMTrain:
        """The training settings with ``lr`` and ``warmup`` left as ``"auto"`` resolved for
        the network (:func:`auto_training`, by its ``defaults_version``).

        Examples:
            >>> train = LMRunConfig.build({"invertible": True}).training()
            >>> train.lr, train.warmup
            (0.006, 400)
            >>> LMRunConfig.build({"invertible": True, "defaults_version": 3}).training().lr
            0.001
        """
        automatic = [key for key in ("lr", "warmup") if getattr(self.train, key) == AUTO]
        if not automatic:
            return self.train
        net = self.network
        values = auto_training(net.attention, net.invertible, net.model, net.defaults_version)
        return self.train.model_copy(update={key: values[key] for key in automatic})

    @classmethod
    def from_stored(cls, values: Mapping[str, Any], source: str = "") -> LMRunConfig:
        """The settings of a run as its checkpoint or ``config.json`` stored them.

        A config stored before ``defaults_version`` existed is version 1: its ``"auto"`` and
        missing network settings resolve as they did when it trained (:func:`auto_settings`).

        Examples:
            >>> old = LMRunConfig.from_stored({"network": {"attention": "l2-tied"}})
            >>> LMConfig(vocab_size=65, **old.network.to_dict()).self_offset
            0.0
        """
        nested = cls.nest(values, source or "stored settings")
        nested["network"] = _stored(nested.get("network", {}))
        return cls.parse(nested, source)
