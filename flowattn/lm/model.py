"""Character language models: a decoder-only Transformer with Lipschitz options, and an LSTM."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import (
    L2MHA,
    ContractiveL2MHA,
    DotProductMHA,
    ScaledCosineMHA,
    shared_certificates,
)
from ..errors import InputError
from ..progress import progress_range
from ..validation import check_count, check_deferred, trusted_inputs
from .config import INITS, LMConfig

__all__ = [
    "TransformerLM",
    "LSTMLM",
    "Block",
    "NoAttention",
    "FeedForward",
    "ChannelAffine",
    "CenterNorm",
    "ContractiveDropout",
    "build_model",
    "attention_probabilities",
    "orthogonality_penalty",
    "initialise",
]

# ----------------------------------------------------------------------------- layers


class CenterNorm(nn.Module):
    r"""CenterNorm(x) = gamma * D/(D-1) (x - mean(x)) + beta (LipsFormer, Qi et al. 2023, eq. (3)).

    LayerNorm without the division by the standard deviation: Lipschitz with constant
    D/(D-1) max|gamma| in the 2-norm, where LayerNorm is not Lipschitz at all near constant x.

    Examples:
        >>> norm = CenterNorm(4)
        >>> norm(torch.tensor([[1.0, 2.0, 3.0, 6.0]])).sum().abs().item() < 1e-6
        True
    """

    def __init__(self, dim: int, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = (x - x.mean(-1, keepdim=True)) * (self.dim / (self.dim - 1)) * self.weight
        return y if self.bias is None else y + self.bias


class ChannelAffine(nn.Module):
    r"""Per-channel affine map y = (x + b) exp(s), initialised to the identity: the LM's
    ``"actnorm"`` normalisation (Kingma & Dhariwal 2018, §3.1, without the data-dependent
    initialisation).

    Invertible, so it may sit inside an invertible stack. Starting from the identity (rather
    than from the statistics of a first batch) keeps replicas of a distributed run identical
    and makes a resumed run independent of which batch came first. Unlike the flow layer
    :class:`flowattn.flows.ActNorm` it is a plain module: no data-dependent initialisation, no
    log-determinant, no padding mask.

    Examples:
        >>> act = ChannelAffine(3)
        >>> x = torch.randn(2, 3)
        >>> torch.allclose(act.inverse(act(x)), x)
        True
    """

    def __init__(self, dim: int):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(dim))
        self.log_scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return (x + self.shift) * torch.exp(self.log_scale)

    def inverse(self, y: Tensor) -> Tensor:
        """x = y exp(-s) - b."""
        return y * torch.exp(-self.log_scale) - self.shift


class ContractiveDropout(nn.Module):
    """Dropout without rescaling (Kim et al. 2021, §4): a 0/1 mask in training, multiplication
    by 1 - p in evaluation. Both are contractions, so a contractive branch stays contractive.

    Examples:
        >>> drop = ContractiveDropout(0.5).eval()
        >>> drop(torch.ones(2)).tolist()
        [0.5, 0.5]
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0:
            return x
        if self.training:  # inverted dropout times (1 - p) is the plain 0/1 mask
            return F.dropout(x, self.p, training=True) * (1.0 - self.p)
        return x * (1.0 - self.p)


