"""Cross-device checks: every estimator and model of flowattn on CUDA against the CPU.

Each test builds its object on the CPU in float64 from a fixed seed, deep-copies it to the
device under test (``copy.deepcopy(m).to(DEVICE)``) and runs both copies on the same inputs.
Outputs, log-determinants, certificates and gradients must agree to float64 rounding
(``RTOL``/``ATOL``) wherever the computation is deterministic, and every result must lie on the
device. Random estimators get identical probes: the library draws Hutchinson probes and
roulette lengths from the generator it is given, on that generator's device, and moves them to
the data, so a seeded CPU generator gives both copies the same draws. Where the library draws
on the data's device itself (the evaluation-mode log-det series, sampling), the estimates are
held to the exact value within their own standard error instead. Float32 copies on the device
are held to the float64 CPU values within ``F32_RTOL``/``F32_ATOL``.

The device is ``$FLOWATTN_TEST_DEVICE`` or, when that is unset, ``cuda`` where available;
without either the module is skipped. ``FLOWATTN_TEST_DEVICE=cpu`` dry-runs every check on the
CPU (CPU against CPU).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from nflows.transforms import CompositeTransform
from torch import Tensor, nn

from flowattn import lipschitz as lip
from flowattn.attention import (
    L2MHA,
    ContractiveInducedL2MHA,
    ContractiveL2MHA,
    ContractiveScaledCosineMHA,
    DotProductMHA,
    InducedL2MHA,
    ScaledCosineMHA,
)
from flowattn.attention.contractive import ContractiveAttention
from flowattn.branches import LipschitzMLP, NeighbourhoodInteraction, RadialInteraction
from flowattn.cli import main
from flowattn.data import dw4_energy, save_npz
from flowattn.errors import InputError
from flowattn.flows import (
    CNF,
    ActNorm,
    AttentionField,
    DotProductField,
    EGNNField,
    EquivariantLinear,
    InverseMonotoneResidual,
    InverseOptions,
    InvertibleResidual,
    LogDetOptions,
    MonotoneResidual,
    SetCoupling,
    SetFlow,
    SetLocation,
    TransformerResidualPair,
    coupling_flow,
    sequence_flow,
    set_flow,
)
from flowattn.flows.continuous.divergence import exact_divergence, hutchinson_divergence
from flowattn.flows.geometry import subtract_mean
from flowattn.flows.logdet import (
    exact_logdet,
    jacobian_logdet,
    precise_series_logdet,
    roulette_logdet,
    series_logdet,
)
from flowattn.importance import kish_ess, log_mean_weight, normalised_weights, self_normalised_mean
from flowattn.lm.config import ATTENTIONS, LMConfig
from flowattn.lm.invertible import invert_hidden_states, reconstruction_report
from flowattn.lm.model import build_model
from flowattn.sets.boltzmann import boltzmann_sample
from flowattn.sets.config import SetsFlow, build_flow

DEVICE = os.environ.get("FLOWATTN_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
if DEVICE is None:
    pytest.skip("no CUDA device (set FLOWATTN_TEST_DEVICE to run these cross-device checks "
                "elsewhere)", allow_module_level=True)

DEV = torch.device(DEVICE)
RTOL, ATOL = 1e-9, 1e-10  # float64, the same operations on both devices
F32_RTOL, F32_ATOL = 1e-4, 1e-4  # float32 on the device against float64 on the CPU
ROUND_TRIP = 1e-8  # x -> y -> x in float64, inverses solved to 1e-12

M = TypeVar("M", bound=nn.Module)
Results = dict[str, Any]

# ----------------------------------------------------------------------------- helpers


def on_device(module: M) -> M:
    """A deep copy of ``module`` on the device under test (the CPU original is untouched)."""
    return copy.deepcopy(module).to(DEV)


def both(module: M) -> tuple[M, M]:
    """(the CPU module, its copy on the device), copied before either has run."""
    return module, on_device(module)


def to_device(obj: Any) -> Any:
    """``obj`` with every tensor in it (nested tuples, lists and dicts) moved to the device."""
    if isinstance(obj, Tensor):
        return obj.to(DEV)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(item) for item in obj)
    if isinstance(obj, dict):
        return {key: to_device(value) for key, value in obj.items()}
    return obj


def leaves(obj: Any, name: str = "") -> Iterator[tuple[str, Tensor | float | None]]:
    """(path, value) of every tensor, number or None in a nested result."""
    if obj is None or isinstance(obj, (Tensor, int, float)):
        yield name or "value", obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{name}.{key}" if name else str(key))
    elif isinstance(obj, (tuple, list)):
        for index, value in enumerate(obj):
            yield from leaves(value, f"{name}[{index}]")
    else:
        raise TypeError(f"cannot compare a {type(obj).__name__} at {name!r}")


def is_on_device(t: Tensor) -> bool:
    return t.device.type == DEV.type and (DEV.index is None or t.device.index == DEV.index)


def assert_on_device(obj: Any, what: str) -> None:
    """Every tensor of a nested result lies on the device under test."""
    for name, value in leaves(obj):
        if isinstance(value, Tensor):
            assert is_on_device(value), f"{what}: {name} is on {value.device}, not {DEVICE}"


def assert_matches_cpu(
    actual: Any, expected: Any, what: str, rtol: float = RTOL, atol: float = ATOL,
    cast: bool = False, scaled: bool = False,
) -> None:
    """``actual`` (computed on the device) equals ``expected`` (on the CPU) leaf by leaf, and
    lies on the device. Without ``cast`` the dtypes must agree as well; with ``scaled`` the
    absolute tolerance of a leaf grows with its largest entry (float32 sums of many terms)."""
    assert_on_device(actual, what)
    found, wanted = dict(leaves(actual)), dict(leaves(expected))
    assert found.keys() == wanted.keys(), f"{what}: results {sorted(found)} != {sorted(wanted)}"
    for name, want in wanted.items():
        got = found[name]
        if want is None or got is None:
            assert got is None and want is None, f"{what}: {name} is None on one device only"
            continue
        if not isinstance(want, Tensor):
            got = got.item() if isinstance(got, Tensor) else got
            assert got == pytest.approx(want, rel=rtol, abs=atol), (
                f"{what}: {name} is {got} on {DEVICE} and {want} on the CPU")
            continue
        got = got.detach().cpu()
        if cast:
            got = got.to(want.dtype)
        tol = atol * max(1.0, float(want.abs().max())) if scaled and want.numel() else atol
        torch.testing.assert_close(
            got, want.detach(), rtol=rtol, atol=tol,
            msg=lambda text, name=name: f"{what}: {name} differs between {DEVICE} and the "
            f"CPU\n{text}")


def randn(*shape: int, seed: int = 0) -> Tensor:
    """Standard normal float64 values on the CPU from their own seeded generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def set_mask(batch: int, n: int) -> Tensor:
    """A padding mask: set 1 lacks its last two elements, set 2 its second one."""
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, n - 2:] = False
    mask[2, 1] = False
    return mask


def trainable(module: nn.Module) -> dict[str, Tensor]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def gradients(loss: Tensor, wrt: dict[str, Tensor]) -> dict[str, Tensor | None]:
    """d loss / d each of ``wrt``, keyed ``grad.<name>`` (None where it does not depend)."""
    found = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return {f"grad.{name}": g for name, g in zip(wrt, found, strict=True)}


@torch.no_grad()
def perturb(module: nn.Module, scale: float = 0.1, seed: int = 1) -> None:
    """Move every trainable parameter off its initial value (offsets, coupling heads and
    equivariant maps start at zero or the identity, where a device bug could hide)."""
    generator = torch.Generator().manual_seed(seed)
    for p in trainable(module).values():
        p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device))


def cpu_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_round_trip(x: Tensor, x_back: Tensor, what: str, tol: float = ROUND_TRIP) -> None:
    assert_on_device(x_back, what)
    error = float((x_back - x).abs().max())
    assert error <= tol, f"{what}: x -> y -> x misses by {error:.3g} > {tol:g} on {DEVICE}"


# ----------------------------------------------------------------------------- attention

DIM, HEADS, N, B = 4, 2, 5, 3

