"""ActNorm for sets and sequences: a per-feature affine map with data-dependent initialisation."""

from __future__ import annotations

import torch
from nflows.transforms import Transform
from torch import Tensor, nn

from ..validation import check_sets
from .base import set_dims
from .geometry import mask_from_context

__all__ = ["ActNorm"]


class ActNorm(Transform):
    r"""Per-feature affine map y_i = (x_i + b) * exp(s) applied to every present element.

    References:
        Kingma & Dhariwal, "Glow", NeurIPS 2018, §3.1 (ActNorm with data-dependent init).

    On the first forward call in training mode, b and s are set so that the present elements of
    that batch have zero mean and unit variance per feature (padded elements are excluded from
    the statistics). Padded elements pass through unchanged. The log-determinant of a set of n
    present elements is n * sum_d s_d.

    With ``zero_com=True`` (particle systems) the shift is fixed to zero so that a zero centre of
    mass is preserved, the scale is initialised from the root-mean-square per feature, and the
    log-determinant is that of the map restricted to the (n - 1) D-dimensional subspace:
    (n - 1) sum_d s_d.

    Arguments:
        dim: feature width D.
        zero_com: zero-centre-of-mass mode.
        eps: added to the standard deviation at initialisation.

    Examples:
        >>> act = ActNorm(3)
        >>> y, logdet = act(torch.randn(8, 5, 3) * 4 + 1)
        >>> bool(y.mean(dim=(0, 1)).abs().max() < 1e-5)
        True
    """

    def __init__(self, dim: int, zero_com: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.zero_com = bool(zero_com)
        self.eps = float(eps)
        self.log_scale = nn.Parameter(torch.zeros(dim))
        self.shift = nn.Parameter(torch.zeros(dim), requires_grad=not zero_com)
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _initialize(self, x: Tensor, mask: Tensor | None) -> None:
        w = (torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None
             else mask.to(x.dtype)).unsqueeze(-1)
        count = w.sum(dim=(0, 1))
        if self.zero_com:
            mean = torch.zeros_like(count)
        else:
            mean = (x * w).sum(dim=(0, 1)) / count
        var = ((x - mean).pow(2) * w).sum(dim=(0, 1)) / count
        self.shift.copy_(-mean)
        self.log_scale.copy_(-torch.log(var.sqrt() + self.eps))
        self.initialized.fill_(True)

    def _logdet(self, x: Tensor, mask: Tensor | None) -> Tensor:
        # set_dims gives n D (or (n - 1) D); every feature direction holds 1/D of them.
        count = set_dims(x, mask, self.zero_com) / x.shape[-1]
        return count * self.log_scale.sum()

    def _prepare(self, inputs: Tensor, context):
        flat = isinstance(inputs, Tensor) and inputs.dim() == 2
        x = inputs.unsqueeze(1) if flat else inputs
        mask = check_sets(x, mask_from_context(context, x), dim=self.dim, name="inputs")
        return x, mask, flat

    def forward(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        x, mask, flat = self._prepare(inputs, context)
        if self.training and not bool(self.initialized):
            self._initialize(x, mask)
        y = (x + self.shift) * torch.exp(self.log_scale)
        if mask is not None:
            y = torch.where(mask.unsqueeze(-1), y, x)
        return (y.squeeze(1) if flat else y), self._logdet(x, mask)

    def inverse(self, inputs: Tensor, context=None) -> tuple[Tensor, Tensor]:
        y, mask, flat = self._prepare(inputs, context)
        x = y * torch.exp(-self.log_scale) - self.shift
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), x, y)
        return (x.squeeze(1) if flat else x), -self._logdet(y, mask)