class FeedForward(nn.Module):
    """Position-wise feed-forward network Linear -> GELU -> Linear (Vaswani et al. 2017)."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(dim, hidden, bias=bias)
        self.proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _norm(kind: str, dim: int, bias: bool) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim, bias=bias)
    if kind == "centernorm":
        return CenterNorm(dim, bias=bias)
    if kind == "actnorm":
        return ChannelAffine(dim)
    return nn.Identity()


class NoAttention(nn.Module):
    """The attention-free baseline: an attention branch that returns zeros, so a block keeps
    only its feed-forward branch and each token sees no other token.

    It has the interface the LM asks of an attention module (each token's attention matrix is
    the identity, no projections, Lipschitz constant 0), so every option that works with
    attention works without it. Comparing a model with this branch against the same model
    with attention shows how much of the context the attention uses.

    Examples:
        >>> x = torch.randn(2, 5, 8)
        >>> NoAttention(8, 2)(x, causal=True).abs().max().item()
        0.0
        >>> NoAttention(8, 2).attention_probabilities(x)[0, 0]
        tensor([[1., 0., 0., 0., 0.],
                [0., 1., 0., 0., 0.],
                [0., 0., 1., 0., 0.],
                [0., 0., 0., 1., 0.],
                [0., 0., 0., 0., 1.]])
    """

    similarity = "none"

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads

    def forward(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        # zero times the input rather than new zeros: the block's norm and residual weight
        # stay in the graph (with zero gradient), as DistributedDataParallel expects of every
        # parameter
        return x * 0.0

    def attention_probabilities(self, x: Tensor, mask: Tensor | None = None,
                                causal: bool = False) -> Tensor:
        b, n = x.shape[0], x.shape[1]
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        return eye.expand(b, self.heads, n, n)

    def projections(self) -> list:
        return []

    def lipschitz_bound(self, n: int, norm: str = "inf") -> float:
        return 0.0


def _attention(config: LMConfig) -> nn.Module:
    d, h, p = config.dim, config.heads, config.dropout
    if config.attention == "none":
        return NoAttention(d, h)
    if config.attention == "dp":
        return DotProductMHA(d, h, dropout=p, bias=config.bias)
    offsets = {"self_offset": config.self_offset, "position_bias": config.position_bias,
               "max_distance": config.max_distance}
    if config.attention == "l2":
        return L2MHA(d, h, tied=False, dropout=p, **offsets)
    if config.attention == "l2-tied":
        return L2MHA(d, h, tied=True, dropout=p, **offsets)
    if config.attention == "scaled-cosine":
        return ScaledCosineMHA(d, h, dropout=p)
    # Contractive attention refuses attention-weight dropout (it voids the bound); inside an
    # invertible stack it applies contractive output dropout itself.
    # defaults_version 3 certifies offsets by their weighted count of keys; a config stored
    # before keeps the margin form it trained with
    count = "weighted" if config.defaults_version >= 3 else "margin"
    return ContractiveL2MHA(
        d, h, coeff=config.contractive_coeff, norm=config.contractive_norm,
        output_dropout=p if config.invertible else 0.0, offset_certificate=count,
        spectral_norms=config.spectral_norms, causal_length=config.block_size, **offsets,
    )


def _lipschitz_feed_forward(config: LMConfig) -> nn.Module:
    from ..branches import LipschitzMLP

    return LipschitzMLP(config.dim, config.ff_mult * config.dim, coeff=config.contractive_coeff)


class Block(nn.Module):
    r"""One Transformer block: an attention and a feed-forward residual branch.

    * pre-norm: x + a * f(N(x)) (Xiong et al. 2020; nanoGPT),
    * post-norm: N(x + a * f(x)) (Vaswani et al. 2017),
    * invertible: x -> N(x) -> x + g(x), with N invertible (:class:`ChannelAffine` or none) and
      g contractive: contractive L2 attention (Kim et al. 2021, §4) and a spectrally normalised
      MLP with LipSwish (Chen et al. 2019), each certified below ``contractive_coeff``.

    a is 1, or LipsFormer's learnable per-channel alpha (Qi et al. 2023, eq. (4)); in an
    invertible block it is clamped to [-1, 1], which keeps each branch contractive.
    Attention is causal throughout.
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.invertible, self.position = config.invertible, config.norm_position
        self.attn = _attention(config)
        if config.invertible:
            self.ff = _lipschitz_feed_forward(config)
            self.drop_attn = nn.Identity()  # ContractiveL2MHA applies output dropout itself
            self.drop_ff = ContractiveDropout(config.dropout)
        else:
            self.ff = FeedForward(config.dim, config.ff_mult * config.dim, config.bias)
            self.drop_attn = nn.Dropout(config.dropout)
            self.drop_ff = nn.Dropout(config.dropout)
        self.norm_attn = _norm(config.norm, config.dim, config.bias)
        self.norm_ff = _norm(config.norm, config.dim, config.bias)
        if config.weighted_residual:
            alpha = torch.full((config.dim,), float(config.residual_alpha))
            self.alpha_attn, self.alpha_ff = nn.Parameter(alpha), nn.Parameter(alpha.clone())
        else:
            self.alpha_attn = self.alpha_ff = None

    def _weighted(self, alpha: Tensor | None, y: Tensor) -> Tensor:
        if alpha is None:
            return y
        return y * (alpha.clamp(-1.0, 1.0) if self.invertible else alpha)

    def attention_branch(self, x: Tensor) -> Tensor:
        """a * dropout(attention(x)), causal: the attention residual branch."""
        return self._weighted(self.alpha_attn, self.drop_attn(self.attn(x, causal=True)))

    def ff_branch(self, x: Tensor) -> Tensor:
        """a * dropout(feed_forward(x)): the feed-forward residual branch."""
        return self._weighted(self.alpha_ff, self.drop_ff(self.ff(x)))

    def forward(self, x: Tensor, affinity: bool = False) -> tuple[Tensor, Tensor | None]:
        """Apply the block; with ``affinity`` also return sum_h ||A_h^T A_h - I||_F^2 averaged
        over the batch (Zhang et al. 2021, L_AM) for the attention matrices of this block."""
        if self.position == "post" and not self.invertible:
            attn_in = x
            x = self.norm_attn(x + self.attention_branch(x))
            x = self.norm_ff(x + self.ff_branch(x))
        elif self.invertible:  # normalisation is a layer of the stack, not part of a branch
            x = self.norm_attn(x)
            attn_in = x
            x = x + self.attention_branch(x)
            x = self.norm_ff(x)
            x = x + self.ff_branch(x)
        else:
            attn_in = self.norm_attn(x)
            x = x + self.attention_branch(attn_in)
            x = x + self.ff_branch(self.norm_ff(x))
        penalty = None
        if affinity:
            a = self.attn.attention_probabilities(attn_in, causal=True)
            eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
            penalty = (a.transpose(-1, -2) @ a - eye).pow(2).sum((-1, -2)).sum(1).mean()
        return x, penalty

    def lipschitz_bounds(self, n: int) -> tuple[float, float]:
        """Certified Lipschitz constants of the two branches of an invertible block for
        sequences of ``n`` tokens: attention in its own norm (``contractive_norm``), feed-forward
        in the 2-norm per token (so also in the "2,inf" norm of the sequence). Meaningful in
        evaluation mode, where they are exact certificates."""
        if not self.invertible:
            raise InputError("certified branch bounds exist for invertible blocks only")
        with torch.no_grad():
            attn = float(self.attn.lipschitz_bound(n))
            ff = float(self.ff.lipschitz_bound(n))
            if self.alpha_attn is not None:
                attn *= float(self.alpha_attn.abs().clamp(max=1.0).max())
                ff *= float(self.alpha_ff.abs().clamp(max=1.0).max())
        return attn, ff