ATTENTION: dict[str, Callable[[], nn.Module]] = {
    "dot-product": lambda: DotProductMHA(DIM, HEADS),
    "l2-tied": lambda: L2MHA(DIM, HEADS, tied=True),
    "l2-tied-reference": lambda: L2MHA(DIM, HEADS, tied=True, fused=False),
    "l2-untied": lambda: L2MHA(DIM, HEADS, tied=False),
    "l2-orthogonal": lambda: L2MHA(DIM, HEADS, parametrization="orthogonal"),
    "l2-offsets": lambda: L2MHA(DIM, HEADS, self_offset=2.0, position_bias=1.0, max_distance=3),
    "contractive-l2": lambda: ContractiveL2MHA(DIM, HEADS, coeff=0.9),
    "contractive-l2-norm2": lambda: ContractiveL2MHA(DIM, HEADS, norm=2),
    "contractive-l2-mixed": lambda: ContractiveL2MHA(DIM, HEADS, norm="2,inf"),
    "contractive-l2-thm3.2": lambda: ContractiveL2MHA(DIM, HEADS, certificate="thm3.2"),
    "contractive-l2-orthogonal": lambda: ContractiveL2MHA(DIM, HEADS,
                                                          parametrization="orthogonal"),
    "contractive-l2-self-offset": lambda: ContractiveL2MHA(DIM, HEADS, self_offset=2.0),
    "contractive-l2-position-bias": lambda: ContractiveL2MHA(DIM, HEADS, position_bias=1.5,
                                                             max_distance=3),
    "contractive-l2-offsets-margin": lambda: ContractiveL2MHA(
        DIM, HEADS, self_offset=1.0, position_bias=1.0, offset_certificate="margin"),
    "contractive-l2-output-dropout": lambda: ContractiveL2MHA(DIM, HEADS, output_dropout=0.25),
    "scaled-cosine": lambda: ScaledCosineMHA(DIM, HEADS),
    "contractive-scaled-cosine": lambda: ContractiveScaledCosineMHA(DIM, HEADS),
    "contractive-scaled-cosine-norm2": lambda: ContractiveScaledCosineMHA(DIM, HEADS, norm=2),
    "induced": lambda: InducedL2MHA(DIM, HEADS, inducing=3),
    "contractive-induced": lambda: ContractiveInducedL2MHA(DIM, HEADS, inducing=3),
}
SETS_ONLY = {"induced", "contractive-induced"}  # no causal form
NOT_LIPSCHITZ = {"dot-product", "l2-untied"}  # no certificate
SETTINGS = ("plain", "masked", "causal", "masked-causal")
ATTENTION_CASES = [(kind, setting) for kind in ATTENTION for setting in SETTINGS
                   if not (kind in SETS_ONLY and "causal" in setting)]
HARDEST = [(kind, "masked" if kind in SETS_ONLY else "masked-causal") for kind in ATTENTION]


def make_attention(kind: str) -> nn.Module:
    """The module ``kind`` in float64 and evaluation mode, parameters perturbed."""
    torch.manual_seed(0)
    module = ATTENTION[kind]().double().eval()
    perturb(module)
    return module


def setting_inputs(setting: str) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """(x, output cotangent w, mask, causal) for a setting of :data:`SETTINGS`."""
    mask = set_mask(B, N) if "masked" in setting else None
    return 2 * randn(B, N, DIM, seed=2), randn(B, N, DIM, seed=3), mask, "causal" in setting


def attention_results(module: nn.Module, x: Tensor, w: Tensor, mask: Tensor | None,
                      causal: bool) -> Results:
    """Output, attention matrices and the gradients of <output, w> w.r.t. x and parameters."""
    x = x.detach().clone().requires_grad_(True)
    y = module(x, mask=mask, causal=causal)
    results = {"output": y.detach(), **gradients((y * w).sum(), {"x": x, **trainable(module)})}
    with torch.no_grad():
        results["probabilities"] = module.attention_probabilities(x, mask=mask, causal=causal)
    return results


@pytest.mark.parametrize(("kind", "setting"), ATTENTION_CASES)
def test_attention_outputs_probabilities_and_gradients_match_cpu(kind: str, setting: str):
    cpu, dev = both(make_attention(kind))
    x, w, mask, causal = setting_inputs(setting)
    expected = attention_results(cpu, x, w, mask, causal)
    actual = attention_results(dev, *to_device((x, w, mask)), causal)
    assert_matches_cpu(actual, expected, f"{kind} ({setting})")


@pytest.mark.parametrize(("kind", "setting"), HARDEST)
def test_attention_in_float32_on_device_agrees_with_float64_cpu(kind: str, setting: str):
    """The float32 kernels of the device (fused attention where it serves) within 1e-4."""
    cpu = make_attention(kind)
    dev = on_device(cpu).float()
    x, w, mask, causal = setting_inputs(setting)
    expected = attention_results(cpu, x, w, mask, causal)
    actual = attention_results(dev, *to_device((x.float(), w.float(), mask)), causal)
    for name, value in leaves(actual):
        assert value is None or value.dtype == torch.float32, f"{kind}: {name} is {value.dtype}"
    assert_matches_cpu(actual, expected, f"{kind} ({setting}, float32)",
                       F32_RTOL, F32_ATOL, cast=True)


@pytest.mark.parametrize("kind", ["dot-product", "l2-tied", "l2-untied", "contractive-l2",
                                  "contractive-l2-mixed", "scaled-cosine",
                                  "contractive-scaled-cosine"])
@pytest.mark.parametrize("width", [14, 16])
def test_attention_at_kernel_friendly_widths_in_float32_agrees_with_float64_cpu(
    kind: str, width: int
):
    """Head widths 7 and 8 (8 and 9 for L2's augmented logits) over 40 elements: where the
    device's fused attention kernels serve, their outputs and gradients within 1e-4."""
    torch.manual_seed(0)
    cpu = {"dot-product": lambda: DotProductMHA(width, 2),
           "l2-tied": lambda: L2MHA(width, 2),
           "l2-untied": lambda: L2MHA(width, 2, tied=False),
           "contractive-l2": lambda: ContractiveL2MHA(width, 2),
           "contractive-l2-mixed": lambda: ContractiveL2MHA(width, 2, norm="2,inf"),
           "scaled-cosine": lambda: ScaledCosineMHA(width, 2, eps=1e-2),
           "contractive-scaled-cosine": lambda: ContractiveScaledCosineMHA(width, 2),
           }[kind]().double().eval()
    dev = on_device(cpu).float()
    mask = set_mask(B, 40)
    x, w = randn(B, 40, width, seed=21), randn(B, 40, width, seed=22)
    expected = attention_results(cpu, x, w, mask, True)
    actual = attention_results(dev, *to_device((x.float(), w.float(), mask)), True)
    assert_matches_cpu(actual, expected, f"{kind} (width {width}, float32)", F32_RTOL,
                       F32_ATOL, cast=True, scaled=True)


def second_derivatives(module: nn.Module, x: Tensor, w: Tensor, mask: Tensor | None,
                       causal: bool) -> Results:
    """Gradients of ||d<F(x), w>/dx||^2 (a double backward through the attention kernel)."""
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad((module(x, mask=mask, causal=causal) * w).sum(), x,
                               create_graph=True)
    return {"first": g.detach(), **gradients(g.pow(2).sum(), {"x": x, **trainable(module)})}


