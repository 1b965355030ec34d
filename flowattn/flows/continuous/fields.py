"""Time-dependent vector fields on sets and sequences made of self-attention, for CNFs."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...attention import L2MHA, DotProductMHA
from ...errors import InputError
from ...lipschitz import matrix_inf_norm, spectral_norm_exact
from ...lipschitz.checks import norm_name
from ...validation import check_sets
from ..geometry import project, set_times

__all__ = ["AttentionField", "DotProductField"]


class _StackedAttentionField(nn.Module):
    """Shared body: lift, L x (attention -> time FiLM -> tanh), project; see AttentionField."""

    takes_sets = True  # a field of sets (B, N, D): a CNF refuses (B, D) vectors for it

    def __init__(
        self,
        attention: type[nn.Module],
        dim: int,
        heads: int,
        layers: int,
        hidden: int,
        time_hidden: int,
        causal: bool,
        zero_com: bool,
    ):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("layers", layers),
                            ("hidden", hidden), ("time_hidden", time_hidden)):
            if not (isinstance(value, int) and value >= 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if hidden % heads != 0:
            raise InputError(f"heads={heads} must divide hidden={hidden}")
        self.dim, self.heads, self.layers, self.hidden = dim, heads, layers, hidden
        self.causal, self.zero_com = causal, zero_com
        self.lift = nn.Linear(dim, hidden)
        self.attention = nn.ModuleList(attention(hidden, heads) for _ in range(layers))
        # t -> per-layer gain and shift (FiLM, Perez et al. 2018); the gain is squashed by tanh
        # so |gain| <= 1 and time never increases the Lipschitz constant in z.
        self.time_net = nn.Sequential(
            nn.Linear(1, time_hidden), nn.Tanh(), nn.Linear(time_hidden, 2 * layers * hidden)
        )
        self.project = nn.Linear(hidden, dim)
        with torch.no_grad():
            # start with gain tanh(1) ~ 0.76 and no shift, whatever t is
            last = self.time_net[2]
            last.weight.mul_(0.1)
            last.bias.zero_()
            last.bias[: layers * hidden].fill_(1.0)

    def gains_and_shifts(self, t: Tensor | float, like: Tensor) -> tuple[Tensor, Tensor]:
        """The FiLM gains tanh(a(t)) and shifts b(t), each (layers, hidden)."""
        t = torch.as_tensor(t, dtype=like.dtype, device=like.device).reshape(1, 1)
        raw = self.time_net(t).reshape(2, self.layers, self.hidden)
        return torch.tanh(raw[0]), raw[1]

    def forward(self, t: Tensor | float, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """dz/dt at time ``t`` for sets ``z`` (B, N, D); ``mask`` (B, N) marks present elements.

        ``t`` is one time for every set, or a (B,) tensor of one time per set (flow matching).
        """
        mask = check_sets(z, mask, self.dim, name="z", module=self)
        t = set_times(t, z)
        raw = self.time_net(t).reshape(-1, 2, self.layers, 1, self.hidden)
        gains, shifts = torch.tanh(raw[:, 0]), raw[:, 1]  # (1 or B, layers, 1, hidden)
        h = self.lift(z)
        for i, attend in enumerate(self.attention):
            h = attend(h, mask=mask, causal=self.causal) * gains[:, i] + shifts[:, i]
            if i < self.layers - 1:
                h = torch.tanh(h)
        # padded elements get zero velocity; zero_com removes the centre of mass
        return project(self.project(h), mask, self.zero_com)


class AttentionField(_StackedAttentionField):
    r"""Certified-Lipschitz vector field f(z, t) on sets made of tied L2 self-attention.

    References:
        Kim, Papamakarios & Mnih, "The Lipschitz Constant of Self-Attention", ICML 2021
        (L2-MHA, eq. (8); bound, Thm 3.2; masks, App. G); Chen et al., "Neural Ordinary
        Differential Equations", NeurIPS 2018; Perez et al., "FiLM", AAAI 2018.

    With h_0 = z W_in + c_in (pointwise), for l = 1..L

    .. math:: h_l = \sigma_l\big(\gamma_l(t) \odot \mathrm{L2MHA}_l(h_{l-1}) + \beta_l(t)\big),
              \qquad f(z, t) = h_L W_{out} + c_{out},

    where \sigma_l = tanh for l < L and the identity for the last layer, and the gain
    \gamma_l(t) = tanh(a_l(t)) and shift \beta_l(t) come from a small MLP of t. There are no
    residual connections, so the Lipschitz constant in z is bounded by the product of the
    per-layer bounds, for every t:

    .. math:: \mathrm{Lip}_p(f(\cdot, t)) \le \|W_{in}\|_p \|W_{out}\|_p
              \prod_l \max_k|\gamma_{l,k}(t)| \, \mathrm{Lip}_p(\mathrm{L2MHA}_l; n)
              \le \|W_{in}\|_p \|W_{out}\|_p \prod_l \mathrm{Lip}_p(\mathrm{L2MHA}_l; n)

    (tanh is 1-Lipschitz, |\gamma| < 1, and the additive shift does not depend on z). Time
    enters through the gains: a shift shared by all elements would cancel in the L2 distances
    and pass through the attention as a constant. The field is permutation equivariant;
    with ``causal=True`` element i only sees elements j <= i, so the Jacobian is block
    lower triangular. With ``zero_com=True`` the output's centre of mass is removed (over present
    elements), which multiplies the bound by ||I - 11^T/n||_p: 1 for p = 2 and 2(n-1)/n for
    p = inf. Padded elements get zero velocity.

    A Lipschitz field gives the ODE a unique solution for all times and a flow map that is
    e^{L T}-bi-Lipschitz (Grönwall); see ``docs/cnf.md``. With ``max_lipschitz`` the output is
    multiplied by min(1, max_lipschitz / bound(n)) per set, so the certified constant never
    exceeds ``max_lipschitz``.

    Arguments:
        dim: feature width D of the set elements.
        heads: attention heads H (must divide ``hidden``).
        layers: number of attention layers L.
        hidden: width of the attention layers.
        time_hidden: width of the time MLP.
        norm: "inf" or 2, the norm of the certified bound (and of ``max_lipschitz``).
        causal: causal attention, for sequences.
        zero_com: remove the output's centre of mass (particle systems).
        max_lipschitz: optional cap on the certified Lipschitz constant in z.

    Examples:
        >>> field = AttentionField(dim=2, heads=2, layers=2, hidden=8)
        >>> z = torch.randn(3, 5, 2)
        >>> field(torch.tensor(0.5), z).shape
        torch.Size([3, 5, 2])
        >>> field.lipschitz_bound(5).item() > 0
        True
    """

    def __init__(
        self,
        dim: int,
        heads: int = 2,
        layers: int = 2,
        hidden: int = 16,
        time_hidden: int = 16,
        norm: str | int = "inf",
        causal: bool = False,
        zero_com: bool = False,
        max_lipschitz: float | None = None,
    ):
        super().__init__(L2MHA, dim, heads, layers, hidden, time_hidden, causal, zero_com)
        self.norm = norm_name(norm)
        if max_lipschitz is not None and not (math.isfinite(max_lipschitz) and max_lipschitz > 0):
            raise InputError(f"max_lipschitz must be a finite number > 0, got {max_lipschitz!r}")
        self.max_lipschitz = max_lipschitz

    def _matrix_norm(self, w: Tensor) -> Tensor:
        # pointwise linear maps have a block-diagonal Jacobian with blocks W (nn.Linear weight),
        # whose inf- and 2-norms equal those of W
        return matrix_inf_norm(w) if self.norm == "inf" else spectral_norm_exact(w)

    def raw_lipschitz_bound(self, n: int | Tensor, t: Tensor | float | None = None) -> Tensor:
        """The product bound before the ``max_lipschitz`` cap (see the class docstring)."""
        n = torch.as_tensor(n, device=self.lift.weight.device)
        if (n < 1).any():
            raise InputError(f"set size n must be >= 1, got {n}")
        bound = self._matrix_norm(self.lift.weight) * self._matrix_norm(self.project.weight)
        gains = None if t is None else self.gains_and_shifts(t, self.lift.weight)[0]
        for i, attend in enumerate(self.attention):
            # the field's own calls: causal or full (full calls may take the sharper bound)
            bound = bound * attend.lipschitz_bound(n, self.norm, causal=self.causal)
            if gains is not None:
                bound = bound * gains[i].abs().max()
        if self.zero_com and self.norm == "inf":
            nf = n.to(bound.dtype)
            bound = bound * 2 * (nf - 1) / nf
        return bound

    def lipschitz_bound(self, n: int | Tensor, t: Tensor | float | None = None) -> Tensor:
        """Certified Lipschitz constant in z, in ``self.norm``, for sets of ``n`` elements.

        ``n`` may be a tensor of set sizes (the result then has its shape). With ``t`` the
        bound holds at that time (using the actual gains |gamma(t)|); without it, for all t.
        With a causal mask or padding the bound for the number of present elements holds,
        since Thm 3.2 grows with n and every row sees at most n keys (App. G).
        """
        bound = self.raw_lipschitz_bound(n, t)
        if self.max_lipschitz is not None:
            # the cap rescales by min(1, max_lipschitz / bound for all t)
            sup = bound if t is None else self.raw_lipschitz_bound(n)
            bound = bound * torch.clamp(self.max_lipschitz / sup, max=1.0)
        return bound

    def forward(self, t: Tensor | float, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """dz/dt at time ``t`` for sets ``z`` (B, N, D); ``mask`` (B, N) marks present elements."""
        out = super().forward(t, z, mask)
        if self.max_lipschitz is None:
            return out
        n = z.shape[1] if mask is None else mask.sum(dim=1)
        bound = self.raw_lipschitz_bound(n).reshape(-1, 1, 1)
        return out * torch.clamp(self.max_lipschitz / bound, max=1.0)


class DotProductField(_StackedAttentionField):
    r"""The same stacked field with dot-product attention: the unconstrained baseline.

    Identical to :class:`AttentionField` (lift, L x (attention, time FiLM, tanh), projection;
    masks, causal and ``zero_com`` modes) with :class:`~flowattn.attention.DotProductMHA` in
    place of tied L2 attention. Dot-product attention is not Lipschitz (Kim et al. 2021,
    Thm 3.1), so this field has no certified bound and the ODE's solutions are only known to
    exist locally.

    Arguments:
        dim: feature width D of the set elements.
        heads: attention heads H (must divide ``hidden``).
        layers: number of attention layers L.
        hidden: width of the attention layers.
        time_hidden: width of the time MLP.
        causal: causal attention, for sequences.
        zero_com: remove the output's centre of mass.

    Examples:
        >>> field = DotProductField(dim=2, heads=2, layers=2, hidden=8)
        >>> field(0.0, torch.randn(3, 5, 2)).shape
        torch.Size([3, 5, 2])
    """

    def __init__(
        self,
        dim: int,
        heads: int = 2,
        layers: int = 2,
        hidden: int = 16,
        time_hidden: int = 16,
        causal: bool = False,
        zero_com: bool = False,
    ):
        super().__init__(DotProductMHA, dim, heads, layers, hidden, time_hidden, causal, zero_com)