# ----------------------------------------------------------------------------- attention maps


def attention_probabilities(attn: nn.Module, x: Tensor, causal: bool = True) -> Tensor:
    """The attention matrices A (B, H, N, N) that ``attn`` applies to ``x`` (B, N, D), causal by
    default as in the LM: the module's own ``attention_probabilities`` (every module of
    :mod:`flowattn.attention` has one), recomputed from its weights with the same logits.
    """
    probabilities = getattr(attn, "attention_probabilities", None)
    if not callable(probabilities):
        raise InputError(f"no attention matrix for {type(attn).__name__}")
    return probabilities(x, causal=causal)


# ----------------------------------------------------------------------------- regularisers


def _gram_penalty(w: Tensor) -> Tensor:
    """||W^T W - I||_F^2 on the smaller Gram matrix (semi-orthogonality for non-square W)."""
    gram = w.t() @ w if w.shape[0] >= w.shape[1] else w @ w.t()
    eye = torch.eye(gram.shape[0], dtype=w.dtype, device=w.device)
    return (gram - eye).pow(2).sum()


def _attention_maps(attn: nn.Module) -> list[Tensor]:
    """The linear maps of an attention module as (out, in) matrices (y = W x)."""
    return [p.matrix for p in attn.projections()]


def _ff_maps(ff: nn.Module) -> list[Tensor]:
    if isinstance(ff, FeedForward):
        return [ff.fc.weight, ff.proj.weight]
    return [layer.weight for layer in ff.layers]  # LipschitzMLP's spectral layers


