r"""Importance-sampling statistics from log weights: Kish ESS, self-normalised means, log Z.

Given draws x_1 ... x_n from a proposal q and an unnormalised target density γ (for a
Boltzmann generator γ(x) = exp(-E(x) / kT) and q the flow), the importance weights are
w_i = γ(x_i) / q(x_i). Everything here takes their logarithms, log w_i, and works with
w_i / max_j w_j, so weights spanning hundreds of nats neither overflow nor underflow. A weight
of zero (log w = -inf, a configuration the target rules out) is allowed; NaN and +inf are not.

* :func:`kish_ess` -- the effective sample size (Σ w)^2 / Σ w^2 as a fraction of n;
* :func:`self_normalised_mean` -- Σ w_i f_i / Σ w_i and its delta-method standard error;
* :func:`log_mean_weight` -- log of (1/n) Σ w_i (an unbiased estimate of Z / Z_q) and its
  delta-method standard error;
* :func:`event_kl` -- the KL divergence of two Bernoulli laws, kl(p || q): by the
  data-processing inequality a lower bound on KL(P || Q) from the probabilities p = P(A) and
  q = Q(A) that two densities give any one event A.

No model is involved: the functions serve the flow's weights and annealed importance sampling
alike (:mod:`flowattn.data.partition`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import InputError, NonFiniteError

__all__ = ["kish_ess", "self_normalised_mean", "log_mean_weight", "normalised_weights",
           "event_kl"]


def kish_ess(log_w: Tensor) -> Tensor:
    r"""Kish's effective sample size as a fraction of the sample: (Σ w)^2 / (n Σ w^2).

    It is 1 for equal weights and 1/n when one weight dominates all others; n times it is the
    number of equally weighted draws that would give a mean of the same variance, for a
    function uncorrelated with the weights (Kish 1965, *Survey Sampling*; Owen 2013, *Monte
    Carlo theory, methods and examples*, ch. 9).

    Arguments:
        log_w: log importance weights, shape (n,).

    Returns:
        A 0-dim tensor in [1/n, 1], on the weights' device.

    Examples:
        >>> kish_ess(torch.zeros(4)).item()
        1.0
        >>> kish_ess(torch.tensor([0.0, -1e3, -1e3, -1e3])).item()
        0.25
    """
    log_w = _check_log_weights(log_w)
    n = log_w.shape[0]
    return torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)) / n


def normalised_weights(log_w: Tensor) -> Tensor:
    """Self-normalised weights w_i / Σ_j w_j (a softmax of the log weights), shape (n,).

    Examples:
        >>> [round(w, 6) for w in normalised_weights(torch.tensor([0.0, math.log(3.0)])).tolist()]
        [0.25, 0.75]
    """
    return torch.softmax(_check_log_weights(log_w), 0)


def self_normalised_mean(log_w: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    r"""The self-normalised importance-sampling estimate of E_p[f] and its standard error.

    With normalised weights w̄_i = w_i / Σ_j w_j,

        μ̂ = Σ_i w̄_i f(x_i),    se(μ̂)^2 = Σ_i w̄_i^2 (f(x_i) - μ̂)^2,

    the delta-method variance of the ratio estimator (Owen 2013, *Monte Carlo theory, methods
    and examples*, ch. 9, self-normalised importance sampling). μ̂ is consistent, with an
    O(1/n) bias; the error is reliable only when the effective sample size
    (:func:`kish_ess`) is not tiny -- with a handful of effective draws both can be far off,
    and the error then tends to be too small.

    Arguments:
        log_w: log importance weights, shape (n,).
        values: f(x_i), shape (n,), finite wherever the weight is not zero.

    Returns:
        (estimate, standard error), 0-dim tensors in the dtype of ``values`` (of the weights
        for integer or boolean values, such as counts and indicators).

    Examples:
        >>> log_w = torch.tensor([0.0, 0.0, math.log(2.0)])
        >>> mean, error = self_normalised_mean(log_w, torch.tensor([1.0, 1.0, 4.0]))
        >>> round(mean.item(), 6), round(error.item(), 6)
        (2.5, 0.918559)
    """
    w = normalised_weights(log_w)
    if not isinstance(values, Tensor) or values.shape != w.shape:
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise InputError(f"values must be a tensor of the weights' shape {tuple(w.shape)}, "
                         f"got {shape}")
    if not values.is_floating_point():  # counts or indicators: their mean is not an integer
        values = values.to(w.dtype)
    used = w > 0
    if not torch.isfinite(values[used]).all():
        raise NonFiniteError("values hold NaN or Inf where the weight is not zero")
    f = torch.where(used, values, torch.zeros_like(values))
    w = w.to(f.dtype)
    mean = (w * f).sum()
    error = (w.pow(2) * (f - mean).pow(2)).sum().sqrt()
    return mean, error


def log_mean_weight(log_w: Tensor) -> tuple[Tensor, Tensor]:
    r"""log of the mean importance weight, log((1/n) Σ w_i), and its standard error.

    For w = γ / q with q normalised, (1/n) Σ w_i is an unbiased estimate of Z = ∫ γ; so is the
    mean of annealed-importance weights (Neal 2001, *Annealed importance sampling*, §3). The
    error of its logarithm is the delta-method one,

        se(log Ẑ) = s_w / (√n · w̄),

    with w̄ and s_w the mean and the standard deviation (n - 1 in the denominator) of the
    weights; log Ẑ itself is biased low by about se^2 / 2 (Jensen).

    Arguments:
        log_w: log importance weights, shape (n,), n >= 2.

    Returns:
        (log Ẑ, its standard error), 0-dim tensors.

    Examples:
        >>> log_z, error = log_mean_weight(torch.tensor([0.0, math.log(3.0)]))
        >>> round(log_z.item(), 6), round(error.item(), 6)  # log 2; s_w = √2, w̄ = 2
        (0.693147, 0.5)
    """
    log_w = _check_log_weights(log_w)
    n = log_w.shape[0]
    if n < 2:
        raise InputError(f"log_mean_weight needs at least 2 weights for an error, got {n}")
    top = log_w.max()
    scaled = torch.exp(log_w - top)
    log_z = top + scaled.mean().log()
    error = scaled.std() / (math.sqrt(n) * scaled.mean())
    return log_z, error


def event_kl(p: float, q: float) -> float:
    r"""kl(p || q) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)), in nats.

    Any two densities P and Q, reduced to the indicator of one event A, become Bernoulli laws
    with P(A) = p and Q(A) = q; reducing cannot increase a KL divergence (the data-processing
    inequality, e.g. Cover & Thomas 2006, Thm 2.8.1), so KL(P || Q) >= kl(p || q). For a model Q
    of a target P that is fitted by maximum likelihood, KL(P || Q) is the test NLL minus the
    target's entropy (the floor), so the mass a model puts on an event the target (almost)
    never produces is a lower bound on its distance from the floor: with p = 0 the bound is
    -log(1 - q).

    Arguments:
        p: P(A), in [0, 1].
        q: Q(A), in (0, 1) (at 0 or 1 the bound is infinite unless p equals q).

    Returns:
        kl(p || q) >= 0; +inf where q is 0 or 1 and p differs from it.

    Examples:
        >>> round(event_kl(0.0, 0.5), 6)  # a model that puts half its mass where P puts none
        0.693147
        >>> event_kl(0.3, 0.3)
        0.0
    """
    for name, value in (("p", p), ("q", q)):
        if not 0.0 <= value <= 1.0:  # also refuses NaN
            raise InputError(f"{name} must be a probability in [0, 1], got {value}")

    def term(a: float, b: float) -> float:  # a log(a / b), with 0 log 0 = 0
        if a == 0.0:
            return 0.0
        return math.inf if b == 0.0 else a * math.log(a / b)

    return max(term(p, q) + term(1.0 - p, 1.0 - q), 0.0)


def _check_log_weights(log_w: Tensor) -> Tensor:
    if not isinstance(log_w, Tensor) or log_w.dim() != 1 or log_w.shape[0] == 0:
        shape = tuple(log_w.shape) if isinstance(log_w, Tensor) else type(log_w).__name__
        raise InputError(f"log weights must be a non-empty 1-D tensor, got {shape}")
    if not log_w.is_floating_point():
        raise InputError(f"log weights must be floating point, got {log_w.dtype}")
    if torch.isnan(log_w).any() or (log_w == math.inf).any():
        raise NonFiniteError("log weights hold NaN or +Inf")
    if (log_w == -math.inf).all():
        raise NonFiniteError("every log weight is -Inf: the target rules out every draw")
    return log_w
