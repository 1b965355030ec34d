"""Settings of a character language model and of ``flowattn lm train`` runs (no torch here).

:class:`LMSettings` describes the network, :class:`LMConfig` adds the vocabulary size it is
built for, and :class:`LMRunConfig` nests the network settings beside the data and the shared
training settings (:class:`~flowattn.training.config.TrainSettings`). Every value is checked
when the object is built; errors name the key and the value.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from ..training.config import Field, RunConfig, Section, TrainSettings

__all__ = ["LMSettings", "LMConfig", "LMData", "LMTrain", "LMRunConfig", "ATTENTIONS", "NORMS",
           "NORM_POSITIONS", "INITS", "MODELS", "FORMATS", "DEFAULT_CORPUS"]

ATTENTIONS = ("dp", "l2", "l2-tied", "contractive-l2", "scaled-cosine", "none")
NORMS = ("layernorm", "centernorm", "actnorm", "none")
NORM_POSITIONS = ("pre", "post")
INITS = ("default", "glorot-l2", "lipschitz", "spectral")
MODELS = ("transformer", "lstm")
FORMATS = ("auto", "text", "ptb-char")
DEFAULT_CORPUS = "builtin:pydoc-topics"


class LMSettings(Section):
    """Hyper-parameters of a character language model.

    ``attention``, ``norm`` and ``final_norm`` left as ``None`` resolve (in :class:`LMConfig`,
    the settings a model is built from) to defaults that depend on ``invertible``:
    contractive-l2 attention and a channel affine map (``actnorm``) inside the invertible
    stack, dot-product attention and LayerNorm otherwise; ``residual_alpha`` to 1 / layers.
    """

    block_size: int = Field(64, ge=1, description="context length T")
    model: Literal["transformer", "lstm"] = Field("transformer", description="network family")
    layers: int = Field(4, ge=1, description="Transformer blocks (or LSTM layers)")
    dim: int = Field(128, ge=1, description="model width D")
    heads: int = Field(4, ge=1, description="attention heads H")
    attention: Literal["dp", "l2", "l2-tied", "contractive-l2", "scaled-cosine",
                       "none"] | None = Field(
        None, description="attention type; none is the attention-free baseline (default: dp, "
        "contractive-l2 with --invertible)")
    self_offset: float = Field(0.0, ge=0, allow_inf_nan=False, description="cap of the learnt "
                               "self-offsets of L2 attention (0: none; lets a token weight "
                               "another above itself)")
    position_bias: float = Field(0.0, ge=0, allow_inf_nan=False, description="cap of the learnt "
                                 "relative-position bias of L2 attention (0: none)")
    max_distance: int = Field(64, ge=1, description="relative positions beyond this share one "
                              "position bias")
    norm: Literal["layernorm", "centernorm", "actnorm", "none"] | None = Field(
        None, description="block normalisation (none: layernorm; actnorm with --invertible)")
    norm_position: Literal["pre", "post"] = Field(
        "pre", description="pre: x + f(N(x)); post: N(x + f(x))")
    final_norm: Literal["layernorm", "centernorm", "actnorm", "none"] | None = Field(
        None, description="normalisation before the output layer (none: the block norm for "
        "pre-norm models, no norm for post-norm ones, layernorm for invertible ones)")
    weighted_residual: bool = Field(False, description="LipsFormer residual x + alpha f(x), "
                                    "alpha learnable per channel")
    residual_alpha: float | None = Field(None, description="initial alpha (none: 1 / layers, "
                                         "Qi et al. 2023, Thm 2)")
    init: Literal["default", "glorot-l2", "lipschitz", "spectral"] = Field(
        "default", description="weight initialisation")
    init_scale: float = Field(1.0 / 16, gt=0, description="scale s of L2 attention weights "
                              "under --init glorot-l2")
    ff_mult: int = Field(4, ge=1, description="feed-forward hidden width as a multiple of D")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability")
    bias: bool = Field(False, description="biases in linear layers and norms")
    tie_embeddings: bool = Field(False, description="share the token embedding with the output "
                                 "layer")
    invertible: bool = Field(False, description="contractive blocks: embeddings -> hidden "
                             "states is invertible")
    contractive_coeff: float = Field(0.9, gt=0, lt=1, description="Lipschitz coefficient of "
                                     "contractive branches")
    contractive_norm: Literal["inf", "2,inf", "2"] = Field(
        "inf", description="norm in which contractive attention is certified (2,inf: the "
        "largest token's 2-norm, no sqrt(D) of the inf-norm)")
    ortho_attention: float = Field(0.0, ge=0, description="orthogonality loss on attention "
                                   "weights (lambda)")
    ortho_ff: float = Field(0.0, ge=0, description="orthogonality loss on feed-forward weights "
                            "(lambda)")
    ortho_affinity: float = Field(0.0, ge=0, description="orthogonality loss on attention "
                                  "matrices (lambda)")

    @model_validator(mode="after")
    def _check_combinations(self) -> LMSettings:
        _check(_Resolved(_resolve(self.model_dump())))
        return self


class _Resolved:
    """Attribute access to a dict of settings (for checks on the resolved values)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def _resolve(values: dict) -> dict:
    """Settings with the ``None`` defaults that depend on others filled in."""
    values = dict(values)
    invertible = values.get("invertible", False) is True
    if values.get("attention") is None:
        values["attention"] = "contractive-l2" if invertible else "dp"
    if values.get("norm") is None:
        values["norm"] = "actnorm" if invertible else "layernorm"
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
    if config.norm == "centernorm" and config.dim < 2:
        raise ValueError("centernorm needs dim >= 2")
    if config.model == "lstm":
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