def orthogonality_penalty(blocks, lam_attention: float, lam_ff: float) -> Tensor | None:
    r"""Orthogonality losses of Zhang et al. (2021, §2.1), summed over blocks.

    * attention: lambda ||P^T P - I||_F^2 with P the query, key, value and output maps stacked
      row-wise (as (out, in) matrices), so P^T P = sum_m W_m^T W_m,
    * feed-forward: lambda sum_m ||M_m^T M_m - I||_F^2, taken on the smaller Gram matrix of
      each non-square M (semi-orthogonality; the larger one cannot be the identity).

    Returns ``None`` when both lambdas are zero.
    """
    total = None
    for block in blocks:
        terms = []
        maps = _attention_maps(block.attn) if lam_attention > 0 else []
        if maps:  # an attention-free block has no attention weights to penalise
            terms.append(lam_attention * _gram_penalty(torch.cat(maps)))
        if lam_ff > 0:
            terms.extend(lam_ff * _gram_penalty(w) for w in _ff_maps(block.ff))
        for t in terms:
            total = t if total is None else total + t
    return total


# ----------------------------------------------------------------------------- initialisation


@dataclass
class _Weight:
    tensor: Tensor
    fan_in: int
    l2: bool  # a weight of L2 attention (scaled by s under glorot-l2)
    output: bool  # a residual output projection (scaled down under default)
    raw: bool  # a raw (in, out) matrix of an attention module rather than an nn.Linear


def _linear_weights(model: TransformerLM) -> list[_Weight]:
    found = []

    def feed_forward(ff: nn.Module) -> None:
        if isinstance(ff, FeedForward):
            found.append(_Weight(ff.fc.weight, ff.fc.in_features, False, False, False))
            found.append(_Weight(ff.proj.weight, ff.proj.in_features, False, True, False))

    for block in model.blocks:  # this order is the initialisation's RNG order
        l2 = block.attn.similarity == "l2"
        for p in block.attn.projections():
            found.append(_Weight(p.weight, p.fan_in, l2, p.role == "output", p.layout == "raw"))
        feed_forward(block.ff)
    if model.readout is not None:
        feed_forward(model.readout)
    return found


def _init_embedding(w: Tensor, scheme: str) -> None:
    if scheme == "glorot-l2":
        nn.init.xavier_uniform_(w)
    elif scheme == "lipschitz":
        e = math.sqrt(2.0 / (w.shape[0] + w.shape[1]))  # sqrt(2 / (esize + vsize))
        nn.init.uniform_(w, -e, e)
    else:
        nn.init.normal_(w, 0.0, 0.02)


