"""Lipschitz constants: certified upper bounds and measured lower bounds.

Upper bounds (certificates) are closed-form functions of the weights:

* tied L2 multi-head attention: Theorem 3.2 of Kim, Papamakarios & Mnih (2021) and the tight
  certificate of ``docs/attention.md`` (:mod:`~flowattn.lipschitz.attention`), built on the
  constants of the parameter-free attention cores (:mod:`~flowattn.lipschitz.core`) and the
  Lambert W function (:mod:`~flowattn.lipschitz.lambertw`);
* Appendix N of the same paper for LayerNorm, and the exact constant of LipsFormer's CenterNorm
  (:mod:`~flowattn.lipschitz.normalization`);
* matrix norms: the max-row-sum norm and the spectral norm (exact from an eigensolver, a
  certified upper bound from matrix products alone, or power iteration;
  :mod:`~flowattn.lipschitz.norms`).

Lower bounds are measured (:mod:`~flowattn.lipschitz.measurement`): ``jacobian_norm`` at a
point, and ``lipschitz_lower_bound`` which maximises it over inputs as in Kim et al. (2021),
Appendix H. What a certificate is asked for (norm names, key counts, precision) is checked in
:mod:`~flowattn.lipschitz.checks`.

Conventions: a map f acts on one set X in R^{N x D}; its Jacobian is the (N D) x (N D) matrix
d vec(f(X)) / d vec(X) with row-major vec. ``p = "inf"`` is the max-row-sum norm of that matrix
(the operator norm for the max-abs vector norm); ``p = 2`` is its largest singular value.
"""

from .attention import induced_attention_bound, l2_attention_bound
from .checks import check_certificate_precision, check_counts
from .core import (
    induced_core_constant,
    l2_core_column_constant,
    l2_core_kernel_constant,
    l2_core_row_constant,
    logit_margin_constant,
)
from .lambertw import lambertw0, phi_inverse
from .measurement import jacobian, jacobian_norm, lipschitz_lower_bound, mixed_operator_norm
from .normalization import centernorm_lipschitz_bound, layernorm_lipschitz_bound
from .norms import (
    PowerIteration,
    matrix_inf_norm,
    power_iteration,
    spectral_norm_bound,
    spectral_norm_exact,
)

__all__ = [
    "lambertw0",
    "check_counts",
    "check_certificate_precision",
    "phi_inverse",
    "matrix_inf_norm",
    "spectral_norm_exact",
    "spectral_norm_bound",
    "power_iteration",
    "PowerIteration",
    "l2_attention_bound",
    "induced_attention_bound",
    "induced_core_constant",
    "l2_core_row_constant",
    "l2_core_column_constant",
    "l2_core_kernel_constant",
    "logit_margin_constant",
    "layernorm_lipschitz_bound",
    "centernorm_lipschitz_bound",
    "jacobian",
    "jacobian_norm",
    "mixed_operator_norm",
    "lipschitz_lower_bound",
]
