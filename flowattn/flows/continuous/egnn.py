r"""An E(n)-equivariant graph network as the vector field of a continuous flow on particles.

References:
    Satorras, Hoogeboom & Welling, "E(n) Equivariant Graph Neural Networks", ICML 2021
    (EGNN, eqs. (3)-(6)); Satorras, Hoogeboom, Fuchs, Posner & Welling, "E(n) Equivariant
    Normalizing Flows", NeurIPS 2021 (E-NF, §3.2: an EGNN as the dynamics of a CNF).

Every element carries a feature vector h_i and a position x_i. Particles of one kind have no
features of their own, so the only input is the time: h_i^0 = w t + b, x^0 = z. Each of the L
layers computes, over the pairs j != i of present elements,

    e_ij      = phi_e(h_i, h_j, |x_i - x_j|^2, |z_i - z_j|^2),   m_ij = sigmoid(w_a^T e_ij) e_ij
    x_i^{l+1} = x_i + sum_j (x_i - x_j) / (|x_i - x_j| + 1) * c tanh(phi_x(m_ij))
    h_i^{l+1} = h_i + phi_h(h_i, sum_j m_ij)

(all on layer l's x and h), and the field is the total displacement f(z, t) = x^L - z, with its
centre of mass removed. Only distances enter the MLPs and only differences x_i - x_j are moved
along, so f commutes with rotations, reflections, translations and permutations, and
f(z, t) is smooth in z (|d| is evaluated as (d^2 + eps)^(1/2)). The tanh bounds every pair's
displacement in a layer by c, and dividing the direction by |d| + 1 keeps far pairs from
dominating (both as in E-NF, where c = 15 / L).

Unlike :class:`~flowattn.flows.AttentionField` this field has no certified Lipschitz
constant: the ODE it defines has a unique solution for all times (the field is smooth, hence
locally Lipschitz, and bounded, |f_i| <= c L (n - 1) before centring, so no solution blows
up), but nothing bounds how fast nearby trajectories separate. It is the
reference dynamics for particle systems; the certified alternative is a residual flow of
:class:`~flowattn.branches.RadialInteraction` and
:class:`~flowattn.branches.NeighbourhoodInteraction` blocks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...errors import InputError
from ...passes import per_pass
from ...validation import check_sets, present_weights
from ..geometry import project, set_times

__all__ = ["EGNNField"]

def _mlp(inputs: int, hidden: int, outputs: int, final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.SiLU(), nn.Linear(hidden, outputs)]
    if final_activation:
        layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class _EquivariantLayer(nn.Module):
    """One EGNN layer (eqs. (3)-(6) of Satorras et al. 2021) on dense (B, N, N) pair tensors."""

    def __init__(self, hidden: int, step: float, attention: bool, eps: float) -> None:
        super().__init__()
        self.step, self.eps = step, eps
        self.message = _mlp(2 * hidden + 2, hidden, hidden, final_activation=True)
        self.gate = nn.Linear(hidden, 1) if attention else None
        self.update = _mlp(2 * hidden, hidden, hidden, final_activation=False)
        self.displacement = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(),
                                          nn.Linear(hidden, 1, bias=False))
        # the field starts near zero: the flow starts near the identity
        bound = 1e-3 * math.sqrt(6.0 / (hidden + 1))
        nn.init.uniform_(self.displacement[-1].weight, -bound, bound)

    def forward(self, h: Tensor, x: Tensor, start_sq: Tensor, pairs: Tensor
                ) -> tuple[Tensor, Tensor]:
        diff = x[:, :, None] - x[:, None, :]  # (B, N, N, D): x_i - x_j
        dist_sq = diff.pow(2).sum(-1, keepdim=True)
        m = self.message[1:](self._first_message_layer(h, dist_sq, start_sq))
        if self.gate is not None:
            m = m * torch.sigmoid(self.gate(m))
        m = m * pairs  # only pairs of distinct present elements
        direction = diff / ((dist_sq + self.eps).sqrt() + 1.0)
        push = self.step * torch.tanh(self.displacement(m))
        x = x + (direction * push * pairs).sum(2)
        h = h + self.update(torch.cat([h, m.sum(2)], dim=-1))
        return h, x

    def _first_message_layer(self, h: Tensor, dist_sq: Tensor, start_sq: Tensor) -> Tensor:
        """phi_e's first linear map of [h_i, h_j, |x_i - x_j|^2, |z_i - z_j|^2], (B, N, N, H),
        split by its inputs: W [h_i; h_j; d; s] + b = (W_i h_i + b) + W_j h_j + W_ds [d; s].
        The feature parts are products of (B, N, H) tensors, broadcast over the pairs: the
        (B, N, N, 2H + 2) concatenation and its product, the largest of a layer, are never
        formed (the same map and weights as ``self.message[0]`` applied to it)."""
        linear, width = self.message[0], h.shape[-1]
        weight = linear.weight  # (H, 2H + 2)
        own = torch.nn.functional.linear(h, weight[:, :width], linear.bias)  # (B, N, H)
        other = h @ weight[:, width:2 * width].T
        distances = torch.cat([dist_sq, start_sq], dim=-1) @ weight[:, 2 * width:].T
        return distances + own[:, :, None] + other[:, None, :]


class EGNNField(nn.Module):
    r"""Time-dependent E(n)-equivariant vector field f(z, t) for particle systems (E-NF dynamics).

    See the module docstring for the equations. Inputs are (B, N, D) sets of positions with an
    optional (B, N) padding mask (True = present); padded elements neither send nor receive
    messages and get zero velocity. With ``zero_com`` the output's centre of mass is removed,
    so the dynamics stay on {sum_i z_i = 0} (the :class:`~flowattn.flows.CNF` reads this
    attribute).

    Arguments:
        dim: D, the dimension of the positions.
        hidden: width of the features and of every MLP.
        layers: L, the number of message-passing layers.
        attention: gate each message by sigmoid(w^T m_ij) (E-NF's setting).
        coords_range: c L, the bound on one pair's total displacement over the L layers.
        zero_com: remove the output's centre of mass.
        eps: smoothing of the distance, |d| = (d^2 + eps)^(1/2).

    Examples:
        >>> field = EGNNField(dim=2, hidden=16, layers=2)
        >>> z = torch.randn(3, 4, 2)
        >>> field(torch.tensor(0.5), z).shape
        torch.Size([3, 4, 2])
        >>> rotation = torch.tensor([[0.0, -1.0], [1.0, 0.0]])
        >>> bool(torch.allclose(field(0.5, z @ rotation.T), field(0.5, z) @ rotation.T,
        ...                     atol=1e-6))
        True
    """

    takes_sets = True  # a field of sets (B, N, D): a CNF refuses (B, D) vectors for it

    def __init__(self, dim: int, hidden: int = 32, layers: int = 3, attention: bool = True,
                 coords_range: float = 15.0, zero_com: bool = True, eps: float = 1e-8) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden), ("layers", layers)):
            if not (isinstance(value, int) and value >= 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if not (math.isfinite(coords_range) and coords_range > 0):
            raise InputError(f"coords_range must be a positive number, got {coords_range!r}")
        if not eps > 0:
            raise InputError(f"eps must be positive, got {eps!r}")
        self.dim, self.zero_com = dim, zero_com
        self.embed_time = nn.Linear(1, hidden)
        step = coords_range / layers
        self.layers = nn.ModuleList(
            _EquivariantLayer(hidden, step, attention, eps) for _ in range(layers))

    def forward(self, t: Tensor | float, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """dz/dt at time ``t`` for positions ``z`` (B, N, D); ``mask`` (B, N): present ones.

        ``t`` is one time for every set, or a (B,) tensor of one time per set (flow matching).
        """
        mask = check_sets(z, mask, self.dim, name="z", module=self)
        t = set_times(t, z)  # (1 or B, 1)
        chunk = self._chunk(z)
        if chunk >= z.shape[0]:
            return self._field(t, z, mask)
        parts = [self._field(t if t.shape[0] == 1 else t[start:start + chunk],
                             z[start:start + chunk],
                             None if mask is None else mask[start:start + chunk])
                 for start in range(0, z.shape[0], chunk)]
        return torch.cat(parts)

    def _chunk(self, z: Tensor) -> int:
        """How many sets of ``z`` one pass takes: on the CPU, as many as keep a (sets, N, N, H)
        pair tensor within :data:`~flowattn.passes.PAIR_BYTES` (16 MB); elsewhere all of them
        (:func:`~flowattn.passes.per_pass`).

        A CPU allocator hands a block above a few tens of megabytes (glibc: 32 MB) straight
        from the operating system and back, so every pass over a fresh tensor of that size
        pays its page faults: for LJ55 (N = 55) at batch 100 a forward and backward took
        1.9 s in one pass and 0.57-0.67 s in passes of 25-50 sets (one thread). The sets are
        independent, so the result is the same."""
        width = self.embed_time.out_features
        return per_pass(z.shape[1] ** 2 * width * z.element_size(), z.shape[0], z.device)

    def _field(self, t: Tensor, z: Tensor, mask: Tensor | None) -> Tensor:
        """The field on one pass's sets (``t`` (1 or B, 1), checked inputs)."""
        present = present_weights(z, mask)
        off_diagonal = 1.0 - torch.eye(z.shape[1], dtype=z.dtype, device=z.device)
        pairs = (present[:, :, None] * present[:, None, :] * off_diagonal)[..., None]
        t = t.unsqueeze(-1)  # (1 or B, 1, 1)
        h = self.embed_time(t).expand(z.shape[0], z.shape[1], -1)
        start_sq = (z[:, :, None] - z[:, None, :]).pow(2).sum(-1, keepdim=True)
        x = z
        for layer in self.layers:
            h, x = layer(h, x, start_sq, pairs)
        return project(x - z, mask, self.zero_com)