@torch.no_grad()
def initialise(model: TransformerLM, scheme: str, scale: float = 1.0 / 16) -> None:
    r"""Initialise the weights of a Transformer LM by one of four schemes.

    * ``default`` -- GPT-2 / nanoGPT: linear and embedding weights N(0, 0.02), residual output
      projections N(0, 0.02 / sqrt(2 L)), biases zero. The raw weight matrices of the L2 and
      scaled-cosine attention modules keep their own Glorot-uniform initialisation.
    * ``glorot-l2`` -- Kim et al. (2021, App. H): Glorot uniform for every weight, except the
      L2 attention weights, U[-s/sqrt(D), s/sqrt(D)] with s = ``scale`` (1/16 for D = 512 in
      the paper). The appendix prints the Glorot bound as sqrt(1/(d_in + d_out)); we use
      Glorot's sqrt(6/(d_in + d_out)).
    * ``lipschitz`` -- Xu et al. (2020, §4): embeddings U[-e, e], e = sqrt(2/(esize + vsize)),
      linear weights U[-l, l], l = sqrt(1/isize) (isize the input width).
    * ``spectral`` -- LipsFormer (Qi et al. 2023, §4.1.4): Xavier-normal linear weights divided
      by their largest singular value (1-Lipschitz at initialisation); embeddings N(0, 0.02).

    Biases start at zero and norm layers at the identity in every scheme. The spectrally
    normalised layers of an invertible block keep their own initialisation: their
    normalisation makes the scale irrelevant.
    """
    if scheme not in INITS:
        raise InputError(f"unknown init {scheme!r}: choose from {', '.join(INITS)}")
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
    _init_embedding(model.tok_emb.weight, scheme)
    _init_embedding(model.pos_emb.weight, scheme)
    if not model.config.tie_embeddings:
        if scheme == "lipschitz":  # a linear map of width D
            bound = math.sqrt(1.0 / model.config.dim)
            nn.init.uniform_(model.head.weight, -bound, bound)
        else:
            _init_embedding(model.head.weight, scheme)
    layers = len(model.blocks)
    for w in _linear_weights(model):
        if scheme == "default":
            if not w.raw:
                std = 0.02 / math.sqrt(2 * layers) if w.output else 0.02
                nn.init.normal_(w.tensor, 0.0, std)
        elif scheme == "glorot-l2":
            if w.l2:
                bound = scale / math.sqrt(model.config.dim)
                nn.init.uniform_(w.tensor, -bound, bound)
            else:
                nn.init.xavier_uniform_(w.tensor)
        elif scheme == "lipschitz":
            bound = math.sqrt(1.0 / w.fan_in)
            nn.init.uniform_(w.tensor, -bound, bound)
        else:  # spectral
            nn.init.xavier_normal_(w.tensor)
            w.tensor.div_(torch.linalg.matrix_norm(w.tensor, ord=2))


# ----------------------------------------------------------------------------- models