@pytest.mark.parametrize("kind", ["dot-product", "l2-tied", "l2-untied", "l2-offsets",
                                  "contractive-l2", "contractive-scaled-cosine",
                                  "contractive-induced"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_attention_second_derivatives_match_cpu(kind: str, dtype: torch.dtype):
    cpu = make_attention(kind)
    dev = on_device(cpu).to(dtype)
    x, w, mask, causal = setting_inputs("masked" if kind in SETS_ONLY else "masked-causal")
    expected = second_derivatives(cpu, x, w, mask, causal)
    actual = second_derivatives(dev, *to_device((x.to(dtype), w.to(dtype), mask)), causal)
    if dtype == torch.float64:
        assert_matches_cpu(actual, expected, f"{kind} second derivatives")
    else:
        assert_matches_cpu(actual, expected, f"{kind} second derivatives (float32)", 1e-3, 1e-3,
                           cast=True)


def certificates(module: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """Every certificate the module gives, for a set size, a range of sizes (where taken) and
    a tensor of per-row counts on ``device``."""
    counts: dict[str, Any] = {"n": N, "counts": torch.tensor([[1, 3], [N, 2]], device=device)}
    out: dict[str, Tensor] = {}
    if isinstance(module, ContractiveAttention):
        if isinstance(module, ContractiveInducedL2MHA):
            norms: tuple[Any, ...] = (None, "2,inf")
        elif getattr(module, "certificate", "tight") == "thm3.2":
            norms = (None, "inf", 2)
        else:
            norms = (None, "inf", 2, "2,inf")
        for norm in norms:
            for label, n in counts.items():
                out[f"{norm}/{label}"] = module.lipschitz_bound(n, norm)
        return out
    counts["range"] = range(1, N + 1)
    if isinstance(module, L2MHA):
        calls = [("tight", norm, False) for norm in ("inf", 2, "2,inf")]
        if module.offsets is None:
            calls += [("thm3.2", norm, False) for norm in ("inf", 2)]
        else:
            calls += [("tight", norm, True) for norm in ("inf", 2, "2,inf")]
        for method, norm, causal in calls:
            for label, n in counts.items():
                out[f"{method}/{norm}/{causal}/{label}"] = module.lipschitz_bound(
                    n, norm, method, causal=causal)
    elif isinstance(module, ScaledCosineMHA):
        del counts["range"]
        calls = [("tight", "inf"), ("tight", 2), ("tight", "2,inf"), ("lipsformer", "inf"),
                 ("lipsformer", 2)]
        for method, norm in calls:
            for label, n in counts.items():
                out[f"{method}/{norm}/{label}"] = module.lipschitz_bound(n, norm, method)
    elif isinstance(module, InducedL2MHA):
        del counts["counts"]  # (tensor counts: test_host_side_constants_accept_counts_on_device)
        for label, n in counts.items():
            out[label] = module.lipschitz_bound(n)
    else:
        raise AssertionError(f"no certificate for {type(module).__name__}")
    return out


def certificate_results(module: nn.Module, device: torch.device) -> Results:
    values = certificates(module, device)
    total = sum(v.sum() for v in values.values())
    results: Results = {"values": {k: v.detach() for k, v in values.items()}}
    if isinstance(total, Tensor) and total.requires_grad:
        results.update(gradients(total, trainable(module)))
    return results


@pytest.mark.parametrize("kind", [k for k in ATTENTION if k not in NOT_LIPSCHITZ])
def test_attention_certificates_and_their_gradients_match_cpu(kind: str):
    cpu, dev = both(make_attention(kind))
    expected = certificate_results(cpu, torch.device("cpu"))
    actual = certificate_results(dev, DEV)
    values, wanted = actual.pop("values"), expected.pop("values")
    assert_matches_cpu(values, wanted, f"{kind} lipschitz_bound")
    assert_matches_cpu(actual, expected, f"{kind} lipschitz_bound gradients")
    if not isinstance(cpu, ContractiveAttention):  # (those are ratios of two certificates)
        for name, value in wanted.items():
            below = values[name].cpu() < value * (1 - 1e-12)
            assert not below.any(), f"{kind}: certificate {name} below the CPU's on {DEVICE}"


def linearised(module: nn.Module, x: Tensor, w: Tensor, mask: Tensor | None,
               causal: bool) -> Results:
    """f(x) and the closed-form products w^T J_f for one cotangent and a batch of two."""
    y, vjp = module.linearise(x, mask, causal)
    return {"output": y, "vjp": vjp(w), "batched": vjp(torch.stack([w, 2 * w.flip(1)]))}


@pytest.mark.parametrize("kind", ["l2-tied", "l2-orthogonal", "l2-offsets", "contractive-l2",
                                  "contractive-l2-mixed", "contractive-l2-position-bias",
                                  "contractive-l2-output-dropout", "mlp"])
def test_closed_form_products_match_cpu_and_autograd(kind: str):
    if kind == "mlp":
        torch.manual_seed(0)
        cpu, dev = both(LipschitzMLP(DIM, 8, coeff=0.9).double().eval())
    else:
        cpu, dev = both(make_attention(kind))
    x, w, mask, causal = setting_inputs("masked-causal")
    with torch.no_grad():
        expected = linearised(cpu, x, w, mask, causal)
        actual = linearised(dev, *to_device((x, w, mask)), causal)
    assert_matches_cpu(actual, expected, f"{kind}.linearise")
    xd = x.to(DEV).requires_grad_(True)
    (auto,) = torch.autograd.grad((dev(xd, mask.to(DEV), causal) * w.to(DEV)).sum(), xd)
    torch.testing.assert_close(actual["vjp"], auto, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- flowattn.lipschitz


def test_lambert_w_and_phi_inverse_match_cpu_with_their_derivatives():
    def results(x: Tensor) -> Results:
        x = x.detach().clone().requires_grad_(True)
        w = lip.lambertw0(x)
        phi = lip.phi_inverse(x.detach())
        (dw,) = torch.autograd.grad(w.sum(), x, create_graph=True)
        (ddw,) = torch.autograd.grad(dw.sum(), x)
        return {"w": w.detach(), "phi": phi, "dw": dw.detach(), "ddw": ddw}

    x = torch.tensor([0.0, 1e-3, 0.5, math.e, 10.0, 1e3, 1e30], dtype=torch.float64)
    expected, actual = results(x), results(x.to(DEV))
    assert_matches_cpu(actual, expected, "lambertw0", rtol=1e-12, atol=1e-14)
    assert_matches_cpu(lip.lambertw0(x.to(DEV).float()), expected["w"], "lambertw0 (float32)",
                       rtol=1e-6, atol=1e-7, cast=True)
    assert float(actual["w"][3]) == pytest.approx(1.0, abs=1e-15)
    with pytest.raises(InputError):
        lip.lambertw0(torch.tensor([-1.0], device=DEV))


def test_matrix_norms_and_power_iteration_match_cpu():
    w = randn(3, 5, 4, seed=4)

    def results(w: Tensor) -> Results:
        start = torch.linspace(1.0, 2.0, 5, dtype=w.dtype, device=w.device)
        sigma, u, v = lip.power_iteration(w[0], start, tol=1e-13, max_iter=1000)
        seeded = lip.power_iteration(w[1], tol=1e-13, max_iter=1000, generator=cpu_generator())
        estimator = lip.PowerIteration(5, tol=1e-13, max_iter=1000).double().to(w.device)
        return {"inf": lip.matrix_inf_norm(w), "spectral": lip.spectral_norm_exact(w),
                "power": (sigma, u, v), "seeded": seeded, "module": estimator(w[2]),
                "module.u": estimator.u}

    expected, actual = results(w), results(w.to(DEV))
    assert_matches_cpu(actual, expected, "matrix norms")
    torch.testing.assert_close(actual["power"][0], actual["spectral"][0], rtol=1e-10, atol=0)


def test_spectral_norm_bound_and_squarings_certificates_match_cpu():
    """The squarings' upper bound on the device: values and derivatives as on the CPU, the
    certificates that take it as well, and in float32 never below the exact norm (the device's
    products round differently: the float64 squarings and the final lift must cover that)."""
    w = randn(3, 5, 4, seed=4)

    def results(w: Tensor) -> Results:
        w = w.detach().clone().requires_grad_(True)
        value = lip.spectral_norm_bound(w)
        (grad,) = torch.autograd.grad(value.sum(), w)
        wq, wv, wo = l2_weights(w.device)
        out: Results = {"bound": value.detach(), "grad": grad}
        for norm in ("inf", 2, "2,inf"):
            out[f"squarings/{norm}"] = lip.l2_attention_bound(
                range(1, N + 1), wq, wv, wo, norm, spectral_norms="squarings")
        return out

    assert_matches_cpu(results(w.to(DEV)), results(w), "squarings", rtol=1e-9, atol=1e-12)
    g = torch.Generator().manual_seed(9)
    big = torch.randn(6, 20, 128, 128, generator=g, dtype=torch.float64)
    big[:, :10] = big[:, :10] @ torch.diag(torch.logspace(0, -6, 128, dtype=torch.float64))
    big32 = (big * torch.logspace(-3, 3, 6, dtype=torch.float64)[:, None, None, None]).float()
    exact = torch.linalg.matrix_norm(big32.double(), ord=2)
    bound = lip.spectral_norm_bound(big32.to(DEV))
    assert bound.dtype == torch.float32 and is_on_device(bound)
    assert bool((bound.cpu().double() >= exact).all())


def l2_weights(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head W^Q, W^V (H, D, d) and W^O (D, D) of a 2-head, width-4 attention."""
    return (randn(HEADS, DIM, DIM // HEADS, seed=5).to(device),
            randn(HEADS, DIM, DIM // HEADS, seed=6).to(device), randn(DIM, DIM, seed=7).to(device))


def test_certificate_functions_match_cpu_on_device_weights():
    """flowattn.lipschitz's bounds with weights (and counts, margins) on the device."""

    def results(device: torch.device) -> Results:
        wq, wv, wo = l2_weights(device)
        counts = torch.tensor([[1, 2], [N, 7]], device=device)
        margin = torch.tensor([0.5, 1.5], dtype=torch.float64, device=device)
        out: Results = {}
        for norm in ("inf", 2, "2,inf"):
            for label, n in (("n", N), ("range", range(1, N + 1)), ("counts", counts)):
                out[f"tight/{norm}/{label}"] = lip.l2_attention_bound(n, wq, wv, wo, norm)
                out[f"margin/{norm}/{label}"] = lip.l2_attention_bound(
                    n, wq, wv, wo, norm, margin=margin)
                if norm != "2,inf":
                    out[f"thm3.2/{norm}/{label}"] = lip.l2_attention_bound(
                        n, wq, wv, wo, norm, "thm3.2")
            weighted = torch.rand(N, HEADS, generator=cpu_generator(), dtype=torch.float64)
            out[f"weighted/{norm}"] = lip.l2_attention_bound(
                range(1, N + 1), wq, wv, wo, norm, margin=margin,
                weighted_counts=weighted.cumsum(0).to(device))
        for label, n in (("n", N), ("range", range(1, N + 1))):
            out[f"induced/{label}"] = lip.induced_attention_bound(n, 3, wq, wv, wo)
        out["margin_constant"] = lip.logit_margin_constant(counts, margin[:, None, None])
        out["layernorm/inf"] = lip.layernorm_lipschitz_bound(wo[0], DIM, 1e-5, "inf")
        out["layernorm/2"] = lip.layernorm_lipschitz_bound(wo[0], DIM, 1e-5, 2)
        out["centernorm/inf"] = lip.centernorm_lipschitz_bound(wo[0], DIM, "inf")
        out["centernorm/2"] = lip.centernorm_lipschitz_bound(wo[0], DIM, 2)
        return out

    assert_matches_cpu(results(DEV), results(torch.device("cpu")), "certificate functions")


def test_host_side_constants_accept_counts_on_device():
    """The constants computed on the host take count tensors from the device (a masked set's
    counts, ``mask.sum(1)``): induced_core_constant, l2_core_column_constant, and through
    them InducedL2MHA.lipschitz_bound."""
    counts = torch.tensor([1, 2, 5, 9])
    expected = {"induced": lip.induced_core_constant(counts, 3),
                "column": lip.l2_core_column_constant(counts, 0.5)}
    actual = {"induced": lip.induced_core_constant(counts.to(DEV), 3),
              "column": lip.l2_core_column_constant(counts.to(DEV), 0.5)}
    for name in expected:  # host constants: their device is the library's choice
        torch.testing.assert_close(actual[name].cpu(), expected[name], rtol=RTOL, atol=ATOL)
    table = lip.induced_core_constant(range(1, 10), 3)
    torch.testing.assert_close(expected["induced"], table[counts - 1], rtol=RTOL, atol=ATOL)
    cpu, dev = both(make_attention("induced"))  # the module's entry point: a mask's counts
    mask = set_mask(B, N)
    assert_matches_cpu(dev.lipschitz_bound(mask.to(DEV).sum(1)), cpu.lipschitz_bound(mask.sum(1)),
                       "InducedL2MHA.lipschitz_bound(mask.sum(1))")


def test_measured_lipschitz_constants_match_cpu():
    """jacobian, jacobian_norm (inf, 2, 2,inf), mixed_operator_norm, lipschitz_lower_bound."""
    cpu, dev = both(make_attention("contractive-l2"))
    x = randn(N, DIM, seed=8)

    def results(module: nn.Module, x: Tensor) -> Results:
        def f(z: Tensor) -> Tensor:
            return module(z[None])[0]

        jac = lip.jacobian(f, x)
        best, best_x = lip.lipschitz_lower_bound(f, (3, DIM), "inf", restarts=1, steps=3,
                                                 device=x.device)
        return {"jacobian": jac, **{f"norm/{p}": lip.jacobian_norm(f, x, p)
                                    for p in ("inf", 2, "2,inf")},
                "mixed": lip.mixed_operator_norm(jac.reshape(N, DIM, N, DIM)),
                "lower": best, "lower_x": best_x}

    assert_matches_cpu(results(dev, x.to(DEV)), results(cpu, x), "measured constants")


# ----------------------------------------------------------------------------- residual flows

FD, FN, FB = 2, 4, 3  # flows: width, set size, batch
EXACT = LogDetOptions("exact")
TIGHT = InverseOptions(tol=1e-12, max_iter=5000)

BRANCHES: dict[str, tuple[Callable[[], nn.Module], dict[str, bool]]] = {
    "attention": (lambda: ContractiveL2MHA(FD, 1, coeff=0.7), {}),
    "attention-causal": (lambda: ContractiveL2MHA(FD, 1, coeff=0.7, self_offset=1.0),
                         {"causal": True}),
    "induced": (lambda: ContractiveInducedL2MHA(FD, 1, coeff=0.7, inducing=3), {}),
    "cosine": (lambda: ContractiveScaledCosineMHA(FD, 1, coeff=0.7), {}),
    "mlp": (lambda: LipschitzMLP(FD, 8, coeff=0.7), {}),
    "radial": (lambda: RadialInteraction(coeff=0.7, basis=8), {"zero_com": True}),
    "manybody": (lambda: NeighbourhoodInteraction(coeff=0.7, channels=4, hidden=8), {}),
}
ESTIMATORS: dict[str, dict[str, Any]] = {
    "exact": dict(method="exact"),
    "series-backprop": dict(method="series", n_terms=6, n_samples=2, grad="backprop"),
    "series-neumann-gaussian": dict(method="series", n_terms=6, n_samples=2, grad="neumann",
                                    probe="gaussian"),
    "roulette": dict(method="roulette", n_samples=2, grad="neumann"),
    "roulette-poisson-per-set": dict(method="roulette", roulette="poisson", roulette_param=2.0,
                                     roulette_lengths="sample", grad="backprop"),
    "memory-efficient": dict(method="series", n_terms=6, grad="neumann", memory_efficient=True),
}


def make_block(branch: str, estimator: str = "exact",
               inverse: InverseOptions | None = None) -> InvertibleResidual:
    """x + g(x) in float64 around the branch ``branch``, with a seeded CPU probe generator."""
    torch.manual_seed(0)
    factory, kwargs = BRANCHES[branch]
    options = LogDetOptions(**ESTIMATORS[estimator], generator=cpu_generator())
    return InvertibleResidual(factory(), logdet=options, inverse=inverse, **kwargs).double()


def flow_inputs(branch: str = "", seed: int = 9) -> tuple[Tensor, Tensor]:
    """(x, mask) of a batch of sets; centred for the zero-centre-of-mass branches."""
    mask = set_mask(FB, FN)
    x = randn(FB, FN, FD, seed=seed)
    if BRANCHES.get(branch, (None, {}))[1].get("zero_com"):
        x = subtract_mean(x, mask)
    return x, mask


def block_results(block: nn.Module, x: Tensor, mask: Tensor) -> Results:
    x = x.detach().clone().requires_grad_(True)
    y, logdet = block(x, context=mask)
    loss = y.pow(2).sum() + logdet.sum()
    return {"y": y.detach(), "logdet": logdet.detach(),
            **gradients(loss, {"x": x, **trainable(block)})}


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("branch", BRANCHES)
def test_residual_block_forward_logdet_and_gradients_match_cpu(branch: str, estimator: str):
    """Training mode: every log-det estimator, with identical probes and roulette lengths."""
    cpu, dev = both(make_block(branch, estimator))
    x, mask = flow_inputs(branch)
    expected = block_results(cpu, x, mask)
    actual = block_results(dev, *to_device((x, mask)))
    assert_matches_cpu(actual, expected, f"{branch} block, {estimator} log-det")


def branch_for(estimator: str) -> tuple[nn.Module, bool]:
    """The branch (float64, evaluation mode) an estimator of the direct API is tested on."""
    torch.manual_seed(0)
    if "pointwise" in estimator:
        return LipschitzMLP(FD, 8, coeff=0.7).double().eval(), False
    if estimator == "jacobian":
        return NeighbourhoodInteraction(coeff=0.7, channels=4, hidden=8).double(), False
    return ContractiveL2MHA(FD, 1, coeff=0.7).double(), "causal" in estimator


LogDetFn = Callable[[Tensor, Tensor, Tensor, nn.Module, torch.Generator], Any]
LOGDET_FUNCTIONS: dict[str, LogDetFn] = {
    "exact-full": lambda gx, x, m, g, gen: exact_logdet(gx, x, m, create_graph=True,
                                                        chunk_size=3),
    "exact-causal": lambda gx, x, m, g, gen: exact_logdet(gx, x, m, "causal", create_graph=True),
    "exact-pointwise": lambda gx, x, m, g, gen: exact_logdet(gx, x, m, "pointwise",
                                                             create_graph=True),
    "exact-zero-com": lambda gx, x, m, g, gen: exact_logdet(gx, x, m, zero_com=True,
                                                            create_graph=True),
    "series": lambda gx, x, m, g, gen: series_logdet(gx, x, 8, m, 3, generator=gen,
                                                     create_graph=True),
    "series-neumann-zero-com": lambda gx, x, m, g, gen: series_logdet(
        gx, x, 8, m, 3, "gaussian", "neumann", True, gen, create_graph=True),
    "series-pointwise": lambda gx, x, m, g, gen: series_logdet(
        gx, x, 8, m, 2, generator=gen, create_graph=True, structure="pointwise"),
    "roulette": lambda gx, x, m, g, gen: roulette_logdet(gx, x, 2, m, 2, generator=gen,
                                                         create_graph=True),
    "roulette-poisson-per-set": lambda gx, x, m, g, gen: roulette_logdet(
        gx, x, 1, m, 2, "gaussian", "neumann", "poisson", 3.0, "sample", generator=gen,
        create_graph=True),
    "precise-series": lambda gx, x, m, g, gen: precise_series_logdet(
        gx, x, 10, m, generator=gen, create_graph=True, round_samples=8, max_samples=32),
    "jacobian": lambda gx, x, m, g, gen: jacobian_logdet(g.jacobian(x, m), m, zero_com=True),
}


@pytest.mark.parametrize("estimator", LOGDET_FUNCTIONS)
def test_logdet_estimators_match_cpu_with_identical_probes(estimator: str):
    """flows/logdet.py called directly: values and gradients (backprop and Neumann)."""
    cpu, dev = both(branch_for(estimator)[0])
    causal = branch_for(estimator)[1]
    x, mask = flow_inputs()

    def results(branch: nn.Module, x: Tensor, mask: Tensor) -> Results:
        x = x.detach().clone().requires_grad_(True)
        gx = branch(x, mask=mask, causal=causal)
        if "zero-com" in estimator or estimator == "jacobian":
            gx = subtract_mean(gx, mask)
        value = LOGDET_FUNCTIONS[estimator](gx, x, mask, branch, cpu_generator(3))
        estimate = value[0] if isinstance(value, tuple) else value
        return {"value": value, **gradients(estimate.sum(), {"x": x, **trainable(branch)})}

    assert_matches_cpu(results(dev, *to_device((x, mask))), results(cpu, x, mask),
                       f"{estimator} log-det")


def test_logdet_estimators_on_device_are_unbiased_for_the_exact_value():
    """Device probes (not the CPU's): the series to 40 terms with as many probes as needed,
    and per-set roulette lengths on 256 copies of each set, within 5 standard errors."""
    torch.manual_seed(0)
    branch = on_device(ContractiveL2MHA(FD, 1, coeff=0.7).double())
    x, mask = to_device(flow_inputs())
    x = x.requires_grad_(True)
    gx = branch(x, mask=mask)
    exact = exact_logdet(gx, x, mask)
    generator = torch.Generator(device=DEV).manual_seed(0)
    series, variance = precise_series_logdet(gx, x, 40, mask, generator=generator,
                                             round_samples=256, max_error=5e-4,
                                             max_samples=4096)
    assert_on_device((exact, series, variance), "precise_series_logdet")
    bias = FN * FD * 0.7**41 / (41 * 0.3)  # truncation bound of the series
    assert ((series - exact).abs() <= 5 * variance.sqrt() + bias).all(), (series, exact)

    copies = 256
    xr = x.detach().repeat(copies, 1, 1).requires_grad_(True)
    mr = mask.repeat(copies, 1)
    draws = roulette_logdet(branch(xr, mask=mr), xr, 2, mr, 4, lengths="sample",
                            generator=generator).reshape(copies, FB)
    assert_on_device(draws, "roulette_logdet")
    error = draws.std(0) / math.sqrt(copies)
    assert ((draws.mean(0) - exact).abs() <= 5 * error + 1e-9).all(), (draws.mean(0), exact)


def test_evaluation_mode_series_logdet_is_within_its_error_of_exact_on_both_devices():
    """In evaluation mode a set too large for the exact path gets the series with probes from
    a generator seeded on the data's device: CPU and device draw different probes, so each is
    held to the exact log-det within its reported standard error."""
    torch.manual_seed(0)
    branch = ContractiveL2MHA(FD, 1, coeff=0.7).double()
    series_options = LogDetOptions(eval_exact_max_dim=4, eval_max_error=5e-4,
                                   eval_n_samples=64, eval_max_samples=4096)
    block = InvertibleResidual(branch, logdet=series_options).double().eval()
    exact_block = InvertibleResidual(copy.deepcopy(branch), logdet=EXACT).double().eval()
    x, mask = flow_inputs()
    for where, module, (xs, masks) in (("cpu", block, (x, mask)),
                                       (DEVICE, on_device(block), to_device((x, mask)))):
        with torch.no_grad():
            _, logdet = module(xs, context=masks)
            exact = exact_block.to(xs.device)(xs, context=masks)[1]
        variance = module.logdet_variance
        assert variance is not None, f"{where}: the evaluation log-det was not a series"
        if where == DEVICE:
            assert_on_device((logdet, variance), "evaluation-mode series log-det")
        se = variance.sqrt()
        assert ((logdet - exact).abs() <= 5 * se + 1e-6).all(), (where, logdet, exact, se)


def inverse_results(block: nn.Module, x: Tensor, mask: Tensor, w: Tensor) -> Results:
    """Forward, inverse, and the implicit gradients of <x_back, w> + log-det of the inverse."""
    with torch.no_grad():
        y, logdet = block(x, context=mask)
    y = y.clone().requires_grad_(True)
    x_back, logdet_inverse = block.inverse(y, context=mask)
    loss = (x_back * w).sum() + logdet_inverse.sum()
    return {"y": y.detach(), "logdet": logdet, "x_back": x_back.detach(),
            "logdet_inverse": logdet_inverse.detach(),
            **gradients(loss, {"y": y, **trainable(block)})}


@pytest.mark.parametrize("method", ["fixed-point", "anderson"])
@pytest.mark.parametrize("branch", BRANCHES)
def test_residual_block_inverse_round_trip_on_device(branch: str, method: str):
    """x -> y -> x back to 1e-8 in float64 on the device; implicit gradients as on the CPU."""
    block = make_block(branch, inverse=InverseOptions(method, tol=1e-12, max_iter=5000)).eval()
    cpu, dev = both(block)
    x, mask = flow_inputs(branch)
    w = randn(FB, FN, FD, seed=10)
    actual = inverse_results(dev, *to_device((x, mask, w)))
    check_round_trip(x.to(DEV), actual["x_back"], f"{branch} block ({method})")
    torch.testing.assert_close(actual["logdet_inverse"], -actual["logdet"], rtol=0,
                               atol=ROUND_TRIP)
    expected = inverse_results(cpu, x, mask, w)
    assert_matches_cpu(actual, expected, f"{branch} inverse ({method})", rtol=1e-7, atol=1e-9)


def make_chain() -> CompositeTransform:
    """An nflows chain of every exact and residual layer of flowattn.flows (evaluation mode,
    parameters perturbed off the identity)."""
    torch.manual_seed(0)
    residual = dict(logdet=EXACT, inverse=TIGHT)
    chain = CompositeTransform([
        SetLocation(FD, layers=1, hidden=8, bins=4),
        ActNorm(FD),
        EquivariantLinear(FD),
        TransformerResidualPair(ContractiveL2MHA(FD, 1, coeff=0.7),
                                LipschitzMLP(FD, 8, coeff=0.7), **residual),
        SetCoupling(FD, 0, hidden=8, blocks=1, bins=4),
        InvertibleResidual(ContractiveInducedL2MHA(FD, 1, coeff=0.7, inducing=3), **residual),
        SetCoupling(FD, 1, hidden=8, blocks=0, bins=4),
    ]).double().eval()
    perturb(chain, 0.05)
    return chain


def make_particle_chain() -> CompositeTransform:
    """The monotone blocks of particle flows (zero centre of mass), evaluation mode."""
    torch.manual_seed(0)
    chain = CompositeTransform([
        ActNorm(FD, zero_com=True),
        EquivariantLinear(FD, zero_com=True),
        MonotoneResidual(RadialInteraction(coeff=0.7, basis=8, max_slope=2.0), logdet=EXACT,
                         inverse=TIGHT, zero_com=True),
        InverseMonotoneResidual(RadialInteraction(coeff=0.7, basis=8, max_slope=2.0),
                                zero_com=True, tol=1e-13, inverse=TIGHT),
        InvertibleResidual(NeighbourhoodInteraction(coeff=0.7, channels=4, hidden=8),
                           logdet=EXACT, inverse=TIGHT, zero_com=True),
    ]).double().eval()
    perturb(chain, 0.05)
    return chain


def transform_results(chain: nn.Module, x: Tensor, mask: Tensor) -> Results:
    x = x.detach().clone().requires_grad_(True)
    z, logdet = chain(x, context=mask)
    grads = gradients(z.pow(2).sum() + logdet.sum(), {"x": x, **trainable(chain)})
    with torch.no_grad():
        x_back, logdet_inverse = chain.inverse(z, context=mask)
    return {"z": z.detach(), "logdet": logdet.detach(), "x_back": x_back,
            "logdet_inverse": logdet_inverse, **grads}


@pytest.mark.parametrize("make", [make_chain, make_particle_chain], ids=["sets", "particles"])
def test_nflows_transforms_forward_and_inverse_on_device(make: Callable[[], nn.Module]):
    """The nflows Transform interface (context = mask) of every layer, forward and inverse."""
    cpu, dev = both(make())
    x, mask = flow_inputs()
    if make is make_particle_chain:
        x = subtract_mean(x, mask)
    actual = transform_results(dev, *to_device((x, mask)))
    check_round_trip(x.to(DEV), actual["x_back"], make.__name__)
    torch.testing.assert_close(actual["logdet_inverse"], -actual["logdet"], rtol=0,
                               atol=ROUND_TRIP)
    assert_matches_cpu(actual, transform_results(cpu, x, mask), make.__name__, rtol=1e-8,
                       atol=1e-9)


@pytest.mark.parametrize("kind", ["mlp", "radial", "radial-monotone", "manybody"])
def test_branches_match_cpu(kind: str):
    """Branch outputs, closed-form Jacobians, spectra and certificates; the MLP in training
    mode, where every call runs a power iteration on its buffers."""
    torch.manual_seed(0)
    module = {"mlp": lambda: LipschitzMLP(FD, [8, 6], coeff=0.7),
              "radial": lambda: RadialInteraction(coeff=0.7, basis=8),
              "radial-monotone": lambda: RadialInteraction(coeff=0.7, basis=8, max_slope=3.0),
              "manybody": lambda: NeighbourhoodInteraction(coeff=0.7, channels=4, hidden=8),
              }[kind]().double()
    perturb(module, 0.05)
    cpu, dev = both(module)
    x, mask = flow_inputs()

    def results(branch: nn.Module, x: Tensor, mask: Tensor) -> Results:
        x = x.detach().clone().requires_grad_(True)
        y = branch(x, mask=mask)
        y = branch(x, mask=mask)  # a second call: the power iteration moved
        out = {"y": y.detach(), "bound": branch.lipschitz_bound(FN).detach(),
               **gradients(y.pow(2).sum(), {"x": x, **trainable(branch)})}
        if hasattr(branch, "jacobian"):
            out["jacobian"] = branch.jacobian(x.detach(), mask)
        if hasattr(branch, "spectrum"):
            out["spectrum"] = [s.detach() for s in branch.spectrum()]
        out["buffers"] = dict(branch.named_buffers())
        return out

    assert_matches_cpu(results(dev, *to_device((x, mask))), results(cpu, x, mask), kind)


# ----------------------------------------------------------------------------- set flows

FLOWS: dict[str, Callable[[], nn.Module]] = {
    "set-attention": lambda: set_flow(FD, 1, 1, hidden=8, logdet=EXACT, inverse=TIGHT),
    "set-attention-2norm-location": lambda: set_flow(FD, 1, 1, hidden=8, norm="2", location=True,
                                                     logdet=EXACT, inverse=TIGHT),
    "set-induced": lambda: set_flow(
        FD, 1, 1, hidden=8, logdet=EXACT, inverse=TIGHT,
        attention=lambda d, h, c, n: ContractiveInducedL2MHA(d, h, c, inducing=3)),
    "set-linear": lambda: set_flow(FD, 1, 1, hidden=8, interaction="linear", logdet=EXACT,
                                   inverse=TIGHT),
    "set-none": lambda: set_flow(FD, 1, 1, hidden=8, interaction="none", logdet=EXACT,
                                 inverse=TIGHT),
    "particles-radial": lambda: set_flow(FD, 1, 1, hidden=8, zero_com=True, norm="2",
                                         interaction="radial", manybody=True, radial_basis=8,
                                         logdet=EXACT, inverse=TIGHT),
    "particles-monotone": lambda: set_flow(FD, 2, 1, hidden=8, zero_com=True, norm="2",
                                           interaction="radial", radial_basis=8, mlp=False,
                                           radial_max_slope=2.0, radial_inverse=True,
                                           logdet=EXACT, inverse=TIGHT),
    "sequence-causal": lambda: sequence_flow(FD, 1, 1, hidden=8, inverse=TIGHT),
    "coupling": lambda: coupling_flow(FD, layers=2, hidden=8, blocks=1, bins=4),
    "sets-resflow": lambda: build_flow(SetsFlow(blocks=1, hidden=8), FD, FN, False),
    "sets-resflow-induced": lambda: build_flow(SetsFlow(blocks=1, hidden=8, inducing_points=3),
                                               FD, FN, False),
    "sets-resflow-lifted": lambda: build_flow(SetsFlow(blocks=1, hidden=8, heads=2,
                                                       attention_width=4), FD, FN, False),
    "sets-particles": lambda: build_flow(SetsFlow(blocks=1, hidden=8, radial_basis=8), FD, FN,
                                         True),
    "sets-cnf": lambda: build_flow(SetsFlow(flow="cnf", field_hidden=4, ode_tol=1e-9), FD, FN,
                                   False),
    "sets-cnf-egnn": lambda: build_flow(SetsFlow(flow="cnf", field_hidden=8, field_layers=2,
                                                 ode_tol=1e-9), FD, FN, True),
    "sets-coupling": lambda: build_flow(SetsFlow(flow="coupling", coupling_layers=2,
                                                 coupling_hidden=8, coupling_bins=4), FD, FN,
                                        False),
}
ADAPTIVE = {"sets-cnf", "sets-cnf-egnn"}  # dopri5: step sizes follow rounding, compare looser


def make_flow(kind: str) -> SetFlow:
    """The flow ``kind`` in float64, standardised on training sets, parameters perturbed."""
    torch.manual_seed(0)
    flow = FLOWS[kind]().double()
    x, mask = flow_data(flow, seed=11)
    flow.standardise(3 * x + 1, mask)
    flow.initialise_location(3 * x + 1, mask)
    perturb(flow, 0.05)
    return flow


def flow_data(flow: SetFlow, seed: int = 12) -> tuple[Tensor, Tensor]:
    mask = set_mask(FB, FN)
    x = randn(FB, FN, FD, seed=seed)
    return (subtract_mean(x, mask) if flow.zero_com else x), mask


def flow_results(flow: SetFlow, x: Tensor, mask: Tensor) -> Results:
    """log p in evaluation mode; in training mode (ActNorm initialisation, power iterations)
    the loss -mean log p and its gradients."""
    with torch.no_grad():
        log_prob = flow.eval().log_prob(x, mask)
        noise = flow.transform_to_noise(x, mask)
    loss = -flow.train().log_prob(x, mask).mean()
    return {"log_prob": log_prob, "noise": noise, "loss": loss.detach(),
            **gradients(loss, trainable(flow))}


@pytest.mark.parametrize("kind", FLOWS)
def test_set_flow_log_prob_and_gradients_match_cpu(kind: str):
    cpu, dev = both(make_flow(kind))
    x, mask = flow_data(cpu)
    tol = (1e-7, 1e-8) if kind in ADAPTIVE else (RTOL, ATOL)
    assert_matches_cpu(flow_results(dev, *to_device((x, mask))), flow_results(cpu, x, mask),
                       f"{kind} flow", *tol)


@pytest.mark.parametrize("kind", ["set-attention", "set-attention-2norm-location",
                                  "particles-monotone", "sequence-causal", "coupling",
                                  "sets-cnf"])
def test_set_flow_samples_on_device_and_scores_them_as_the_cpu(kind: str):
    """Samples drawn on the device with a device generator: their log-density equals the
    flow's log_prob of them, on the device and on the CPU."""
    cpu, dev = both(make_flow(kind))
    cpu.eval(), dev.eval()
    mask = set_mask(FB, FN).to(DEV)
    with torch.no_grad():
        x, log_p = dev.sample_and_log_prob(FB, mask=mask,
                                           generator=torch.Generator(device=DEV).manual_seed(0))
        assert_on_device((x, log_p), f"{kind} samples")
        again = dev.log_prob(x, mask)
        on_cpu = cpu.log_prob(x.cpu(), mask.cpu())
    tol = 1e-6 if kind in ADAPTIVE else 1e-8
    torch.testing.assert_close(again, log_p, rtol=tol, atol=tol)
    assert_matches_cpu(again, on_cpu, f"{kind} log_prob of samples", rtol=1e-7, atol=1e-8)


def test_boltzmann_sample_weights_on_device():
    flow = on_device(make_flow("particles-radial")).eval()
    sample = boltzmann_sample(flow, dw4_energy, 6, FN, torch.Generator(device=DEV).manual_seed(0),
                              batch_size=4)
    assert_on_device([sample.x, sample.log_q, sample.energy, sample.log_w], "boltzmann_sample")
    with torch.no_grad():
        torch.testing.assert_close(sample.log_w, -dw4_energy(sample.x) - flow.log_prob(sample.x),
                                   rtol=1e-9, atol=1e-9)


def test_data_dependent_initialisation_keeps_every_tensor_on_device():
    """ActNorm's first training batch, SetFlow.standardise and initialise_location run on the
    device: the same state as on the CPU, and no parameter or buffer moves to the CPU."""
    torch.manual_seed(0)
    flow = set_flow(FD, 1, 1, hidden=8, location=True, logdet=EXACT).double()
    cpu, dev = both(flow)
    x, mask = flow_data(cpu, seed=13)

    def results(flow: SetFlow, x: Tensor, mask: Tensor) -> Results:
        flow.standardise(5 * x - 2, mask)
        flow.initialise_location(5 * x - 2, mask)
        flow.train().log_prob(x, mask)  # initialises the block's ActNorm
        return dict(flow.state_dict())

    assert_matches_cpu(results(dev, *to_device((x, mask))), results(cpu, x, mask),
                       "initialised flow state")


# ----------------------------------------------------------------------------- continuous flows

FIELDS: dict[str, Callable[[], nn.Module]] = {
    "attention": lambda: AttentionField(FD, heads=1, layers=2, hidden=4, time_hidden=4),
    "attention-causal": lambda: AttentionField(FD, heads=2, layers=1, hidden=4, time_hidden=4,
                                               causal=True),
    "attention-zero-com-capped": lambda: AttentionField(FD, heads=1, hidden=4, time_hidden=4,
                                                        norm=2, zero_com=True,
                                                        max_lipschitz=2.0),
    "dot-product": lambda: DotProductField(FD, heads=1, layers=2, hidden=4, time_hidden=4),
    "egnn": lambda: EGNNField(FD, hidden=8, layers=2),
}


def field_inputs(field: nn.Module) -> tuple[Tensor, Tensor]:
    mask = set_mask(FB, FN)
    x = randn(FB, FN, FD, seed=14)
    return (subtract_mean(x, mask) if getattr(field, "zero_com", False) else x), mask


def make_cnf(field: str, **kwargs: Any) -> CNF:
    torch.manual_seed(0)
    module = FIELDS[field]().double()
    perturb(module, 0.05)
    kwargs.setdefault("solver", "rk4")
    if kwargs["solver"] == "rk4":
        kwargs.setdefault("solver_options", {"step_size": 0.25})
    return CNF(module, generator=cpu_generator(5), **kwargs).double()


def cnf_results(cnf: CNF, x: Tensor, mask: Tensor) -> Results:
    x = x.detach().clone().requires_grad_(True)
    z, logdet = cnf(x, context=mask)
    loss = z.pow(2).sum() + logdet.sum()
    extras = [cnf.kinetic_energy, cnf.jacobian_frobenius]
    if cnf.regularise:
        loss = loss + sum(e.sum() for e in extras)
    return {"z": z.detach(), "logdet": logdet.detach(),
            "regularisers": [None if e is None else e.detach() for e in extras],
            **gradients(loss, {"x": x, **trainable(cnf)})}


@pytest.mark.parametrize("divergence", ["exact", "hutchinson"])
@pytest.mark.parametrize("field", FIELDS)
def test_cnf_fixed_step_solve_and_gradients_match_cpu(field: str, divergence: str):
    """rk4 on a fixed grid, RNODE regularisers on, identical Hutchinson probes."""
    cpu, dev = both(make_cnf(field, divergence=divergence, regularise=True))
    x, mask = field_inputs(cpu.field)
    assert_matches_cpu(cnf_results(dev, *to_device((x, mask))), cnf_results(cpu, x, mask),
                       f"CNF({field}, {divergence})")


@pytest.mark.parametrize("n", [4, 9])  # every order tried; greedy and exchanges
def test_aligned_draws_and_the_aligned_matching_loss_match_cpu(n: int):
    from flowattn.flows.continuous.alignment import align

    mask = torch.ones(FB, n, dtype=torch.bool)
    mask[0, -2:] = False
    x = subtract_mean(randn(FB, n, FD, seed=21), mask)
    z = subtract_mean(randn(FB, n, FD, seed=22), mask)
    t = torch.rand(FB, generator=cpu_generator(23), dtype=torch.float64)
    expected = align(z, x, mask, rotations=True)
    actual = align(*to_device((z, x, mask)), rotations=True)
    assert_matches_cpu(actual, expected, "align", rtol=1e-7, atol=1e-9)
    cpu, dev = both(make_cnf("egnn"))

    def results(cnf: CNF, x: Tensor, mask: Tensor, z: Tensor, t: Tensor) -> Results:
        loss = cnf.matching_loss(x, mask, noise=z, times=t, alignment="euclidean")
        return {"loss": loss.detach(), **gradients(loss.sum(), trainable(cnf))}

    assert_matches_cpu(results(dev, *to_device((x, mask, z, t))), results(cpu, x, mask, z, t),
                       "aligned matching", rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("field", ["attention", "egnn"])
def test_cnf_adjoint_gradients_match_cpu(field: str):
    cpu, dev = both(make_cnf(field, adjoint=True))
    x, mask = field_inputs(cpu.field)
    assert_matches_cpu(cnf_results(dev, *to_device((x, mask))), cnf_results(cpu, x, mask),
                       f"CNF({field}, adjoint)")


@pytest.mark.parametrize("field", ["attention-causal", "egnn"])
def test_cnf_adaptive_solve_matches_cpu_and_inverts_on_device(field: str):
    """dopri5 at tolerance 1e-10: the device and the CPU take the same steps up to rounding."""
    cpu, dev = both(make_cnf(field, solver="dopri5", atol=1e-10, rtol=1e-10).eval())
    x, mask = field_inputs(cpu.field)
    xd, md = to_device((x, mask))
    with torch.no_grad():
        actual, expected = dev(xd, context=md), cpu(x, context=mask)
        x_back, logdet_inverse = dev.inverse(actual[0], context=md)
    assert_matches_cpu(actual, expected, f"CNF({field}, dopri5)", rtol=1e-7, atol=1e-9)
    check_round_trip(xd, x_back, f"CNF({field}) inverse", tol=1e-7)
    torch.testing.assert_close(logdet_inverse, -actual[1], rtol=0, atol=1e-7)


@pytest.mark.parametrize("field", FIELDS)
def test_vector_fields_divergences_and_field_bounds_match_cpu(field: str):
    """The fields at a time t, exact_divergence / hutchinson_divergence of them, and the
    certified bound of the attention fields for set sizes given on the device."""
    torch.manual_seed(0)
    module = FIELDS[field]().double()
    perturb(module, 0.05)
    cpu, dev = both(module)
    x, mask = field_inputs(cpu)
    probe = randn(FB, FN, FD, seed=15) * mask[..., None]

    def results(f: nn.Module, x: Tensor, mask: Tensor, probe: Tensor) -> Results:
        t = torch.tensor(0.3, dtype=x.dtype, device=x.device)
        z = x.detach().clone().requires_grad_(True)
        zero_com = getattr(f, "zero_com", False)
        value, div, frob = exact_divergence(lambda y, m: f(t, y, mask=m), z, mask, zero_com,
                                            frobenius=True)
        out = {"field": value.detach(), "divergence": div, "frobenius": frob,
               "hutchinson": hutchinson_divergence(f(t, z, mask=mask), z, probe, mask, zero_com,
                                                   frobenius=True)}
        if isinstance(f, AttentionField):
            sizes = mask.sum(1)
            out["bound"] = f.lipschitz_bound(sizes)
            out["bound_at_t"] = f.lipschitz_bound(sizes, t)
        return out

    assert_matches_cpu(results(dev, *to_device((x, mask, probe))), results(cpu, x, mask, probe),
                       f"{field} field")


# ----------------------------------------------------------------------------- language models

V, T = 11, 8
LM_CASES: dict[str, dict[str, Any]] = {
    **{attention: dict(attention=attention) for attention in ATTENTIONS},
    "dp-post-norm": dict(attention="dp", norm_position="post"),
    "contractive-offsets": dict(attention="contractive-l2", self_offset=2.0, position_bias=1.0),
    "scaled-cosine-centernorm": dict(attention="scaled-cosine", norm="centernorm",
                                     weighted_residual=True),
    "invertible": dict(invertible=True),
    "invertible-alpha": dict(invertible=True, norm="none", weighted_residual=True),
    "lstm": dict(model="lstm"),
}


def make_lm(case: str, perturbed: bool = True, **changes: Any) -> nn.Module:
    """The LM ``case`` in float64 and evaluation mode; ``perturbed`` moves its parameters off
    their initial values (which hold ties: every position bias starts at 0)."""
    torch.manual_seed(0)
    settings = dict(vocab_size=V, block_size=T, layers=2, dim=8, heads=2)
    settings.update(LM_CASES[case], **changes)
    model = build_model(LMConfig(**settings)).double().eval()
    if perturbed:
        perturb(model, 0.05)
    return model


def lm_tokens() -> tuple[Tensor, Tensor]:
    idx = torch.randint(V, (3, T + 1), generator=cpu_generator(16))
    return idx[:, :-1], idx[:, 1:]


def lm_results(model: nn.Module, idx: Tensor, targets: Tensor) -> Results:
    """Logits in evaluation mode; losses and gradients in training mode (dropout is 0; cuDNN's
    LSTM has no backward in evaluation mode), after which the model is back in evaluation."""
    with torch.no_grad():
        logits, _ = model.eval()(idx)
    _, losses = model.train()(idx, targets)
    model.eval()
    return {"logits": logits, "losses": {k: v.detach() for k, v in losses.items()},
            **gradients(losses["loss"], trainable(model))}


@pytest.mark.parametrize("case", LM_CASES)
def test_language_model_logits_losses_and_gradients_match_cpu(case: str):
    cpu, dev = both(make_lm(case, ortho_attention=0.1, ortho_ff=0.1,
                            ortho_affinity=0.0 if case == "lstm" else 0.1))
    idx, targets = lm_tokens()
    assert_matches_cpu(lm_results(dev, *to_device((idx, targets))),
                       lm_results(cpu, idx, targets), f"{case} LM")
    with torch.no_grad():
        logits32, _ = on_device(cpu).float()(idx.to(DEV))
        assert logits32.dtype == torch.float32
        assert_matches_cpu(logits32, cpu(idx)[0], f"{case} LM (float32)", F32_RTOL, F32_ATOL,
                           cast=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="counts host synchronisations: reads of tensors "
                    "off the CPU, of which a CPU dry run has none")
@pytest.mark.parametrize("case", ["l2-tied", "contractive-l2"])
def test_a_language_model_training_step_synchronises_once_on_the_device(case: str, host_reads):
    """Tied and contractive L2 attention read nothing back on the device (no input checks in
    the stack, no size test, the certificate's counts on the host): one host synchronisation
    per step, the stack's overflow check."""
    model = on_device(make_lm(case)).train()
    idx, targets = to_device(lm_tokens())
    model(idx, targets)  # one-time work first
    reads = host_reads(lambda: model(idx, targets)[1]["loss"].backward(), device_only=True)
    assert sum(reads.values()) == 1 and all(k.startswith("validation.py") for k in reads), reads


def test_position_bias_certificate_gradient_at_initialisation_matches_cpu():
    """At initialisation every relative-position bias is 0: the weighted key count of the
    offsets' certificate sorts equal values, and its gradient (which biases count as the n - 1
    largest) must not depend on how the device's sort breaks those ties."""
    cpu, dev = both(make_lm("contractive-offsets", perturbed=False))

    def results(model: nn.Module) -> Results:
        offsets = model.blocks[0].attn.attention.offsets
        counts = offsets.weighted_counts(range(1, T + 1))
        return {"counts": counts.detach(),
                **gradients(counts.sum(), {"position_logit": offsets.position_logit})}

    assert_matches_cpu(results(dev), results(cpu), "LogitOffsets.weighted_counts at init")


@pytest.mark.parametrize("method", ["fixed-point", "anderson"])
@pytest.mark.parametrize("case", ["invertible", "invertible-alpha"])
def test_invertible_language_model_inverts_on_device(case: str, method: str):
    cpu, dev = both(make_lm(case))
    idx, _ = lm_tokens()
    idx_d = idx.to(DEV)
    with torch.no_grad():
        e = dev.embed(idx_d)
        h, _ = dev.hidden_states(e)
        rec = invert_hidden_states(dev, h, tol=1e-12, max_iter=5000, method=method)
        expected = invert_hidden_states(cpu, cpu.hidden_states(cpu.embed(idx))[0], tol=1e-12,
                                        max_iter=5000, method=method)
    check_round_trip(e, rec, f"{case} LM ({method})")
    assert_matches_cpu(rec, expected, f"{case} LM inverse", rtol=1e-9, atol=1e-10)
    report = reconstruction_report(dev, idx_d, tol=1e-12, max_iter=5000, method=method)
    assert report["max_error"] <= ROUND_TRIP and report["token_accuracy"] == 1.0, report
    assert_matches_cpu(dev.lipschitz_bounds(), cpu.lipschitz_bounds(), f"{case} LM bounds")


@pytest.mark.parametrize("case", ["dp", "contractive-l2", "invertible", "lstm"])
def test_generation_draws_the_same_tokens_on_every_device(case: str):
    """generate() draws on the CPU from the given generator: one seed, one text."""
    cpu, dev = both(make_lm(case))
    prompt = torch.tensor([[1, 4, 2]])
    expected = cpu.generate(prompt, 12, temperature=0.9, top_k=5, generator=cpu_generator(17))
    actual = dev.generate(prompt.to(DEV), 12, temperature=0.9, top_k=5,
                          generator=cpu_generator(17))
    assert_on_device(actual, f"{case} generate")
    assert torch.equal(actual.cpu(), expected), (actual, expected)


# ----------------------------------------------------------------------------- importance.py


def test_importance_sampling_statistics_match_cpu():
    log_w = 3 * randn(50, seed=18)
    log_w[7] = -math.inf  # a draw the target rules out
    values = randn(50, seed=19)

    def results(log_w: Tensor, values: Tensor) -> Results:
        return {"ess": kish_ess(log_w), "weights": normalised_weights(log_w),
                "mean": self_normalised_mean(log_w, values), "log_z": log_mean_weight(log_w)}

    assert_matches_cpu(results(*to_device((log_w, values))), results(log_w, values),
                       "importance statistics")


# ----------------------------------------------------------------------------- command line

LM_TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--block-size", "16",
           "--batch-size", "4", "--no-progress", "--no-tensorboard"]
SETS_TINY = ["--data", "gaussian-sets", "--num-train", "64", "--batch-size", "16",
             "--no-progress", "--no-tensorboard", "--blocks", "1", "--hidden", "16",
             "--val-sets", "16"]


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict]:
    """Run ``flowattn ARGV`` in-process; (exit status, the JSON object of its last line)."""
    code = main([str(a) for a in argv])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


@pytest.mark.slow
def test_lm_command_line_trains_evaluates_inverts_and_samples_on_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "lm"
    code, summary = cli(capsys, "lm", "train", *LM_TINY, "--invertible", "--steps", "4",
                        "--eval-every", "4", "--device", DEVICE, "--out", out, "--json")
    assert code == 0 and summary["step"] == 4 and not summary["diverged"], summary
    losses = {device: cli(capsys, "lm", "eval", "--checkpoint", out, "--device", device,
                          "--json")[1]["val_loss"] for device in (DEVICE, "cpu")}
    assert losses[DEVICE] == pytest.approx(losses["cpu"], rel=1e-5), losses
    code, report = cli(capsys, "lm", "invert-check", "--checkpoint", out, "--device", DEVICE,
                       "--dtype", "float64", "--tol", "1e-12", "--threshold", "1e-8",
                       "--sequences", "4", "--json")
    assert code == 0 and report["passed"] and report["token_accuracy"] == 1.0, report
    texts = {device: cli(capsys, "lm", "sample", "--checkpoint", out, "--device", device,
                         "--max-new-tokens", "20", "--seed", "3", "--json")[1]["text"]
             for device in (DEVICE, "cpu")}
    assert texts[DEVICE] == texts["cpu"], texts


@pytest.mark.slow
def test_sets_command_line_fits_evaluates_and_samples_on_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "sets"
    code, summary = cli(capsys, "sets", "fit", *SETS_TINY, "--steps", "4", "--eval-every", "4",
                        "--device", DEVICE, "--out", out, "--json")
    assert code == 0 and summary["step"] == 4 and math.isfinite(summary["test_nll"]), summary
    data = tmp_path / "test.npz"
    save_npz(data, torch.randn(10, 8, 2, generator=cpu_generator(20)))
    nll = {device: cli(capsys, "sets", "eval", "--checkpoint", out, "--data", data, "--device",
                       device, "--json")[1]["nll"] for device in (DEVICE, "cpu")}
    assert nll[DEVICE] == pytest.approx(nll["cpu"], rel=1e-5), nll
    samples = tmp_path / "samples.npz"
    code, _ = cli(capsys, "sets", "sample", "--checkpoint", out, "--num", "5", "--set-size", "6",
                  "--device", DEVICE, "--out", samples)
    assert code == 0 and samples.is_file()


@pytest.mark.skipif(DEV.type != "cuda", reason="needs a CUDA device: it checks what torch's "
                    "CUDA caching allocator holds")
def test_the_memory_available_on_a_gpu_counts_what_torchs_cache_holds_unused():
    from flowattn.training.memory import available_memory

    block = torch.empty(64 * 2**20, dtype=torch.uint8, device=DEV)
    del block  # 64 MiB now cached by torch, not free for the driver
    assert available_memory(DEV) - torch.cuda.mem_get_info(DEV)[0] >= 64 * 2**20


def test_the_memory_probe_leaves_the_devices_random_streams_as_they_were():
    from flowattn.training.memory import pass_bytes

    torch.manual_seed(3)
    model = torch.nn.Linear(16, 16).to(DEV)
    cpu = torch.get_rng_state()
    accelerator = torch.cuda.get_rng_state_all() if DEV.type == "cuda" else []
    saved = pass_bytes(model, lambda k: model(torch.randn(k, 16, device=DEV)).sum())
    assert saved.per_item == 16 * 4  # the input row, drawn on the device
    assert torch.equal(torch.get_rng_state(), cpu)
    after = torch.cuda.get_rng_state_all() if DEV.type == "cuda" else []
    assert all(torch.equal(a, b) for a, b in zip(accelerator, after, strict=True))
