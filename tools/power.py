"""Test power: break each guarantee on purpose and check that a test fails.

Every certificate is halved in turn (each ``return`` of the function that computes it is
multiplied by 0.5), and a few structural guarantees are broken by a one-line edit (the roulette
estimator's reweighting and signs, the centring of the attention's queries, the
zero-centre-of-mass factors, the inverse's tolerance, the log-dets of exact layers, the
divergence of continuous flows, the errors of importance sampling). For each such mutant the
test files that cover it are run with ``pytest -x``; the mutant is *killed* when a test fails.
A mutant that survives marks a guarantee no test would defend: a one-sided check of a loose
bound, or none.

The mutants are made in a copy of ``flowattn/`` and ``tests/`` in a temporary directory, so the
working tree is never touched (an interrupted run leaves it as it was).

Usage (from the repository root; most mutants are killed within 10-20 s, a few only after a
whole test file has run, up to 2-3 minutes each)::

    OMP_NUM_THREADS=1 python tools/power.py            # every mutant
    OMP_NUM_THREADS=1 python tools/power.py lipswish   # those whose name contains it

Exit status 0 when every mutant is killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ATTENTION = ("tests/test_lipschitz.py", "tests/test_attention.py",
             "tests/test_attention_offsets.py", "tests/test_attention_induced.py")
MLP = ("tests/branches/test_mlp.py",)
PARTICLES = ("tests/branches/test_particle_branches.py",)
FIELDS = ("tests/flows/continuous",)
FLOWS = ("tests/flows",)


def first(path: str, tests: tuple[str, ...] = ATTENTION) -> tuple[str, ...]:
    """``tests`` (files) with ``path`` run first: pytest keeps the order of files, and -x stops
    at a kill. (A file inside a directory also given is collected in the directory's order:
    there a mutant names its killing test alone, by node id.)"""
    return (path, *(t for t in tests if t != path))


@dataclass(frozen=True)
class Halved:
    """Multiply every value returned by ``function`` (``Class.method`` or a name) by 0.5."""

    file: str
    function: str
    tests: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"halve {self.function}"

    def apply(self, source: str) -> str:
        node = _find(ast.parse(source), self.function.split("."))
        returns = [r for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
        if not returns:
            raise SystemExit(f"{self.file}: {self.function} returns nothing to halve")
        starts = [0]
        for line in source.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        spans = [(starts[r.value.lineno - 1] + r.value.col_offset,
                  starts[r.value.end_lineno - 1] + r.value.end_col_offset) for r in returns]
        for a, b in sorted(spans, reverse=True):
            source = f"{source[:a]}0.5 * ({source[a:b]}){source[b:]}"
        return source


@dataclass(frozen=True)
class Edited:
    """Replace the one occurrence of ``old`` in ``file`` by ``new``."""

    file: str
    label: str
    old: str
    new: str
    tests: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.label

    def apply(self, source: str) -> str:
        if source.count(self.old) != 1:
            raise SystemExit(f"{self.file}: {self.old!r} occurs {source.count(self.old)} times "
                             "(the mutant list needs updating)")
        return source.replace(self.old, self.new)


def _find(tree: ast.AST, parts: list[str]) -> ast.AST:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.FunctionDef | ast.ClassDef) and child.name == parts[0]:
            return child if len(parts) == 1 else _find(child, parts[1:])
    raise SystemExit(f"no {'.'.join(parts)} (the mutant list needs updating)")


LIP_ATTENTION = "flowattn/lipschitz/attention.py"
LIP_CORE = "flowattn/lipschitz/core.py"
LIP_LAMBERTW = "flowattn/lipschitz/lambertw.py"
LIP_NORMALIZATION = "flowattn/lipschitz/normalization.py"
LIP_NORMS = "flowattn/lipschitz/norms.py"
MUTANTS = [
    # certificates of attention and their constants
    Halved(LIP_ATTENTION, "_tight_l2_attention_bound", ATTENTION),
    Halved(LIP_ATTENTION, "_mixed_norm_bound", ATTENTION),
    Halved(LIP_ATTENTION, "_theorem_3_2", ATTENTION),
    Edited(LIP_ATTENTION,
           "Theorem 3.2's 2-norm bound as printed: ||W^{Q,h}||^2, not its fourth power",
           "spectral(w_q) ** 4 * spectral(w_v) ** 2", "spectral(w_q) ** 2 * spectral(w_v) ** 2",
           ATTENTION),
    Edited(LIP_ATTENTION,
           "the mixed norm's d x d reduction through QR's R (NaN for a zeroed head)",
           "rm = (q.mT @ w_q) @ m", "rm = torch.linalg.qr(w_q).R @ m", ATTENTION),
    Halved(LIP_ATTENTION, "_pairwise_spectral", ATTENTION),
    Halved(LIP_NORMS, "spectral_norm_exact", ATTENTION),
    Halved(LIP_NORMS, "matrix_inf_norm", ATTENTION),
    Halved(LIP_LAMBERTW, "lambertw0", ATTENTION),
    Edited(LIP_LAMBERTW, "lambertw0 with one Halley step by default",
           "iterations: int = 3, check", "iterations: int = 1, check", ATTENTION),
    Halved(LIP_LAMBERTW, "phi_inverse", ATTENTION),
    Halved(LIP_CORE, "logit_margin_constant", ATTENTION),
    Halved(LIP_CORE, "l2_core_column_constant", ATTENTION),
    Halved(LIP_CORE, "l2_core_kernel_constant", ATTENTION),
    Edited(LIP_CORE, "kernel constant with sqrt(c) for 2 sqrt(c)",
           "n**0.25 * (1 + 2 * math.sqrt(c)) + 2 * c",
           "n**0.25 * (1 + math.sqrt(c)) + 2 * c", ATTENTION),
    Edited(LIP_ATTENTION, "kernel constant for causal calls and offsets too",
           "if margin is None and causal is False:", "if True:", ATTENTION),
    Edited(LIP_CORE, "core column constant without the other points' pull",
           "_rank_one_bracket(lows, highs, 2 * u1 * pull)",
           "_rank_one_bracket(lows, highs, 0 * pull)", ATTENTION),
    Edited(LIP_CORE,
           "rank-one bracket without its room (sqrt(1 + h^2) for sqrt(1 + h^2 / (1 - a^2)))",
           "torch.sqrt(1 + reach**2 / room.clamp_min(1e-300))", "torch.sqrt(1 + reach**2)",
           ATTENTION),
    Edited(LIP_CORE, "rank-one bracket at the upper end of g only",
           "return torch.maximum(bound(lows), bound(highs))", "return bound(highs)", ATTENTION),
    Edited(LIP_ATTENTION, "2-norm's head scalings not inverse on the two stacks",
           "spectral((w_q / lam).permute", "spectral((w_q / lam.sqrt()).permute", ATTENTION),
    Edited(LIP_CORE, "diagonal block constant without the offsets' margin",
           "others = (n - 1) * math.exp(0.0 if margin is None else margin)",
           "others = (n - 1)", ATTENTION),
    Edited(LIP_CORE, "diagonal block constant's peak shifted (e^{-1.7} for e^{-3/2})",
           "count * math.exp(-1.5)", "count * math.exp(-1.7)", ATTENTION),
    Halved(LIP_CORE, "l2_core_row_constant", ATTENTION),
    Edited(LIP_CORE, "row constant's closed form below its threshold (S >= 4, not 5.74)",
           "_ROW_THRESHOLD = 5.74", "_ROW_THRESHOLD = 4.0", ATTENTION),
    Edited(LIP_CORE, "row constant's count off (S = c e^c for c e^{c + 1})",
           "count = c * torch.exp(c + 1)", "count = c * torch.exp(c)", ATTENTION),
    Edited(LIP_ATTENTION, "mixed norm's per-head form with half the row constants",
           "per_head = (rows * beta", "per_head = (0.5 * rows * beta", ATTENTION),
    Edited(LIP_ATTENTION, "mixed norm's per-head form with ||M_h||^2 for ||M_h||",
           "gamma.diagonal().clamp_min(tiny).sqrt()", "gamma.diagonal().clamp_min(tiny)",
           ATTENTION),
    Edited(LIP_CORE, "crowded column floor e^{-2 u^2} for the proved e^{-4 u^2}",
           "floor = q * torch.exp(-4 * u1**2)", "floor = q * torch.exp(-2 * u1**2)", ATTENTION),
    Edited(LIP_ATTENTION, "crowded columns for causal calls too",
           "full = margin is None and causal is False", "full = margin is None", ATTENTION),
    Edited(LIP_CORE, "core column constant's margin rounded down, not up",
           "math.ceil(float(margin) * 64) / 64", "math.floor(float(margin) * 64) / 64",
           ATTENTION),
    Halved(LIP_ATTENTION, "induced_attention_bound", first("tests/test_attention_induced.py")),
    Halved(LIP_CORE, "induced_core_constant", first("tests/test_attention_induced.py")),
    Halved(LIP_NORMALIZATION, "layernorm_lipschitz_bound",
           (*ATTENTION, "tests/test_lm_model.py")),
    Halved(LIP_NORMALIZATION, "centernorm_lipschitz_bound",
           (*ATTENTION, "tests/test_lm_model.py")),
    Halved("flowattn/attention/offsets.py", "LogitOffsets.weighted_counts",
           first("tests/test_attention_offsets.py")),
    Halved("flowattn/attention/offsets.py", "LogitOffsets.margin",
           first("tests/test_attention_offsets.py")),
    Halved("flowattn/attention/cosine.py", "ScaledCosineMHA._tight_bound", ATTENTION),
    Halved("flowattn/attention/cosine.py", "ScaledCosineMHA.lipschitz_bound", ATTENTION),
    Halved("flowattn/attention/contractive.py", "ContractiveAttention.lipschitz_bound",
           ATTENTION),
    Edited("flowattn/attention/contractive.py", "a NaN or Inf certificate not refused",
           "    assert_finite(bound, f\"the certified",
           "    (lambda *a: None)(bound, f\"the certified",
           ("tests/test_attention.py",)),
    Edited("flowattn/attention/contractive.py", "a NaN certificate taken as 1",
           "torch.where(bound == 0, torch.ones_like(bound), bound)",
           "torch.where(bound > 0, bound, torch.ones_like(bound))",
           ("tests/test_attention.py", "tests/flows/test_entry_checks.py")),
    Edited("flowattn/attention/contractive.py", "shared certificates handed to the wrong layers",
           "tables.update(zip(keys, bounds", "tables.update(zip(keys[::-1], bounds",
           ("tests/test_attention.py", "tests/test_lm_model.py")),
    Halved("flowattn/attention/induced.py", "InducedL2MHA.lipschitz_bound",
           ("tests/test_attention_induced.py",)),
    Halved("flowattn/branches/lifted.py", "LiftedL2MHA.lipschitz_bound",
           ("tests/branches/test_lifted.py",)),
    # the other branches
    Halved("flowattn/branches/mlp.py", "LipSwish.lipschitz_bound", MLP),
    Halved("flowattn/branches/mlp.py", "SpectralLinear.lipschitz_bound", MLP),
    Halved("flowattn/branches/mlp.py", "LipschitzMLP.lipschitz_bound", MLP),
    Edited("flowattn/branches/mlp.py", "LipSwish's largest slope below its true value",
           "LIPSWISH_MAX_SLOPE = 1.09984", "LIPSWISH_MAX_SLOPE = 1.05", MLP),
    Halved("flowattn/branches/mlp.py", "CLipSwish.lipschitz_bound", MLP),
    Edited("flowattn/branches/mlp.py", "CLipSwish's largest gain below its true value",
           "CLIPSWISH_MAX_GAIN = 1.10437", "CLIPSWISH_MAX_GAIN = 1.0998", MLP),
    Edited("flowattn/branches/mlp.py", "CLipSwish's second half without its sign",
           "torch.cat([x * s, x * (s - 1)], dim=-1)",
           "torch.cat([x * s, x * (1 - s)], dim=-1)", MLP),
    Edited("flowattn/branches/mlp.py", "CLipSwish's pullback without the second half",
           "return (first + second) * slope - second / 1.1044", "return first * slope", MLP),
    Halved("flowattn/branches/radial.py", "RadialInteraction.lipschitz_bound",
           ("tests/branches/test_radial.py", *PARTICLES)),
    Halved("flowattn/branches/radial.py", "RadialInteraction._dpsi_bound",
           ("tests/branches/test_radial.py", *PARTICLES)),
    Halved("flowattn/branches/manybody.py", "NeighbourhoodInteraction.lipschitz_bound",
           ("tests/branches/test_manybody.py", *PARTICLES)),
    Halved("flowattn/branches/manybody.py", "NeighbourhoodInteraction._raw_bound",
           ("tests/branches/test_manybody.py", *PARTICLES)),
    Halved("flowattn/branches/manybody.py", "_shifted_sum_bound",
           ("tests/branches/test_manybody.py", *PARTICLES)),
    Halved("flowattn/flows/monotone.py", "_Recentred.lipschitz_bound",
           ("tests/flows/test_monotone.py",)),
    Halved("flowattn/flows/residual.py", "branch_bound",
           ("tests/flows/test_residual.py", "tests/flows/test_logdet.py")),
    Halved("flowattn/flows/continuous/fields.py", "AttentionField.raw_lipschitz_bound", FIELDS),
    Halved("flowattn/flows/continuous/fields.py", "AttentionField.lipschitz_bound", FIELDS),
    Edited("flowattn/flows/continuous/fields.py", "a causal field with the full calls' bound",
           "attend.lipschitz_bound(n, self.norm, causal=self.causal)",
           "attend.lipschitz_bound(n, self.norm, causal=False)", FIELDS),
    Halved("flowattn/lm/model.py", "Block.lipschitz_bounds", ("tests/test_lm_model.py",)),
    Halved("flowattn/lm/model.py", "TransformerLM.lipschitz_bounds", ("tests/test_lm_model.py",)),
    # estimators, centring, zero centre of mass, inverses
    Edited("flowattn/flows/logdet.py", "roulette without its 1/P(N >= k) reweighting",
           "* (1.0 / roulette_tail_probability(distribution, param, k - n_exact_terms))",
           "* 1.0", ("tests/flows/test_logdet.py",)),
    Edited("flowattn/flows/logdet.py", "roulette with every term positive",
           "((-1.0) ** (k + 1) / k)", "(1.0 / k)", ("tests/flows/test_logdet.py",)),
    Edited("flowattn/attention/l2.py", "fused L2 attention without its query centring",
           "    q = q - centre\n    if mask is not None:",
           "    q = q - 0.0 * centre\n    if mask is not None:",
           ("tests/test_attention.py", "tests/test_attention_kernels.py")),
    Edited("flowattn/flows/continuous/fields.py", "field bound without the centring's norm",
           "bound = bound * 2 * (nf - 1) / nf", "bound = bound * 1.0", FIELDS),
    Edited("flowattn/flows/residual.py", "branch bound without the centring's norm",
           "bound *= 2.0 if any_size else 2.0 * (n - 1) / n", "bound *= 1.0",
           ("tests/flows/test_residual.py::test_zero_com_factor_is_the_inf_norm_of_the_"
            "projection_and_is_attained",)),
    Edited("flowattn/flows/residual.py", "zero-CoM construction check at its set size alone",
           "branch_bound(branch, check_size, zero_com, any_size=True)",
           "branch_bound(branch, check_size, zero_com)",
           ("tests/flows/test_residual.py::test_a_zero_com_block_refuses_a_branch_the_"
            "centring_would_make_expansive_on_large_sets",)),
    Edited("flowattn/attention/contractive.py", "causal 2-norm calls at their own length",
           "        return self.causal_length\n", "        return length\n",
           ("tests/test_attention.py::test_a_causal_length_fixes_the_2_norm_bound_of_every_"
            "causal_call",)),
    Edited("flowattn/flows/base.py", "n D degrees of freedom in the zero-centre-of-mass space",
           "        n = n - 1\n    return n * z.shape[-1]",
           "        n = n\n    return n * z.shape[-1]",
           ("tests/flows/test_builders.py::test_actnorm_zero_com_keeps_centre_and_uses_"
            "subspace_dimension",)),
    Edited("flowattn/flows/geometry.py", "subtract_mean that subtracts nothing",
           "return (x - mean) * w", "return x * w", (*FLOWS, "tests/branches")),
    Edited("flowattn/flows/inverse.py", "fixed-point inverse stopping 1000x early",
           "        done = res <= tol\n        worst = float(res[~done].max())",
           "        done = res <= 1e3 * tol\n        worst = float(res[~done].max())",
           ("tests/flows/test_inverse.py",)),
    # log-determinants of the exact layers, divergences of continuous flows, weights
    Halved("flowattn/flows/layers.py", "ActNorm._logdet",
           ("tests/flows/test_builders.py::test_actnorm_logdet_matches_brute_force_and_"
            "inverse_round_trips",)),
    Edited("flowattn/flows/layers.py", "EquivariantLinear's log-det with n deviations, not n - 1",
           "logdet = (n - 1) * self.deviation.log_abs_det()",
           "logdet = n * self.deviation.log_abs_det()",
           ("tests/flows/test_equivariant.py::test_logdet_equals_brute_force_jacobian",)),
    Edited("flowattn/flows/setflow.py", "SetFlow without its standardisation's log-det",
           "        logdet = scale_logdet + logdet\n",
           "        logdet = 0 * scale_logdet + logdet\n",
           ("tests/flows/test_standardisation.py::test_log_likelihood_of_rescaled_and_shifted_"
            "data_differs_by_exactly_n_d_log_scale",)),
    Edited("flowattn/flows/continuous/divergence.py", "exact divergence off by its probes' sign",
           "div = _event_sum(rows * probes).reshape(k, batch).sum(dim=0)",
           "div = _event_sum(rows * probes.abs()).reshape(k, batch).sum(dim=0)", FIELDS),
    Edited("flowattn/flows/continuous/egnn.py", "EGNN's split first map with h_i and h_j "
           "swapped", "return distances + own[:, :, None] + other[:, None, :]",
           "return distances + own[:, None, :] + other[:, :, None]",
           ("tests/flows/continuous/test_egnn.py",)),
    Edited("flowattn/flows/continuous/egnn.py", "EGNN's passes all at the first pass's times",
           "parts = [self._field(t if t.shape[0] == 1 else t[start:start + chunk],",
           "parts = [self._field(t if t.shape[0] == 1 else t[:chunk],",
           ("tests/flows/continuous/test_egnn.py",)),
    Edited("flowattn/attention/l2.py", "linearise's blocks of rows: one block's term of "
           "every row kept", "others = parts[1] if others is None else others + parts[1]",
           "others = parts[1]", ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "linearise's blocks of rows: each block given its "
           "first row's cotangents", "_recorded(self._block_products, centred, r, dy[..., i, :],",
           "_recorded(self._block_products, centred, r, dy[..., i.start:i.start + 1, :],",
           ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "linearise's blocks of rows also for a P within a "
           "pass", "keep = per_pass(row_bytes, length, x.device) >= length",
           "keep = per_pass(row_bytes, length, x.device) > length",
           ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "linearise's kept P not split for a stack of vectors",
           "if keep and per_pass(vectors * row_bytes, length, x.device) >= length:",
           "if keep:", ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "linearise's blocks of rows: the output's blocks all "
           "of the first rows", "blocks = [slice(start, start + size) for start in",
           "blocks = [slice(0, size) for start in", ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "linearise's kept blocks of rows not split for a "
           "stack of vectors", "for piece in block.split(size, dim=-2)]",
           "for piece in [block]]", ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "recomputed blocks differentiated w.r.t. their "
           "arguments themselves, not aliases", "t.view_as(t) if i in wanted else t", "t",
           ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "recomputed blocks without a graph for higher "
           "derivatives", "allow_unused=True, create_graph=higher)",
           "allow_unused=True, create_graph=False)", ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "recomputed blocks reading the offsets' parameters "
           "themselves", "centred_t, centred_t[..., i], mask, causal, i,\n"
           "                                          *offset_parts)",
           "centred_t, centred_t[..., i], mask, causal, i)",
           ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "recomputed blocks outside the forward's autocast",
           "torch.autocast(device, dtype=dtype, enabled=enabled)",
           "torch.autocast(device, dtype=dtype, enabled=False)",
           ("tests/test_attention_linearise.py",)),
    Edited("flowattn/attention/l2.py", "the L2 logits without the keys' squared norms",
           "k_aug = torch.cat([k, -0.5 * k.pow(2).sum(-1, keepdim=True)], dim=-1)",
           "k_aug = torch.cat([k, 0.0 * k.pow(2).sum(-1, keepdim=True)], dim=-1)", ATTENTION),
    Edited("flowattn/attention/l2.py", "the L2 logits without the down-scaling factor r",
           "        q_aug = q_aug * r\n    k_aug", "        pass\n    k_aug",
           ("tests/test_attention_linearise.py", *ATTENTION)),
    Edited("flowattn/flows/continuous/alignment.py", "assignment sweeps stopped once any row "
           "settles", "if on_cpu and not swap.any():", "if on_cpu and not swap.all():",
           ("tests/flows/continuous/test_alignment.py",)),
    Edited("flowattn/sets/boltzmann.py", "importance weights with the run's own trace",
           "            cnf.eval_divergence = divergence\n",
           "            pass\n",
           ("tests/test_boltzmann.py::test_weights_of_a_continuous_flow_take_the_exact_trace_"
            "whatever_its_evaluation_setting",)),
    Halved("flowattn/importance.py", "kish_ess", ("tests/test_importance.py",)),
    Edited("flowattn/importance.py", "self-normalised mean's error halved",
           "error = (w.pow(2) * (f - mean).pow(2)).sum().sqrt()",
           "error = 0.5 * (w.pow(2) * (f - mean).pow(2)).sum().sqrt()",
           ("tests/test_importance.py",)),
    Edited("flowattn/importance.py", "log mean weight's error halved",
           "error = scaled.std() / (math.sqrt(n) * scaled.mean())",
           "error = 0.5 * scaled.std() / (math.sqrt(n) * scaled.mean())",
           ("tests/test_importance.py",)),
    Edited("flowattn/lm/model.py", "ChannelAffine's inverse off by a tenth of its shift",
           "return y * torch.exp(-self.log_scale) - self.shift",
           "return y * torch.exp(-self.log_scale) - 0.9 * self.shift",
           ("tests/test_lm_model.py",)),
    Edited("flowattn/training/loop.py", "fused AdamW without the caller's betas",
           "return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)",
           "return torch.optim.AdamW(groups, lr=lr, fused=True)",
           ("tests/test_training.py::test_adamw_is_fused_and_computes_the_per_tensor_adamw_with_"
            "its_groups",)),
]


def run(mutant, copy: Path) -> tuple[bool, str, float]:
    """Apply ``mutant`` in ``copy``, run its tests, restore the file. Returns (killed, the
    last line pytest printed, seconds)."""
    path = copy / mutant.file
    original = path.read_text()
    path.write_text(mutant.apply(original))
    start = time.perf_counter()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
            cwd=copy, capture_output=True, text=True,
        )
    finally:
        path.write_text(original)
    # when pytest could not start (nothing on stdout), its error is the last line of stderr
    lines = (result.stdout.strip().splitlines() or result.stderr.strip().splitlines()
             or ["(no output)"])
    # exit status 1: a test failed; anything else (errors, nothing collected) is not a kill
    return result.returncode == 1, lines[-1], time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("match", nargs="?", default="",
                        help="run only the mutants whose name contains this (case-insensitive)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.match.lower() in m.name.lower()]
    if not chosen:
        parser.error(f"no mutant's name contains {args.match!r}")
    survivors = []
    with tempfile.TemporaryDirectory(prefix="flowattn-power-") as tmp:
        copy = Path(tmp)
        for part in ("flowattn", "tests"):
            shutil.copytree(ROOT / part, copy / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
        for part in ("conftest.py", "pyproject.toml"):
            shutil.copy2(ROOT / part, copy / part)
        check = subprocess.run([sys.executable, "-c", "import flowattn; print(flowattn.__file__)"],
                               cwd=copy, capture_output=True, text=True)
        if not check.stdout.startswith(str(copy)):
            print(f"the copy's flowattn is not the one imported ({check.stdout.strip()}): stop",
                  file=sys.stderr)
            return 2
        for i, mutant in enumerate(chosen, 1):
            killed, last, seconds = run(mutant, copy)
            print(f"[{i}/{len(chosen)}] {'killed  ' if killed else 'SURVIVED'} {mutant.name} "
                  f"({mutant.file}; {seconds:.0f} s: {last})", flush=True)
            if not killed:
                survivors.append(mutant.name)
    print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed"
          + (f"; surviving: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