class _CharLM(nn.Module):
    """What every character LM shares: the loss and autoregressive sampling."""

    config: LMConfig

    def _check_idx(self, idx: Tensor, name: str = "idx") -> None:
        """Refuse token ids that are not a (B, T) LongTensor with 1 <= T <= block_size and
        every id in [0, vocab_size). The ids' range is read where they are, on the host; on
        another device, and in compiled code, an asynchronous assertion checks it (no
        synchronisation per step, no graph break)."""
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise InputError(
                f"{name} must be a (B, T) LongTensor, got {idx.dtype} {tuple(idx.shape)}"
            )
        if idx.shape[1] > self.config.block_size:
            raise InputError(
                f"sequence length {idx.shape[1]} exceeds the block size {self.config.block_size}"
            )
        if idx.shape[1] == 0 or idx.shape[0] == 0:
            raise InputError(f"{name} holds no tokens: shape {tuple(idx.shape)}")
        vocab = self.config.vocab_size
        inside = ((idx >= 0) & (idx < vocab)).all()
        message = f"{name} holds token ids outside [0, {vocab}), the vocabulary"
        if idx.device.type != "cpu" or torch.compiler.is_compiling():
            torch._assert_async(inside, message)  # no read back, no graph break
        elif not bool(inside):
            bad = idx[(idx < 0) | (idx >= vocab)][:4].tolist()
            raise InputError(f"{message}: {bad}")

    def _losses(self, logits: Tensor, targets: Tensor, extra: Tensor | None) -> dict:
        # targets: token ids of idx's shape (no ignored positions: -100, PyTorch's ignore
        # index, left a loss of NaN where every target was ignored)
        if targets.shape != logits.shape[:-1]:
            raise InputError(f"targets must have idx's shape {tuple(logits.shape[:-1])}, got "
                             f"{tuple(targets.shape)}")
        self._check_idx(targets, "targets")
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        reg = torch.zeros((), dtype=nll.dtype, device=nll.device) if extra is None else extra
        return {"loss": nll + reg, "nll": nll, "reg": reg}

    def num_parameters(self) -> int:
        """Number of trainable parameters (shared ones counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        exclude: Sequence[int] = (),
        progress: bool = False,
    ) -> Tensor:
        """Extend ``idx`` (B, T) by sampling ``max_new_tokens`` tokens, one at a time, each from
        the model's distribution given the last ``block_size`` tokens (temperature-scaled,
        optionally restricted to the ``top_k`` most likely), never one of the ids in
        ``exclude`` (such as a vocabulary's unknown-character id). Draws are made on the CPU
        from ``generator``, so that a seed gives the same text on every device. ``progress``
        reports the tokens drawn on standard error (a bar on a terminal, else a line a
        minute)."""
        if not (math.isfinite(temperature) and temperature > 0):
            raise InputError(f"temperature must be a positive number, got {temperature}")
        if top_k is not None and top_k < 1:
            raise InputError(f"top_k must be >= 1, got {top_k}")
        check_count(max_new_tokens, "max_new_tokens", low=0)
        vocab = self.config.vocab_size
        exclude = sorted(set(exclude))
        if any(not 0 <= k < vocab for k in exclude):
            raise InputError(f"exclude holds ids outside [0, {vocab}): {exclude}")
        if len(exclude) == vocab:
            raise InputError("exclude holds every token id: nothing is left to sample")
        for _ in progress_range(max_new_tokens, "sampling", progress, unit="token"):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :]
            if exclude:
                logits = logits.index_fill(-1, torch.tensor(list(exclude), device=logits.device),
                                           -math.inf)
            # differences to the largest logit (<= 0), divided in float64: a tiny temperature
            # sends the others to -inf (greedy), never to inf - inf
            logits = (logits - logits.amax(-1, keepdim=True)).double() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            probs = torch.softmax(logits, dim=-1)
            draws = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, draws], dim=1)
        return idx


class TransformerLM(_CharLM):
    r"""Decoder-only Transformer character LM with dot-product, L2, tied-L2, contractive-L2 or
    scaled-cosine attention (Kim et al. 2021, §5.3; Qi et al. 2023).

    Token and learned position embeddings, ``layers`` :class:`Block` s, a final normalisation
    and a linear output layer (shared with the token embedding if ``tie_embeddings``). With
    ``invertible=True`` the map from embeddings to final hidden states,
    :meth:`hidden_states`, is a composition of invertible maps (:class:`ChannelAffine` and
    x + g(x) with Lip(g) < 1); :mod:`flowattn.lm.invertible` inverts it.

    ``forward(idx, targets)`` returns the logits and, with targets, a dict of losses: ``nll``
    (mean cross-entropy, nats per character), ``reg`` (the orthogonality penalties of Zhang et
    al. 2021 that are switched on) and ``loss`` = nll + reg, the training objective.

    Arguments:
        config: an :class:`LMConfig`.

    Examples:
        >>> model = TransformerLM(LMConfig(vocab_size=10, block_size=8, layers=1, dim=16,
        ...                                heads=2, attention="l2-tied"))
        >>> idx = torch.randint(10, (2, 8))
        >>> logits, losses = model(idx, idx)
        >>> tuple(logits.shape), sorted(losses)
        ((2, 8, 10), ['loss', 'nll', 'reg'])
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if config.model != "transformer":
            raise InputError(f"TransformerLM needs model='transformer', got {config.model!r}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.block_size, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm_f = _norm(config.final_norm, config.dim, config.bias)
        if config.readout == "feed-forward":  # outside the residual (and invertible) stack
            self.readout = FeedForward(config.dim, config.ff_mult * config.dim, config.bias)
            self.norm_readout = _norm("layernorm", config.dim, config.bias)
        else:
            self.readout = self.norm_readout = None
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        initialise(self, config.init, config.init_scale)
        if config.norm_gain != 1.0:  # the normalisation each attention branch reads
            for block in self.blocks:
                block.norm_attn.weight.data.fill_(config.norm_gain)

    def embed(self, idx: Tensor) -> Tensor:
        """Token plus position embeddings, (B, T, D): the input of the residual stack."""
        self._check_idx(idx)
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def hidden_states(self, h: Tensor, affinity: bool = False) -> tuple[Tensor, Tensor | None]:
        """Run the residual stack on embeddings ``h``; also return the summed affinity penalty
        ||A^T A - I||_F^2 of every block when ``affinity`` is set. The certificates of the
        blocks' contractive attention are evaluated together, batched over the layers
        (:func:`~flowattn.attention.shared_certificates`). The blocks trust their inputs (the
        stack's own states, :func:`~flowattn.validation.trusted_inputs`): nothing is read back
        from the device inside the stack, and its result is checked for overflow once, at
        the end."""
        total, h0 = None, h
        with trusted_inputs(), shared_certificates(self.blocks.modules(), h.shape[1],
                                                   causal=True):
            for block in self.blocks:
                h, penalty = block(h, affinity=affinity)
                if penalty is not None:
                    total = penalty if total is None else total + penalty
        check_deferred(h0, "TransformerLM", h)
        return h, total

    def logits(self, h: Tensor) -> Tensor:
        """The readout of the final hidden states ``h``: z = N_f(h), then with the
        feed-forward readout z <- LN(z + FF(z)), and the output layer."""
        z = self.norm_f(h)
        if self.readout is not None:
            z = self.norm_readout(z + self.readout(z))
        return self.head(z)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        config = self.config
        affinity = targets is not None and config.ortho_affinity > 0
        h, penalty = self.hidden_states(self.drop(self.embed(idx)), affinity=affinity)
        logits = self.logits(h)
        if targets is None:
            return logits, None
        reg = orthogonality_penalty(self.blocks, config.ortho_attention, config.ortho_ff)
        if penalty is not None:
            penalty = config.ortho_affinity * penalty
            reg = penalty if reg is None else reg + penalty
        return logits, self._losses(logits, targets, reg)

    def lipschitz_bounds(self, n: int | None = None) -> list[tuple[float, float]]:
        """Certified (attention, feed-forward) branch constants of every block of an invertible
        model, for sequences of ``n`` tokens (default: the block size)."""
        n = self.config.block_size if n is None else n
        return [block.lipschitz_bounds(n) for block in self.blocks]


class LSTMLM(_CharLM):
    """LSTM character LM, the recurrent baseline of Kim et al. (2021, §5.3): embedding,
    ``layers`` LSTM layers with hidden and cell width D, and an output layer (shared with the
    embedding if ``tie_embeddings``).

    Examples:
        >>> model = LSTMLM(LMConfig(vocab_size=10, model="lstm", layers=1, dim=16))
        >>> logits, _ = model(torch.randint(10, (2, 5)))
        >>> tuple(logits.shape)
        (2, 5, 10)
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if config.model != "lstm":
            raise InputError(f"LSTMLM needs model='lstm', got {config.model!r}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.lstm = nn.LSTM(
            config.dim,
            config.dim,
            num_layers=config.layers,
            dropout=config.dropout if config.layers > 1 else 0.0,
            batch_first=True,
        )
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        nn.init.normal_(self.tok_emb.weight, 0.0, 0.02)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        else:
            nn.init.normal_(self.head.weight, 0.0, 0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        self._check_idx(idx)
        h, _ = self.lstm(self.drop(self.tok_emb(idx)))
        logits = self.head(self.drop(h))
        if targets is None:
            return logits, None
        return logits, self._losses(logits, targets, None)


def build_model(config: LMConfig) -> TransformerLM | LSTMLM:
    """The model a configuration describes.

    Examples:
        >>> type(build_model(LMConfig(vocab_size=5, model="lstm", layers=1, dim=8))).__name__
        'LSTMLM'
    """
    return LSTMLM(config) if config.model == "lstm" else TransformerLM(config)
