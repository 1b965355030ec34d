"""The projection weight matrices of an attention module and what each one does."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Projection", "PROJECTION_ROLES", "PROJECTION_LAYOUTS"]

PROJECTION_ROLES = ("qkv", "query", "key", "value", "output")
PROJECTION_LAYOUTS = ("linear", "raw")


@dataclass(frozen=True, eq=False)
class Projection:
    """One projection weight matrix of an attention module, as listed by its ``projections()``.

    Attributes:
        name: the parameter's name inside the module: ``module.get_parameter(name)`` is
            ``weight``.
        role: ``"query"``, ``"key"``, ``"value"``, ``"output"`` (the map back to the model
            width, the last one of a residual branch), or ``"qkv"`` for a fused
            query-key-value map.
        weight: the parameter itself; initialising it in place initialises the module.
        layout: ``"linear"``: an :class:`torch.nn.Linear` weight, stored (out, in) and applied
            as x W^T; ``"raw"``: a raw matrix stored (in, out) and applied as x W (the row
            convention of the papers).

    Examples:
        >>> from flowattn.attention import L2MHA
        >>> [(p.name, p.role, p.layout) for p in L2MHA(8, 2).projections()][:2]
        [('w_q', 'query', 'raw'), ('w_v', 'value', 'raw')]
    """

    name: str
    role: str
    weight: Tensor
    layout: str

    @property
    def matrix(self) -> Tensor:
        """The map as an (out, in) matrix W with y = W x, whatever the layout."""
        return self.weight if self.layout == "linear" else self.weight.t()

    @property
    def fan_in(self) -> int:
        """The input width of the map."""
        return self.weight.shape[1] if self.layout == "linear" else self.weight.shape[0]