class LMConfig(LMSettings):
    """:class:`LMSettings` for a vocabulary of ``vocab_size`` token ids: what a model is built
    from.

    Examples:
        >>> config = LMConfig(vocab_size=65, invertible=True)
        >>> config.attention, config.norm, config.final_norm
        ('contractive-l2', 'actnorm', 'layernorm')
    """

    vocab_size: int = Field(ge=1, description="number of token ids")

    @model_validator(mode="before")
    @classmethod
    def _resolve_defaults(cls, values: Any) -> Any:
        return _resolve(values) if isinstance(values, dict) else values

    @classmethod
    def from_dict(cls, values: dict) -> LMConfig:
        """Inverse of :meth:`to_dict`, with errors naming the key and the value."""
        return cls.parse(values, "model configuration")


class LMData(Section):
    """Where the text comes from and how it is scored."""

    data: str | None = Field(None, description="UTF-8 text or PTB-char file (none: the embedded "
                             "corpus)")
    data_format: Literal["auto", "text", "ptb-char"] = Field(
        "auto", description="file format; auto detects PTB-char",
        json_schema_extra={"flag": "--format"})
    val_data: str | None = Field(None, description="separate validation file (none: the last "
                                 "10% of --data)")
    eval_iters: int = Field(0, ge=0, description="random validation batches per evaluation; 0 "
                            "scores the whole split")


class LMTrain(TrainSettings.with_defaults(
        "LMTrainDefaults", steps=2000, batch_size=12, lr=1e-3, schedule="cosine", warmup=100,
        min_lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
        divergence_factor=2.0, eval_every=250, checkpoint_every=250, log_every=10, seed=1337,
        device="auto")):
    """The shared training settings with the language model's defaults, and ``compile``.

    ``compile`` trains through ``torch.compile(model)``, a wrapper that shares the model's
    parameters: the checkpoint holds the model's own state dict, the same with and without it.

    Examples:
        >>> LMTrain().compile, LMTrain(compile=True).compile
        (False, True)
    """

    compile: bool = Field(False, description="train through torch.compile(model) (on CPU it "
                          "needs a C++ compiler); the checkpoint is the same with and without")


class LMRunConfig(RunConfig):
    """Every setting of a ``flowattn lm train`` run. The defaults are nanoGPT's CPU
    configuration for Tiny Shakespeare (4 layers, 4 heads, width 128, block 64, batch 12, 2000
    steps, AdamW with learning rate 1e-3, 100 warm-up steps and cosine decay to 1e-4, beta2
    0.99, weight decay 0.1, gradient clipping at 1.0, no dropout).

    Examples:
        >>> config = LMRunConfig.build({"layers": 2, "steps": 100})
        >>> config.network.layers, config.train.steps, config.train.lr
        (2, 100, 0.001)
    """

    RESUMABLE: ClassVar[frozenset[str]] = frozenset(
        {"steps", "device", "threads", "compile", "eval_every", "checkpoint_every", "log_every",
         "eval_iters"})

    data: LMData = LMData()
    network: LMSettings = LMSettings()
    train: LMTrain = LMTrain()
